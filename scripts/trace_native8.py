"""Where a `gluon_narrow8` page goes: per-phase clock stamps from inside the kernel (H200 only).

The device has no profiler, so the kernel's TRACE constexpr stores this SM's `%clock` at six points of
every page (top of the loop, slot ready, QK done, P^ stored, PV done, slot refilled) into a buffer past
the partial outputs. This script runs one traced call per shape (after a warm-up call) and reports, in
clock cycles:

  * the median, mean and 90th percentile length of each phase per page (first page aside), and of a
    whole page (a mean far above the median: stalls on a few pages);
  * the prologue (program start to the first page) and the programs' spans;
  * for programs that share an SM, how much of one program's softmax runs while the other is in each
    phase (the question perf-notes 21-24 left open: do the two programs' softmaxes coincide?).

The stamps cost a few instructions per page (a traced call is a little slower than a plain one); the
output of a traced call is not checked. Writes JSON to --out atomically.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from snapquant.atomic import atomic_write_json

PHASES = ("wait", "qk", "softmax_p", "pv", "refill")  # stamp k -> k + 1 within a page
TRACE_W = 512  # floats per program (gluon_narrow8.TRACE_W)


def _phase_of(stamps: list[int], t: int) -> str | None:
    """The phase a program is in at clock t (stamps: the program's flat per-page stamps)."""
    for p in range(len(stamps) // 6):
        s = stamps[6 * p: 6 * p + 6]
        if s[0] <= t < s[5]:
            for k in range(5):
                if s[k] <= t < s[k + 1]:
                    return PHASES[k]
        if p + 1 < len(stamps) // 6 and s[5] <= t < stamps[6 * p + 6]:
            return "loop"
    return None


def analyse(programs: list[dict]) -> dict:
    """Phase medians, spans, and co-resident phase overlap (see the module docstring)."""
    per_phase: dict[str, list[int]] = {p: [] for p in (*PHASES, "page")}
    prologue, span = [], []
    for pr in programs:
        st = pr["stamps"]
        n = len(st) // 6
        if n == 0:
            continue
        prologue.append(st[0] - pr["start"])
        span.append(st[-1] - pr["start"])
        for p in range(1, n):  # the first page waits for its TMA: left out
            s = st[6 * p: 6 * p + 6]
            for k, name in enumerate(PHASES):
                per_phase[name].append(s[k + 1] - s[k])
            per_phase["page"].append(s[0] - st[6 * p - 6])
    med = {k: statistics.median(v) for k, v in per_phase.items() if v}
    mean = {k: round(statistics.fmean(v)) for k, v in per_phase.items() if v}
    p90 = {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in per_phase.items() if v}
    # co-resident programs: same SM, overlapping spans; sample program A's softmax at 64-cycle steps
    by_sm: dict[int, list[dict]] = {}
    for pr in programs:
        if pr["stamps"]:
            by_sm.setdefault(pr["smid"], []).append(pr)
    counts: dict[str, int] = {}
    pairs = 0
    for progs in by_sm.values():
        for a in progs:
            for b in progs:
                if a is b or not (a["start"] < b["stamps"][-1] and b["start"] < a["stamps"][-1]):
                    continue
                pairs += 1
                st = a["stamps"]
                for p in range(1, len(st) // 6):
                    for t in range(st[6 * p + 2], st[6 * p + 3], 64):
                        ph = _phase_of(b["stamps"], t) or "outside"
                        counts[ph] = counts.get(ph, 0) + 1
    total = sum(counts.values()) or 1
    return {
        "median_cycles": med,
        "mean_cycles": mean,
        "p90_cycles": p90,
        "prologue_cycles_median": statistics.median(prologue) if prologue else None,
        "span_cycles_median": statistics.median(span) if span else None,
        "programs": len(programs),
        "sms": len(by_sm),
        "coresident_pairs": pairs,
        "other_program_during_softmax": {k: round(v / total, 3) for k, v in sorted(counts.items())},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x64x8192,1x128x32768", help="BxHxL,...")
    ap.add_argument("--knobs", default="", help="extra constexprs for every traced call, e.g. 'STAGES=3'")
    ap.add_argument("--out", default="results/bench/h200_trace/trace.json")
    args = ap.parse_args()
    try:
        knobs = {k: int(v) for k, v in (kv.split("=") for kv in args.knobs.split())}
    except ValueError:
        ap.error(f"--knobs: KNOB=int, got {args.knobs!r}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs a Hopper GPU", file=sys.stderr)
        return 2
    from snapquant.bench.probe_inputs import random_snapmla_cache
    from snapquant.bench.runner import environment
    from snapquant.kernels.mla_decode import mla_decode_plan

    seed, r, d, tau = 0, 512, 64, 0.07
    torch.manual_seed(seed)
    results = []
    for shape in args.shapes.split(","):
        B, H, L = (int(x) for x in shape.split("x"))
        cache = random_snapmla_cache(B, L, r, d)
        q = torch.randn(B, H, r + d, device="cuda").to(torch.bfloat16)
        plan = mla_decode_plan(q, cache, tau, tile="gluon", fp8_mma=True, block_m=32)
        first = plan.launches[0]
        if first.name != "decode_gluon_narrow8":
            print(f"{shape}: the plan's page loop is {first.name}, not gluon_narrow8", file=sys.stderr)
            return 2
        o_part = first.args[6]
        n_prog = first.grid[0] * first.grid[1] * first.grid[2]
        # the same strides for the partials, TRACE_W floats per program after them
        big = torch.empty(o_part.numel() + n_prog * TRACE_W, dtype=torch.float32, device="cuda")
        first.args = (*first.args[:6], big[: o_part.numel()].view(o_part.shape), *first.args[7:])
        first.kwargs.update(TRACE=True, **knobs)
        plan.run()  # compile and warm up
        big[o_part.numel():].view(torch.int32).fill_(-1)
        torch.cuda.synchronize()
        plan.run()
        torch.cuda.synchronize()
        raw = big[o_part.numel():].view(torch.int32).view(n_prog, TRACE_W).cpu()
        programs = []
        for row in raw.tolist():
            stamps = []
            for p in range((TRACE_W - 8) // 6):
                s = row[2 + 6 * p: 8 + 6 * p]
                if -1 in s:
                    break
                stamps.extend(s)
            # %clock is 32 bits: unwrap relative to the program's start
            start = row[1]
            stamps = [start + ((t - start) & 0xFFFFFFFF) for t in stamps]
            programs.append({"smid": row[0], "start": start, "stamps": stamps})
        res = {"shape": shape, "splits": plan.knobs.get("num_splits"), "grid": list(first.grid),
               "kwargs": {k: v for k, v in first.kwargs.items() if isinstance(v, (int, bool))},
               **analyse(programs)}
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "kwargs"}), flush=True)
    out = Path(args.out)
    atomic_write_json(out, {"command": " ".join(sys.argv), "seed": seed,
                            "environment": environment(torch.device("cuda")), "results": results})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
