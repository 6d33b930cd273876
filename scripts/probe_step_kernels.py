"""Every kernel of the decode loop's captured step, counted: what a step is made of beyond the big GEMMs.

    python scripts/probe_step_kernels.py --out /tmp/step_kernels.json [--batches 32 --contexts 1024,32768]

Builds the V2-Lite-shaped random model (`snapquant.bench.eval_gen.build_model`), and for each preset,
batch and context replays the captured step (experts and norms as `DecodeLoop` runs them) under
torch.profiler (`eval_gen.kernel_table` with every kernel listed): per kernel name its launches and ms per
step, and the step's busy ms and launch count. Prints the table; the JSON keeps it. A probe for deciding
what to fuse next, not a results file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapquant.bench.eval_gen import build_model, step_and_prefill_kernels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--presets", default="bf16,snapmla")
    ap.add_argument("--batches", default="32")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--top", type=int, default=60)
    args = ap.parse_args(argv)
    import snapquant

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    base = build_model("v2lite" if cuda else "tiny", args.layers, torch.bfloat16 if cuda else torch.float32, dev,
                       102400 if cuda else 256)
    rows = []
    for preset in args.presets.split(","):
        model = snapquant.patch(base, preset, backend="triton" if cuda else "reference")
        model.eval()
        for b in map(int, args.batches.split(",")):
            for c in map(int, args.contexts.split(",")):
                t = step_and_prefill_kernels(model, preset, b, c, prompt=16, replays=10, top=args.top)["step"]
                n = sum(k["count"] for k in t["kernels"])
                print(f"== {preset} B={b} L={c}: busy {t['busy_ms']:.2f} ms, {n:.0f} launches in the top {args.top}")
                for k in t["kernels"]:
                    print(f"  {k['ms']:7.3f} ms {k['count']:6.0f}x  {k['name']}")
                rows.append({"preset": preset, "batch": b, "context": c, **t})
        snapquant.unpatch(model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
