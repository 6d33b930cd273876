"""The fused RMSNorm's effect on the decode loop's step, A/B in one process (V2-Lite shape, random weights).

    python scripts/probe_fused_norms.py [--batches 32,128 --context 1024 --steps 64]

For each preset and batch: a cache filled with `context` random latents, then `steps` greedy tokens through
`DecodeLoop` (captured graph) with `fused_norms=False` and `True`, alternating twice (A B A B), every step
timed (CUDA events); prints the median ms per step of each, their ratio, and the first logits' largest
difference relative to the largest logit. A probe for docs/performance.md, not a results file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapquant.bench.eval_gen import build_model, fill_cache


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="bf16,snapmla")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args(argv)
    import snapquant
    from snapquant.cache import LatentCache
    from snapquant.eval.generation import DecodeLoop, decoding_plan

    base = build_model("v2lite", None, torch.bfloat16, "cuda", 102400)
    for preset in args.presets.split(","):
        model = snapquant.patch(base, preset, backend="triton").eval()
        plan = decoding_plan(model, {"do_sample": False})
        for b in map(int, args.batches.split(",")):
            ids = torch.randint(3, 102400, (b, args.context + 1), generator=torch.Generator().manual_seed(2)).cuda()
            ms: dict[bool, list[float]] = {False: [], True: []}
            first: dict[bool, torch.Tensor] = {}
            for flag in (False, True, False, True):
                cache = fill_cache(LatentCache(preset, model, max_cache_len=args.context + args.steps + 1), model, b,
                                   args.context)
                res = DecodeLoop(model, None, steps="graph", time_steps=True, fused_norms=flag).generate(
                    ids, torch.ones_like(ids), max_length=args.context + 1 + args.steps, plan=plan, cache=cache,
                    keep_logits=1)
                ms[flag] += [x * 1e3 for x in res.step_seconds[2:]]
                first[flag] = res.logits[0]
                del cache, res
            a, f = statistics.median(ms[False]), statistics.median(ms[True])
            diff = float((first[True] - first[False]).abs().max() / first[False].abs().max())
            print(f"{preset} B={b} L={args.context}: stock norms {a:.2f} ms/step, fused {f:.2f} ms/step "
                  f"(x{a / f:.3f}, n = {len(ms[True])} steps each); first logits max diff / max {diff:.2e}", flush=True)
        snapquant.unpatch(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
