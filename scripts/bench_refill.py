#!/usr/bin/env python
"""Does refilling finished decode slots pay? Measured on CPU with the embedded model, projected for gsm8k.

    python scripts/bench_refill.py --n 64 --slots 8 --out results/bench/refill_cpu.json

1. The embedded model (fp32, snapmla, reference backend, 'static' steps: the CUDA graph's fixed-shape step
   run eagerly) generates sq_code_completion's first `--n` prompts (greedy, until "\\n", 48 tokens), sorted
   longest first as lm-eval sorts them, through `snapquant.eval.refill.run_queue` with refill off, on and
   'auto': decode steps, slot utilisation (useful slot-steps / slot-steps), refills, wall time; and whether
   every request's tokens agree across the three.
2. `simulate_steps` (the loop's schedule alone; equal to the measured steps, tests/test_refill.py) gives
   the slot-step saving for (a) those real stop points and (b) a gsm8k-sized queue (1319 requests,
   max_gen_toks 256) under an assumed answer-length distribution (see GSM8K_LENGTHS), at 32 and 128 slots.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path


def gsm8k_lengths(n: int = 1319, seed: int = 0) -> list[int]:
    """Assumed gsm8k answer lengths (tokens to the stop): a worked answer of a few reasoning lines, lognormal
    with median 110 tokens and sigma 0.45 (middle 90 %: ~50-230), plus 5 % that never reach a stop string and
    run to max_gen_toks=256 (greedy loops); capped at 256."""
    rng = random.Random(seed)
    return [256 if rng.random() < 0.05 else min(256, max(2, round(math.exp(rng.gauss(math.log(110), 0.45)))))
            for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--slots", default="8")
    p.add_argument("--check-every", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/bench/refill_cpu.json")
    args = p.parse_args(argv)

    import torch

    import snapquant
    from snapquant.embedded import load_embedded
    from snapquant.eval import calibration
    from snapquant.eval.generation import DecodeLoop, decoding_plan
    from snapquant.eval.refill import run_queue, simulate_steps

    torch.set_num_threads(args.threads)
    model, tok = load_embedded(dtype=torch.float32, device="cpu")
    snapquant.patch(model, "snapmla", backend="reference")
    prompts, _, _, max_new, stops = calibration.build(calibration.parse_setting("sq_code_completion"), args.n)
    ids = sorted((tok.encode(t) for t in prompts), key=len, reverse=True)  # lm-eval's order: longest first
    plan = decoding_plan(model, {"do_sample": False}, 1)
    rows, lengths = [], None
    for slots in [int(x) for x in args.slots.split(",")]:
        tokens = {}
        for refill in (False, True, "auto"):
            loop = DecodeLoop(model, tok, steps="static", check_every=args.check_every)
            t0 = time.perf_counter()
            res = run_queue(loop, ids, slots=slots, max_new_tokens=max_new, plan=plan, stop=stops, refill=refill)
            wall = time.perf_counter() - t0
            tokens[refill] = res.tokens
            rows.append({"workload": "sq_code_completion (embedded, CPU, measured)", "slots": slots,
                         "refill": refill, **res.stats, "wall_s": wall})
            print(json.dumps(rows[-1]), flush=True)
        lengths = [len(t) for t in tokens[False]]
        rows[-3]["agree"] = rows[-2]["agree"] = rows[-1]["agree"] = (
            sum(a == b == c for a, b, c in zip(tokens[False], tokens[True], tokens["auto"], strict=True)) / len(ids))
    sims = []
    for name, lens, slot_list in (("sq_code_completion stop points (embedded)", lengths, (8, 32)),
                                  ("gsm8k assumed (1319, lognormal median 110, 5% to 256)", gsm8k_lengths(), (32, 128))):
        for slots in slot_list:
            off, on = (simulate_steps(lens, slots, args.check_every, r) for r in (False, True))
            sims.append({"workload": name, "n": len(lens), "mean_len": sum(lens) / len(lens), "slots": slots,
                         "steps_off": off["decode_steps"], "steps_on": on["decode_steps"],
                         "util_off": off["utilisation"], "util_on": on["utilisation"],
                         "step_ratio": off["decode_steps"] / on["decode_steps"]})
            print(json.dumps(sims[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from snapquant.atomic import atomic_write_text
    from snapquant.environment import environment

    atomic_write_text(out, json.dumps({"measured": rows, "simulated": sims, "lengths": lengths,
                                       "args": vars(args), "check_every": args.check_every, "threads": args.threads,
                                       "env": environment()}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
