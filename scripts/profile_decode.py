#!/usr/bin/env python
"""Nsight Compute profiles of the decode kernels beside FlashMLA's, and timings of knob alternatives, in one call.

    python scripts/profile_decode.py run --out results/kernels --ncu-dir $OUT/ncu --budget-s 330

`run` does, within --budget-s seconds (each step skipped when what is left cannot hold it):
  1. `time`: CUDA-graph timings (L2-rotated inputs, snapquant.bench's timer) of the profiled variants and of
     knob alternatives at the H >= 64 shapes (split counts, ring slots, 64-row native FP8), each checked
     against its base variant; this also compiles every kernel, so the profiled processes load them from
     Triton's cache;
  2. one `ncu` process per (shape, variant): `worker` builds one input set, runs the variant three times
     (compiled, warm), then runs it once between cudaProfilerStart/Stop, so ncu (--profile-from-start off)
     profiles exactly the kernels of one warm call: our page loop (+ combine when it splits), FlashMLA's
     split-KV kernel + combine. --cache-control all flushes the caches before every replay pass (honest DRAM
     numbers), --clock-control none leaves the clocks as the benchmarks see them;
  3. each report exported as CSV (details, raw and SASS source pages), parsed by snapquant.bench.ncu into
     <out>/profile_h200.{md,csv}; the timings into <out>/profile_timings_h200.csv.

`summarize --ncu-dir D --out O` re-parses the exports of an earlier run (no GPU). Triton and Gluon kernels carry
line info by default (unless TRITON_DISABLE_LINE_INFO=1), so `--import-source yes` stores their Python source.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapquant.bench import ncu  # noqa: E402  (the repository root first: this checkout, not an installed copy)
from snapquant.environment import git_commit  # noqa: E402

SHAPES = ("64x128x8192", "32x64x8192", "128x16x4096")  # H >= 64 first: a budget cut loses the H = 16 row
VARIANTS = ("snapmla", "flashmla", "bf16", "snapmla+gluon+fp8mma")
# timed (not profiled) at every H >= 64 headline shape: the knob alternatives are cheap once compiled
TIME_SHAPES = ("64x128x8192", "32x64x8192", "128x128x4096", "4x64x8192", "1x128x32768", "128x16x4096")
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables", "ComputeWorkloadAnalysis",
            "WarpStateStats", "SchedulerStats", "Occupancy", "LaunchStats", "SourceCounters")
# named in the raw page so that achieved GB/s is bytes moved over the duration (SpeedOfLight's % is of a peak)
EXTRA_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
WORKER_S = 120  # one profiled process at most (import, inputs, ~40 replay passes per kernel)
EXPECT_WORKER_S = 25  # what one usually takes; a worker is not started with less than this left


# ------------------------------------------------------------------------------------------ alternatives
def alternatives(base: dict[str, Any], shape_rows: int, fp8_p: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """Knob alternatives of one measured base row (name suffix, knobs), only past 16 query rows (the H >= 64
    kernels): half and double the resolved split count for the page loops (one wave of programs is the
    default; a second wave or fewer, longer runs may hide the per-page chain better), for the native FP8
    kernel three and four TMA slots, and where P is quantized to e4m3 (`fp8_p`) the reciprocal division
    (`p_div="rcp"`: what the fma-corrected quotient costs in the softmax, hypothesis H4 of docs/performance.md).
    Every knob here already exists (DecodeOptions); defaults are unchanged."""
    if shape_rows <= 16 or base.get("status") != "ok":
        return []
    knobs = dict(kv.split("=", 1) for kv in str(base.get("resolved") or "").split() if "=" in kv)
    splits = int(knobs.get("num_splits", "0") or 0)
    out: list[tuple[str, dict[str, Any]]] = []
    for s in sorted({max(1, splits // 2), min(64, splits * 2)} - {splits, 0}):
        out.append((f"splits{s}", {"num_splits": s}))
    if base["variant"] == "snapmla+gluon+fp8mma":
        out += [("s3", {"num_stages": 3}), ("s4", {"num_stages": 4})]
    if fp8_p:
        out.append(("rcp", {"p_div": "rcp"}))
    return out


def cmd_time(args: argparse.Namespace) -> int:
    """CUDA-graph timings of the variants and their alternatives (one process; rows to --out-csv)."""
    import torch

    from snapquant.bench import harness, results
    from snapquant.bench.shapes import parse_shapes
    from snapquant.bench.timing import CudaGraphTimer
    from snapquant.bench.variants import BY_NAME

    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = CudaGraphTimer(runs=15, target_ms=2.0)
    budget = harness.Budget(args.budget_s)
    rows: list[dict[str, Any]] = [harness.measure_read(dev)]
    print(f"read bandwidth: {rows[0].get('gbps', float('nan')):.0f} GB/s", flush=True)
    for shape in parse_shapes(args.shapes):
        if not budget.ok(10):
            print(f"[{shape.label}] skipped: time budget", flush=True)
            continue
        # our BF16 first: the FP8 rows and FlashMLA's are checked against its output
        base_vs = sorted((BY_NAME[n] for n in args.variants.split(",") if BY_NAME[n].applies(shape)),
                         key=lambda v: v.name != "bf16")
        layouts = {v.layout for v in base_vs} | {"bf16"}
        data = harness.build_shape_data(shape, layouts, dev, max_sets=8)
        print(f"[{shape.label}] {data.n_sets} rotating set(s)", flush=True)
        rows_here = []
        for v in base_vs:
            row = harness.measure_decode(v, data, timer, num_sms, print, keep_output=True,
                                         time_left=lambda: budget.left() - 5)
            rows_here.append(row)
            print(harness._describe(row), flush=True)
        for base in list(rows_here):
            v = BY_NAME[base["variant"]]
            if v.impl != "kernel":
                continue
            for suffix, knobs in alternatives(base, shape.heads * shape.q_tokens, v.pv == "fp8_scale_fused"):
                if not budget.ok(10):
                    break
                alt = replace(v, name=f"{v.name}+{suffix}", knobs=tuple(sorted({**v.knob_dict, **knobs}.items())),
                              priority=3, check_vs=v.name, tol=1e-2 if v.knob_dict.get("fp8_mma") else 2e-3)
                row = harness.measure_decode(alt, data, timer, num_sms, print, time_left=lambda: budget.left() - 5)
                rows_here.append(row)
                print(harness._describe(row), flush=True)
        rows += rows_here
        del data
        torch.cuda.empty_cache()
        results.add_ratios(rows)
        Path(args.out_csv).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_csv).write_text(results.to_csv(rows))
    return 0


# ------------------------------------------------------------------------------------------ worker
def cmd_worker(args: argparse.Namespace) -> int:
    """One variant's kernels of one warm call between cudaProfilerStart and cudaProfilerStop."""
    import torch

    from snapquant.bench import harness
    from snapquant.bench.shapes import parse_shapes
    from snapquant.bench.variants import BY_NAME

    dev = torch.device("cuda")
    shape = parse_shapes(args.shape)[0]
    v = BY_NAME[args.variant]
    if args.knobs:
        v = replace(v, knobs=tuple(sorted({**v.knob_dict, **json.loads(args.knobs)}.items())))
    # one input set (rotate_factor 0): ncu flushes the caches itself, and it saves every allocation before the
    # first replay pass, so less memory is less time
    data = harness.build_shape_data(shape, {v.layout, "bf16"}, dev, rotate_factor=0.0)
    prep = harness.prepare_variant(v, data, torch.cuda.get_device_properties(dev).multi_processor_count)
    fn = prep.fns[0]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    print(f"{shape.name} {v.name}: {prep.meta.get('knobs')}", flush=True)
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


