"""Check and time the ping-pong native FP8 kernel (`gluon_pingpong8`) against `gluon_narrow8` and BF16.

Development probe (H200): for each case, the ping-pong kernel's output against `gluon_narrow8`'s (same MMA
sequence per dot product) and the exact kernel's, with e4m3 NaN codes past each request's length; then
CUDA-graph timings at the issue's shapes with its knobs one at a time. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x64x8192,128x128x4096,64x128x8192,1x128x32768,4x64x8192,64x32x4096")
    ap.add_argument("--knobs", default="PINGPONG=0,STAGES=2,STAGES=4,WORKER_REGS=256,CHAINS=1")
    ap.add_argument("--ablate-shape", default="32x64x8192", help="shape of the ablation table ('' for none)")
    ap.add_argument("--ablate", default="0,2,4,8,1,6,14,16", help="ABLATE bits of the ablation table")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--out", default="results/bench/h200_pingpong/probe.json")
    args = ap.parse_args()
    import triton

    from snapquant import PRESETS
    from snapquant.bench.runner import environment
    from snapquant.kernels import PagedMLACache
    from snapquant.kernels.gluon_pingpong8 import _mla_decode_gluon_pingpong8
    from snapquant.kernels.mla_decode import mla_decode_plan

    torch.manual_seed(0)
    r, d, tau = 512, 64, 0.07
    rows: list[dict] = []

    def cache_for(B: int, L: int, lengths: list[int] | None = None, nan_tail: bool = False) -> PagedMLACache:
        cache = PagedMLACache.empty(B, L, r, d, PRESETS["snapmla"], device="cuda")
        codes = torch.randint(0, 0x7F, cache.latent.shape, device="cuda", dtype=torch.uint8)
        codes |= torch.randint(0, 2, cache.latent.shape, device="cuda", dtype=torch.uint8) << 7
        cache.latent.view(torch.uint8).copy_(codes)
        cache.scale.uniform_(0.001, 0.01)
        cache.rope.copy_(torch.randn(cache.rope.shape, device="cuda").to(cache.rope.dtype))
        cache.lengths.copy_(torch.tensor(lengths or [L] * B, device="cuda", dtype=torch.int32))
        if nan_tail:  # e4m3 NaN codes past each request's length in its last page
            for b, n in enumerate(lengths or [L] * B):
                if n % 64:
                    cache.latent[cache.block_table[b, (n - 1) // 64], n % 64:].view(torch.uint8).fill_(0x7F)
        return cache

    def pp_plan(q, cache, **kw):
        plan = mla_decode_plan(q, cache, tau, tile="gluon", fp8_mma=True, block_m=64,
                               num_splits=kw.pop("num_splits", None))
        launch = plan.launches[0]
        launch.kernel = _mla_decode_gluon_pingpong8
        launch.name = "decode_gluon_pingpong8"
        kwargs = {k: v for k, v in launch.kwargs.items() if k not in ("STAGES",)}
        kwargs.update(num_warps=4, STAGES=3)
        kwargs.update(kw)
        launch.kwargs = kwargs
        return plan

    # correctness: tails with NaN codes, partial row tiles, s_q = 2, explicit splits
    for B, S, H, L, lens, ns in () if args.skip_check else ((4, 1, 64, 1024, [1000, 77, 1024, 513], None), (3, 2, 20, 700, [700, 65, 300], 3),
                                 (2, 1, 128, 4096, [4096, 4000], None), (1, 1, 128, 8192, [8100], 16)):
        cache = cache_for(B, L, lens, nan_tail=True)
        q = torch.randn(B, S, H, r + d, device="cuda").to(torch.bfloat16)
        ref = mla_decode_plan(q, cache, tau, tile="gluon", fp8_mma=True, block_m=32, num_splits=ns).run()
        exact = mla_decode_plan(q, cache, tau).run()
        for knobs in ({}, {"PINGPONG": False}, {"STAGES": 2}, {"STAGES": 4}):
            out, lse = pp_plan(q, cache, num_splits=ns, **knobs).run()
            row = {"case": f"B{B} S{S} H{H} L{L} lens{lens} splits{ns}", "knobs": knobs,
                   "finite": bool(torch.isfinite(out).all()),
                   "rel_l2_vs_narrow8": float((out - ref[0]).norm() / ref[0].norm()),
                   "max_abs_vs_narrow8": float((out - ref[0]).abs().max()),
                   "lse_max_vs_narrow8": float((lse - ref[1]).abs().max()),
                   "rel_l2_vs_exact": float((out - exact[0]).norm() / exact[0].norm()),
                   "lse_max_vs_exact": float((lse - exact[1]).abs().max())}
            rows.append(row)
            print(json.dumps(row), flush=True)

    # where the time goes: the same ablation bits on gluon_narrow8 and gluon_pingpong8 (wrong results)
    if args.ablate_shape:
        B, H, L = (int(x) for x in args.ablate_shape.split("x"))
        cache = cache_for(B, L)
        q = torch.randn(B, H, r + d, device="cuda").to(torch.bfloat16)
        for ab in (int(a) for a in args.ablate.split(",")):
            for name in ["narrow8", "pingpong8"] + [f"pingpong8 {kv}" for kv in args.knobs.split(",") if kv]:
                if name == "narrow8":
                    plan = mla_decode_plan(q, cache, tau, tile="gluon", fp8_mma=True)
                else:
                    kw = dict(kv.split("=") for kv in name.split()[1:])
                    plan = pp_plan(q, cache, **{k: int(v) for k, v in kw.items()})
                plan.launches[0].kwargs["ABLATE"] = ab
                us = triton.testing.do_bench_cudagraph(plan.run, rep=200) * 1e3
                rows.append({"shape": args.ablate_shape, "variant": name, "ablate": ab, "us": round(us, 1)})
                print(f"{args.ablate_shape:14s} ablate={ab:2d} {name:28s} {us:8.1f} us", flush=True)

    # timings
    for shape in (s for s in args.shapes.split(",") if s):
        B, H, L = (int(x) for x in shape.split("x"))
        cache = cache_for(B, L)
        bf = PagedMLACache.empty(B, L, r, d, PRESETS["bf16"], device="cuda")
        bf.latent.copy_(torch.randn_like(bf.latent, dtype=torch.float32).to(bf.latent.dtype))
        bf.rope.copy_(torch.randn(bf.rope.shape, device="cuda").to(bf.rope.dtype))
        bf.lengths.fill_(L)
        q = torch.randn(B, H, r + d, device="cuda").to(torch.bfloat16)
        plans = {"bf16": mla_decode_plan(q, bf, tau), "exact": mla_decode_plan(q, cache, tau),
                 "narrow8": mla_decode_plan(q, cache, tau, tile="gluon", fp8_mma=True),
                 "pingpong8": pp_plan(q, cache)}
        for kv in args.knobs.split(","):
            k, v = kv.split("=")
            plans[f"pingpong8 {kv}"] = pp_plan(q, cache, **{k: int(v)})
        base = plans["narrow8"].run()[0]
        for name, plan in plans.items():
            try:
                out = plan.run()[0]
                us = triton.testing.do_bench_cudagraph(plan.run, rep=200) * 1e3
            except Exception as e:  # report, keep probing
                rows.append({"shape": shape, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(shape, name, "ERROR", str(e)[:200], flush=True)
                continue
            row = {"shape": shape, "variant": name, "us": round(us, 1), "splits": plan.knobs.get("num_splits"),
                   "rel_l2_vs_narrow8": float((out.float() - base.float()).norm() / base.float().norm())}
            rows.append(row)
            print(f"{shape:14s} {name:28s} {us:8.1f} us  splits {row['splits']}  vs narrow8 "
                  f"{row['rel_l2_vs_narrow8']:.1e}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"command": " ".join(sys.argv), "environment": environment(torch.device("cuda")),
                               "rows": rows}, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
