"""Where the Gluon decode kernels' time goes: time them with parts of their page loop switched off.

    python scripts/probe_gluon_decode.py [--shape 128x16x4096] [--out results/bench/gluon_probe_h200.json]
    python scripts/probe_gluon_decode.py --shape 32x64x8192 --out results/bench/gluon_wide_probe_h200.json

H <= 16 probes the narrow kernels (`gluon_decode` with one slot, `gluon_regs` with --stages slots) and
sweeps their split counts; more heads the 64-row kernel
(`gluon_wide`) on both the snapmla and the bf16 layout, plus a sweep of its split count. The
ABLATE constexpr drops parts of each page's work (the results are then
wrong; only the time means something): 1 the fp8 -> fp16 conversion (gluon_regs: PV's A operand), 2 the QK and RoPE MMAs,
4 the PV MMA, 8 the softmax and P quantization, 16 the TMA copies and their waits. Each row is
timed with CUDA graphs (triton.testing.do_bench_cudagraph) in one process beside our BF16 kernel
and the default SnapMLA kernel, over a cache far larger than L2. Hopper GPU only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from snapquant.atomic import atomic_write_json

ABLATIONS = {0: "full page loop", 1: "no conversion", 2: "no QK/RoPE MMA", 4: "no PV MMA", 8: "no softmax/P",
             16: "no TMA (compute only)", 2 | 4: "no MMAs", 1 | 2 | 4 | 8: "TMA only", 1 | 8: "no conversion, no softmax",
             2 | 4 | 8: "conversion + TMA only", 1 | 16: "no TMA, no conversion"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="128x16x4096", help="BxHxL")
    ap.add_argument("--stages", default="2,3", help="narrow kernel (H <= 16): ring slots to ablate")
    ap.add_argument("--splits", default="2,4,8,16", help="split counts to time (both kernels)")
    ap.add_argument("--no-ablate", action="store_true", help="skip the ablations (time the split counts only)")
    ap.add_argument("--wide8-only", action="store_true", help="H > 16: probe the native FP8 kernels only")
    ap.add_argument("--out", default="results/bench/gluon_probe_h200.json")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs a Hopper GPU", file=sys.stderr)
        return 2
    import triton

    from snapquant.bench.probe_inputs import random_bf16_cache, random_snapmla_cache
    from snapquant.bench.runner import environment
    from snapquant.kernels.mla_decode import mla_decode_plan

    B, H, L = (int(x) for x in args.shape.split("x"))
    seed = 0
    torch.manual_seed(seed)
    r, d = 512, 64
    caches = {"snapmla": random_snapmla_cache(B, L, r, d), "bf16": random_bf16_cache(B, L, r, d)}
    q = torch.randn(B, H, r + d, device="cuda").to(torch.bfloat16)
    tau = 0.07
    fmt_bytes = {"snapmla": r + 2 * d + 4, "bf16": 2 * (r + d)}
    rows = []

    exact: dict[str, torch.Tensor] = {}

    def time_plan(label: str, plan, fmt: str, error: bool = False) -> None:
        """Time one plan; error: also its output's relative L2 distance from the exact default kernel's."""
        try:
            out = plan.run()[0].float()
            us = triton.testing.do_bench_cudagraph(plan.run, rep=200) * 1e3
        except Exception as e:  # e.g. out of shared memory, a ptxas crash on an ablation: report, keep probing
            print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            rows.append({"variant": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            return
        if fmt not in exact:
            exact[fmt] = out
        gbs = B * L * fmt_bytes[fmt] / (us * 1e-6) / 1e9
        flops = B * L * H * 2 * (r + d + r)
        row = {"variant": label, "us": round(us, 1), "GB/s": round(gbs), "TFLOP/s": round(flops / us / 1e6, 1)}
        if error:
            row["rel_l2_vs_exact"] = float((out - exact[fmt]).norm() / exact[fmt].norm())
        rows.append(row)
        print(f"{label:48s} {us:8.1f} us {gbs:7.0f} GB/s {flops / us / 1e6:6.1f} TFLOP/s"
              + (f"  rel-L2 vs exact {row['rel_l2_vs_exact']:.1e}" if error else ""), flush=True)

    time_plan("bf16 (our BF16 kernel)", mla_decode_plan(q, caches["bf16"], tau), "bf16")
    time_plan("snapmla (default tile)", mla_decode_plan(q, caches["snapmla"], tau), "snapmla")
    if H <= 16:  # the narrow kernel (gluon_decode), per ring-slot count
        for stages in (int(s) for s in args.stages.split(",")):
            for ab, what in ({} if args.no_ablate else ABLATIONS).items():
                plan = mla_decode_plan(q, caches["snapmla"], tau, tile="gluon", num_stages=stages)
                plan.launches[0].kwargs["ABLATE"] = ab
                time_plan(f"gluon s{stages} ablate={ab:2d} {what}", plan, "snapmla")
        # split counts per slot count: 1 is gluon_decode's in-place slot, >= 2 gluon_regs (register operands)
        for stages in sorted({1, *(int(s) for s in args.stages.split(","))}):
            plan = mla_decode_plan(q, caches["snapmla"], tau, tile="gluon", num_stages=stages)
            time_plan(f"snapmla narrow s{stages} {plan.launches[0].name} (default: {plan.knobs['num_splits']} splits)",
                      plan, "snapmla", error=True)
            for ns in (int(x) for x in args.splits.split(",")):
                time_plan(f"snapmla narrow s{stages} splits={ns}", mla_decode_plan(
                    q, caches["snapmla"], tau, tile="gluon", num_stages=stages, num_splits=ns), "snapmla", error=True)
    else:  # the 64-row kernel (gluon_wide), both layouts, and its split count
        for fmt in () if args.wide8_only else ("snapmla", "bf16"):
            for ab, what in ({} if args.no_ablate else ABLATIONS).items():
                if fmt == "bf16" and ab & 1:  # nothing to convert
                    continue
                plan = mla_decode_plan(q, caches[fmt], tau, tile="gluon")
                plan.launches[0].kwargs["ABLATE"] = ab
                time_plan(f"{fmt} wide ablate={ab:2d} {what} (splits {plan.knobs['num_splits']})", plan, fmt)
            plan = mla_decode_plan(q, caches[fmt], tau, tile="gluon")
            plan.launches[0].kwargs["SM_ROWS"] = not plan.launches[0].kwargs.get("SM_ROWS", False)
            time_plan(f"{fmt} wide softmax layout flipped (SM_ROWS={plan.launches[0].kwargs['SM_ROWS']})", plan, fmt)
            for ns in (int(x) for x in args.splits.split(",")):
                time_plan(f"{fmt} wide splits={ns}", mla_decode_plan(q, caches[fmt], tau, tile="gluon", num_splits=ns),
                          fmt)
        # native FP8 MMAs (fp8_mma=True): gluon_narrow8 (32 rows, two programs per SM, the default) and
        # gluon_wide8 (64 rows): ablations, constexpr knobs one at a time, split counts
        for bm, knobs8 in ((32, (("CHAINS", (1, 2)), ("STAGES", (2, 3)), ("FAST", (False, True)))),
                           (64, (("CHAINS", (1, 2)), ("STAGES", (2, 3)), ("FAST", (False, True))))):
            name8 = {32: "narrow8", 64: "wide8"}[bm]
            plan8 = mla_decode_plan(q, caches["snapmla"], tau, tile="gluon", fp8_mma=True, block_m=bm)
            base8 = dict(plan8.launches[0].kwargs)
            print(f"({plan8.launches[0].name}: CHAINS {base8['CHAINS']}, STAGES {base8['STAGES']}, "
                  f"splits {plan8.knobs['num_splits']})")
            time_plan(f"snapmla {name8} (fp8_mma=True, block_m={bm})", plan8, "snapmla", error=True)
            for ab, what in ({} if args.no_ablate or bm == 64 else ABLATIONS).items():
                if ab == 0:
                    continue
                plan = mla_decode_plan(q, caches["snapmla"], tau, tile="gluon", fp8_mma=True, block_m=bm)
                plan.launches[0].kwargs["ABLATE"] = ab
                time_plan(f"snapmla {name8} ablate={ab:2d} {what.replace('conversion', 'V^T operand')}", plan,
                          "snapmla")
            for knob, values in knobs8:
                for v in values:
                    if v == base8.get(knob):
                        continue
                    plan = mla_decode_plan(q, caches["snapmla"], tau, tile="gluon", fp8_mma=True, block_m=bm)
                    plan.launches[0].kwargs[knob] = v
                    time_plan(f"snapmla {name8} {knob}={v}", plan, "snapmla", error=True)
            for ns in (int(x) for x in args.splits.split(",")):
                time_plan(f"snapmla {name8} splits={ns}", mla_decode_plan(
                    q, caches["snapmla"], tau, tile="gluon", fp8_mma=True, block_m=bm, num_splits=ns), "snapmla",
                    error=True)
    out = Path(args.out)
    env = environment(torch.device("cuda"))
    atomic_write_json(out, {"shape": args.shape, "seed": seed, "command": " ".join(sys.argv), "environment": env,
                            "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