# ------------------------------------------------------------------------------------------ driver
def ncu_command(ncu_bin: str, rep: Path, worker: list[str], sections: tuple[str, ...] = SECTIONS,
                metrics: tuple[str, ...] = EXTRA_METRICS) -> list[str]:
    cmd = [ncu_bin, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all",
           "--replay-mode", "kernel", "--import-source", "yes", "--export", str(rep), "--force-overwrite"]
    for s in sections:
        cmd += ["--section", s]
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    return cmd + worker


def export(ncu_bin: str, rep: Path) -> dict[str, str]:
    """The report's details, raw and SASS source pages as CSV text (a page ncu cannot print is '')."""
    pages = {"details": ["--page", "details"], "raw": ["--page", "raw"],
             "source": ["--page", "source", "--print-source", "sass"]}
    out = {}
    for name, extra in pages.items():
        p = subprocess.run([ncu_bin, "--import", str(rep), "--csv", "--print-units", "base", *extra],
                           capture_output=True, text=True, timeout=60)
        text = p.stdout if p.returncode == 0 else ""
        rep.with_suffix(f".{name}.csv").write_text(text or p.stderr[-4000:])
        out[name] = text
    return out


def cmd_run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()

    def left() -> float:
        return args.budget_s - (time.monotonic() - t0)

    ncu_dir, out = Path(args.ncu_dir), Path(args.out)
    ncu_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    ncu_bin = shutil.which(args.ncu) or args.ncu
    me = [sys.executable, str(Path(__file__).resolve())]
    tag, gpu = gpu_tag()
    timings = out / f"profile_timings_{tag}.csv"
    t_time = min(args.time_budget_s, max(0.0, left() - 60))
    if t_time > 20:
        print(f"== timing ({t_time:.0f} s budget)", flush=True)
        _run([*me, "time", "--shapes", args.time_shapes, "--variants", args.variants, "--budget-s",
              str(t_time - 10), "--out-csv", str(timings)], t_time + 30, ncu_dir / "time.log")
    for shape in args.shapes.split(","):
        for variant in args.variants.split(","):
            if variant == "snapmla+gluon+fp8mma" and shape.split("x")[1] == "16":
                continue  # no native FP8 kernel at <= 16 rows (the variant does not apply)
            if left() < EXPECT_WORKER_S:
                print(f"== {shape} {variant}: skipped, {left():.0f} s left", flush=True)
                continue
            rep = ncu_dir / f"{shape}_{variant.replace('+', '-')}.ncu-rep"
            worker = [*me, "worker", "--shape", shape, "--variant", variant]
            t1 = time.monotonic()
            rc = _run(ncu_command(ncu_bin, rep, worker), min(WORKER_S, left()), rep.with_suffix(".log"))
            if rc != 0 and not rep.exists() and left() > EXPECT_WORKER_S:  # an unknown metric name aborts ncu
                rc = _run(ncu_command(ncu_bin, rep, worker, metrics=()), min(WORKER_S, left()),
                          rep.with_suffix(".retry.log"))
            print(f"== {shape} {variant}: rc {rc}, {time.monotonic() - t1:.0f} s, report {rep.exists()}", flush=True)
            if rep.exists():
                export(ncu_bin, rep)
    write_summary(ncu_dir, out, timings, tag, gpu)
    print(f"== done in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def _run(cmd: list[str], timeout: float, log: Path) -> int:
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(1.0, timeout),
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n== killed after {timeout:.0f} s\n")
            return 124


def gpu_tag(name: str | None = None) -> tuple[str, str]:
    """(file tag, title) of GPU `name` (default: this machine's): "h200" / "h100" / the sanitized name, so that
    another GPU's profile never lands under an H200 name."""
    if name is None:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown GPU"
    tag = "h200" if "H200" in name else "h100" if "H100" in name else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return tag, name


def write_summary(ncu_dir: Path, out: Path, timings: Path | None = None, tag: str = "h200",
                  gpu: str = "H200") -> list[dict[str, Any]]:
    """Parse every exported report in `ncu_dir` into out/profile_<tag>.{csv,md}."""
    rows = []
    for det in sorted(ncu_dir.glob("*.details.csv")):
        stem = det.name[: -len(".details.csv")]
        shape, _, variant = stem.partition("_")
        texts = {p: (ncu_dir / f"{stem}.{p}.csv") for p in ("details", "raw", "source")}
        try:
            kernels = ncu.merge(*(t.read_text() if t.exists() else "" for t in texts.values()))
        except ValueError as e:
            print(f"{stem}: {e}", flush=True)
            continue
        rows += [ncu.summarize(k, shape, variant.replace("-", "+")) for k in kernels]
    (out / f"profile_{tag}.csv").write_text(ncu.summary_csv(rows))
    md = [f"# Decode kernels under Nsight Compute ({gpu})", "",
          f"`python scripts/profile_decode.py run` ({time.strftime('%Y-%m-%d')}, commit "
          f"{(git_commit() or 'unknown')[:7]}): one warm call per variant, "
          "`--clock-control none --cache-control all`, sections " + ", ".join(SECTIONS) + ". "
          "Stall shares are fractions of all warp states (the issuing one included), from "
          "`smsp__average_warps_issue_stalled_*_per_issue_active` (or PC samples where those are missing).", ""]
    if timings is not None and timings.exists():
        md += ["## CUDA-graph timings (L2-rotated inputs; vs_flashmla = us / FlashMLA us)", "", _timing_table(timings), ""]
    md += ["## Kernels", "", ncu.summary_markdown(rows) if rows else "(no report parsed)", ""]
    (out / f"profile_{tag}.md").write_text("\n".join(md))
    return rows


def _timing_table(path: Path) -> str:
    from snapquant.bench.results import read_csv

    lines = ["| shape | variant | us | vs FlashMLA | vs our BF16 | status | resolved knobs |", "|---|---|---|---|---|---|---|"]
    for r in read_csv(path):
        if r.get("op") != "decode":
            continue
        fmt = ncu._f
        lines.append(f"| {r['shape']} | {r['variant']} | {fmt(r.get('us'))} | {fmt(r.get('vs_flashmla'), '{:.2f}')} | "
                     f"{fmt(r.get('fp8_over_bf16'), '{:.2f}')} | {r.get('status')} | {r.get('resolved') or ''} |")
    return "\n".join(lines)


def cmd_summarize(args: argparse.Namespace) -> int:
    tag, gpu = gpu_tag(args.gpu)
    rows = write_summary(Path(args.ncu_dir), Path(args.out), Path(args.timings) if args.timings else None, tag, gpu)
    print(f"{len(rows)} kernel rows -> {args.out}/profile_{tag}.{{md,csv}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="timings, then one ncu report per (shape, variant), then the summary")
    r.add_argument("--shapes", default=",".join(SHAPES))
    r.add_argument("--variants", default=",".join(VARIANTS))
    r.add_argument("--time-shapes", default=",".join(TIME_SHAPES))
    r.add_argument("--out", default="results/kernels")
    r.add_argument("--ncu-dir", default="/tmp/profile_decode")
    r.add_argument("--ncu", default="ncu")
    r.add_argument("--budget-s", type=float, default=330.0)
    r.add_argument("--time-budget-s", type=float, default=110.0)
    t = sub.add_parser("time", help="CUDA-graph timings of the variants and their knob alternatives")
    t.add_argument("--shapes", default=",".join(TIME_SHAPES))
    t.add_argument("--variants", default=",".join(VARIANTS))
    t.add_argument("--budget-s", type=float, default=100.0)
    t.add_argument("--out-csv", default="results/kernels/profile_timings_h200.csv")
    w = sub.add_parser("worker", help="one warm call of one variant inside cudaProfilerStart/Stop")
    w.add_argument("--shape", required=True)
    w.add_argument("--variant", required=True)
    w.add_argument("--knobs", default="", help="JSON object of extra decode knobs")
    s = sub.add_parser("summarize", help="re-parse the exports in --ncu-dir (no GPU)")
    s.add_argument("--ncu-dir", required=True)
    s.add_argument("--out", default="results/kernels")
    s.add_argument("--timings", default="")
    s.add_argument("--gpu", default="NVIDIA H200", help="the GPU the reports came from (names the files and title)")
    args = ap.parse_args(argv)
    return {"run": cmd_run, "time": cmd_time, "worker": cmd_worker, "summarize": cmd_summarize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
