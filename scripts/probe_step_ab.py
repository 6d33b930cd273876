"""One switch of the decode loop's step, A/B in one process (V2-Lite shape, random weights).

    python scripts/probe_step_ab.py --switch norms|projections|prefetch|splits [--batches 32,128 --contexts 1024
        --steps 64 --prefetch 2 --presets bf16,snapmla --out rows.json]

The switches, off (A) and on (B):
    norms        `DecodeLoop(fused_norms=...)`: transformers' RMSNorm or the fused Triton one
    projections  `snapquant.attention.absorbed.FUSED_PROJECTIONS`: the query / output projections of absorbed
                 attention as torch operations or one Triton launch each
    prefetch     the decode kernels' `l2_prefetch` knob: 0 or --prefetch pages ahead (kernel_options)
    splits       `snapquant.kernels.dispatch.TRIM_PARTIAL_WAVES`: the narrow kernels' split count capped at 32
                 pages a program (A), or fewer splits where that cap leaves a partial last wave (B)
For each preset, batch and context: a cache filled with `context` random latents, then `steps` greedy tokens
through `DecodeLoop` (captured graph), A B A B, every step timed (CUDA events); prints the median ms per step of
each, their ratio with its 95 % bootstrap interval, and the first logits' largest difference relative to the
largest logit. A probe for docs/performance.md; --out keeps the rows (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapquant.bench.eval_gen import build_model, fill_cache

SWITCHES = ("norms", "projections", "prefetch", "splits")


def _ratio_interval(a: list[float], b: list[float], seed: int = 0, n: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(a) / median(b), resampling each side's steps."""
    g = torch.Generator().manual_seed(seed)
    ta, tb = torch.tensor(a), torch.tensor(b)
    ia = torch.randint(len(a), (n, len(a)), generator=g)
    ib = torch.randint(len(b), (n, len(b)), generator=g)
    r = ta[ia].median(1).values / tb[ib].median(1).values
    return float(r.quantile(0.025)), float(r.quantile(0.975))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", choices=SWITCHES, required=True)
    ap.add_argument("--presets", default="bf16,snapmla")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prefetch", type=int, default=2, help="pages ahead for --switch prefetch")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import snapquant
    from snapquant.attention import absorbed
    from snapquant.cache import LatentCache
    from snapquant.eval.generation import DecodeLoop, decoding_plan
    from snapquant.kernels import dispatch

    base = build_model("v2lite", None, torch.bfloat16, "cuda", 102400)
    rows = []
    for preset in args.presets.split(","):
        for c in map(int, args.contexts.split(",")):
            for b in map(int, args.batches.split(",")):
                ids = torch.randint(3, 102400, (b, c + 1), generator=torch.Generator().manual_seed(2)).cuda()
                ms: dict[bool, list[float]] = {False: [], True: []}
                first: dict[bool, torch.Tensor] = {}
                for flag in (False, True, False, True):
                    options = {"l2_prefetch": args.prefetch} if args.switch == "prefetch" and flag else None
                    model = snapquant.patch(base, preset, backend="triton", kernel_options=options).eval()
                    absorbed.FUSED_PROJECTIONS = flag if args.switch == "projections" else True
                    dispatch.TRIM_PARTIAL_WAVES = flag if args.switch == "splits" else True
                    plan = decoding_plan(model, {"do_sample": False})
                    cache = fill_cache(LatentCache(preset, model, max_cache_len=c + args.steps + 1), model, b, c)
                    norms = flag if args.switch == "norms" else "auto"
                    res = DecodeLoop(model, None, steps="graph", time_steps=True, fused_norms=norms).generate(
                        ids, torch.ones_like(ids), max_length=c + 1 + args.steps, plan=plan, cache=cache,
                        keep_logits=1)
                    ms[flag] += [x * 1e3 for x in res.step_seconds[2:]]
                    first[flag] = res.logits[0]
                    del cache, res
                absorbed.FUSED_PROJECTIONS = dispatch.TRIM_PARTIAL_WAVES = True
                a, f = statistics.median(ms[False]), statistics.median(ms[True])
                lo, hi = _ratio_interval(ms[False], ms[True])
                diff = float((first[True] - first[False]).abs().max() / first[False].abs().max())
                row = {"switch": args.switch, "preset": preset, "batch": b, "context": c, "off_ms": a, "on_ms": f,
                       "speedup": a / f, "speedup_ci95": [lo, hi], "n_steps": len(ms[True]),
                       "first_logits_maxdiff_rel": diff, "gpu": torch.cuda.get_device_name(),
                       **({"l2_prefetch": args.prefetch} if args.switch == "prefetch" else {})}
                rows.append(row)
                print(f"{args.switch} {preset} B={b} L={c}: off {a:.2f} ms/step, on {f:.2f} ms/step (x{a / f:.3f} "
                      f"[{lo:.3f}, {hi:.3f}], n = {len(ms[True])} steps each); first logits max diff / max "
                      f"{diff:.2e}", flush=True)
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(rows, indent=1))
    snapquant.unpatch(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
