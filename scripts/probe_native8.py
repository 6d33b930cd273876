"""Time the native FP8 kernels' constexpr variants at several shapes, beside BF16 and the exact kernel.

H200 only (Gluon). `scripts/probe_gluon_decode.py` ablates one shape in depth; this one sweeps shapes
for a few variants of `gluon_narrow8` (block_m 32) and `gluon_wide8` (block_m 64), e.g.
"narrow8 FAST=1" or "narrow8 FAST=1 P_DIV=1", split counts ("narrow8 splits=96") and launch options
("narrow8 maxnreg=255"). Each variant's output is compared with the same kernel's launcher default
(identical bits, or the relative L2 distance). Times the whole call (page loop + combine) and the page loop alone (stage 1). Writes JSON
to --out atomically.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from snapquant.atomic import atomic_write_json

SHAPES = "32x64x8192,128x128x4096,64x128x8192,1x128x32768,4x64x8192,64x32x4096"
KERNELS = {"narrow8": 32, "wide8": 64}  # the native FP8 kernels by block_m
VARIANTS = "narrow8,narrow8 FAST=0,narrow8 FAST=1,narrow8 FAST=1 P_DIV=1,wide8,wide8 FAST=0"


def _run_first(plan) -> None:
    """Stage 1 alone: the plan's page loop without the combine."""
    from snapquant.kernels._launch import for_device

    ln = plan.launches[0]
    for_device(ln.kernel, plan.device)[ln.grid](*ln.args, **ln.kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="BxHxL,...")
    ap.add_argument("--variants", default=VARIANTS, help="comma-separated: kernel [KNOB=int ...] [splits=N]")
    ap.add_argument("--out", default="results/bench/h200_native8/probe.json")
    args = ap.parse_args()
    variants = []  # (label, kernel, knobs), checked before anything runs
    for v in args.variants.split(","):
        kernel, *knobs = v.split() or [""]
        if kernel not in KERNELS:
            ap.error(f"--variants: unknown kernel {kernel!r} in {v!r}; one of {sorted(KERNELS)}")
        try:
            variants.append((v, kernel, {k: int(x) for k, x in (kv.split("=") for kv in knobs)}))
        except ValueError:
            ap.error(f"--variants: knobs are KNOB=int, got {v!r}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs a Hopper GPU", file=sys.stderr)
        return 2
    import triton

    from snapquant.bench.probe_inputs import random_bf16_cache, random_snapmla_cache
    from snapquant.bench.runner import environment
    from snapquant.kernels.mla_decode import mla_decode_plan

    seed, r, d, tau = 0, 512, 64, 0.07
    torch.manual_seed(seed)
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        B, H, L = (int(x) for x in shape.split("x"))
        cache = random_snapmla_cache(B, L, r, d)
        bf = random_bf16_cache(B, L, r, d, rope=cache.rope)
        q = torch.randn(B, H, r + d, device="cuda").to(torch.bfloat16)
        plans = {"bf16": (mla_decode_plan(q, bf, tau), None), "exact": (mla_decode_plan(q, cache, tau), None)}
        for v, kernel, kw in variants:
            bm, kw = KERNELS[kernel], dict(kw)
            splits = kw.pop("splits", None)
            plan = mla_decode_plan(q, cache, tau, tile="gluon", fp8_mma=True, block_m=bm, num_splits=splits)
            plan.launches[0].kwargs.update(kw)
            plans[v] = (plan, kernel)
        outs: dict[str, torch.Tensor] = {}
        for name, (plan, kernel) in plans.items():
            try:
                out = plan.run()[0].clone()
                us = triton.testing.do_bench_cudagraph(plan.run, rep=200) * 1e3
                stage1 = triton.testing.do_bench_cudagraph(functools.partial(_run_first, plan), rep=100) * 1e3
            except Exception as e:  # report, keep probing
                rows.append({"shape": shape, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"{shape:14s} {name:28s} ERROR {str(e)[:160]}", flush=True)
                continue
            row = {"shape": shape, "variant": name, "us": round(us, 1), "stage1_us": round(stage1, 1),
                   "splits": plan.knobs.get("num_splits"),
                   "kwargs": {k: v for k, v in plan.launches[0].kwargs.items() if isinstance(v, (int, bool))}}
            if kernel is not None:
                if kernel not in outs:
                    outs[kernel] = out  # the first variant of a kernel is its launcher default
                ref = outs[kernel]
                row["identical_to_default"] = bool(torch.equal(out, ref))
                row["rel_l2_vs_default"] = float((out - ref).norm() / ref.norm())
            rows.append(row)
            print(f"{shape:14s} {name:40s} {us:8.1f} us  stage 1 {stage1:8.1f}  splits {row['splits']}"
                  + (f"  identical {row['identical_to_default']} rel-L2 {row['rel_l2_vs_default']:.1e}"
                     if kernel else ""), flush=True)
    out_path = Path(args.out)
    atomic_write_json(out_path, {"command": " ".join(sys.argv), "seed": seed,
                                 "environment": environment(torch.device("cuda")), "rows": rows})
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
