"""Command line of the decode benchmark: `python scripts/bench_decode.py` = `snapquant bench`.

    python scripts/bench_decode.py --out results/bench            # the full run (~6-7 min on an H200)
    python scripts/bench_decode.py --quick --out /tmp/b           # 4 shapes, 8 variants (~2-3 min)
    python scripts/bench_decode.py --list                         # shapes and variants, then exit
    python scripts/bench_decode.py --replot results/bench/decode_h200.csv   # figure + summary again
    python scripts/bench_decode.py --compile-stats --out /tmp/cs  # no GPU needed: what the compiler
                                                                  # makes of each variant (sm_90)

Files in --out (tag = h200 on an H200, else the GPU's name): decode_<tag>.csv (one row per
measurement), decode_<tag>.md (targets and tables), decode_<tag>.png/.pdf (the figure),
bench_<tag>.json (environment, options, timings of the run), bench_<tag>.log (progress lines).
Each is written atomically and the CSV / markdown after every shape, so a run stopped by its time
limit still leaves results. `--budget-s` bounds the measurements (default 400 s, quick 170 s);
what the budget cuts is recorded as status "skipped".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .shapes import BENCH_SHAPES, parse_shapes
from .timing import TIMERS, make_timer
from .variants import VARIANTS, select_variants

DEFAULT_BUDGET_S, QUICK_BUDGET_S = 400.0, 170.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_decode", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="results/bench", help="output directory (default results/bench)")
    p.add_argument("--quick", action="store_true", help="4 headline shapes, 8 variants, shorter budget")
    p.add_argument("--shapes", default=None, help="comma list of shape names or BxHxL (default: every benchmark shape)")
    p.add_argument("--variants", default=None, help="comma list of variant names or globs (default: all)")
    p.add_argument("--priority", type=int, default=2, help="highest variant priority to run: 0 core, 1 variants, 2 sweeps")
    p.add_argument("--budget-s", type=float, default=None, help="time budget of the measurements in seconds")
    p.add_argument("--timer", default="cudagraph", choices=TIMERS, help="cudagraph (default), do_bench, events, wall")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu (interpreter: tiny dims only)")
    p.add_argument("--tag", default=None, help="file name tag (default: h200 on an H200, else the GPU name)")
    p.add_argument("--no-append", action="store_true", help="skip the quantize-and-append measurements")
    p.add_argument("--append-tokens", type=int, default=65536)
    p.add_argument("--rotate", type=float, default=4.0, help="rotate inputs over this many L2 sizes (0: no rotation)")
    p.add_argument("--dims", default="512,64", help="kv_lora_rank,rope_dim (CPU smoke runs use small ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the shapes and variants and exit")
    p.add_argument("--replot", default=None, metavar="CSV", help="redraw the figure and summary from a CSV")
    p.add_argument("--compile-stats", action="store_true",
                   help="compile every selected variant for sm_90 (no GPU needed) and write compile_stats_<tag>.csv")
    p.add_argument("--arch", type=int, default=90, help="compute capability for --compile-stats")
    return p


# ------------------------------------------------------------------------------------------ environment
def git_commit() -> str | None:
    """HEAD of this checkout; SNAPQUANT_GIT_COMMIT overrides it (a copied tree whose .git is stale)."""
    if os.environ.get("SNAPQUANT_GIT_COMMIT"):
        return os.environ["SNAPQUANT_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
        return out if len(out) == 40 else None
    except Exception:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    import snapquant

    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "snapquant": snapquant.__version__,
        "git_commit": git_commit(), "host": platform.node(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                   l2_bytes=getattr(props, "L2_cache_size", None))
    return env


def tag_for(env: dict[str, Any], device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = env.get("gpu") or "gpu"
    if "H200" in name:
        return "h200"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def paths(out: Path, tag: str) -> dict[str, Path]:
    return {"csv": out / f"decode_{tag}.csv", "md": out / f"decode_{tag}.md", "png": out / f"decode_{tag}.png",
            "pdf": out / f"decode_{tag}.pdf", "json": out / f"bench_{tag}.json", "log": out / f"bench_{tag}.log"}


class Log:
    """Prints a line and appends it to the run's log file (flushed: survives a kill)."""

    def __init__(self, path: Path | None = None, echo: bool = True) -> None:
        self.path, self.echo = path, echo
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def __call__(self, msg: str) -> None:
        if self.echo:
            print(msg, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(msg.rstrip("\n") + "\n")


# ------------------------------------------------------------------------------------------ outputs
def write_outputs(rows: list[dict[str, Any]], env: dict[str, Any], p: dict[str, Path], *, final: bool,
                  log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """CSV + markdown (always), figure (final only); returns the target evaluation."""
    from ..atomic import atomic_write_text
    from .plot import plot_decode
    from .results import add_ratios, evaluate_targets, to_csv, to_markdown

    add_ratios(rows)
    targets = evaluate_targets(rows)
    atomic_write_text(p["csv"], to_csv(rows))
    atomic_write_text(p["md"], to_markdown(rows, env, targets))
    if final:
        try:
            plot_decode(rows, p["png"], p["pdf"], title=f"MLA decode on {env.get('gpu') or env.get('device')}: "
                                                         "FP8 (SnapMLA) vs BF16, one layer")
        except Exception as e:  # a plotting problem must not cost the measurements
            log(f"plot failed: {type(e).__name__}: {e}")
    return targets


def replot(csv_path: Path, out: Path, tag: str | None) -> dict[str, Path]:
    from .results import read_csv

    rows = read_csv(csv_path)
    env_path = csv_path.with_name(csv_path.name.replace("decode_", "bench_").replace(".csv", ".json"))
    env = json.loads(env_path.read_text()).get("environment", {}) if env_path.exists() else {}
    tag = tag or csv_path.stem.removeprefix("decode_")
    p = paths(out, tag)
    p["csv"] = out / csv_path.name if out != csv_path.parent else csv_path
    write_outputs(rows, env, p, final=True)
    return p


def print_targets(targets: list[dict[str, Any]], log: Callable[[str], None]) -> None:
    log("\nTargets:")
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        mark = "-" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        log(f"  [{mark}] {t['target']} ({t['shape']}, {t['pick']}): {v} vs {t['threshold']:g}  {t['variants']}")


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None, *, timer: Any = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.list:
        for s in BENCH_SHAPES:
            print(f"shape {s.name:14s} {s.label}")
        for v in VARIANTS:
            print(f"variant p{v.priority} {v.name:28s} {v.family:5s} {v.layout:8s} {v.mode} {v.knob_label}  {v.note}")
        return 0
    if args.replot:
        p = replot(Path(args.replot), out, args.tag)
        print(f"wrote {p['md']}, {p['png']}, {p['pdf']}")
        return 0
    shapes = parse_shapes(args.shapes, quick=args.quick)
    variants = select_variants(args.variants, quick=args.quick, max_priority=args.priority)
    r, d = (int(x) for x in args.dims.split(","))
    if args.compile_stats:
        return run_compile_stats(shapes, variants, out, args.tag or f"sm{args.arch}", args.arch, r, d)

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
    env = environment(device)
    tag = args.tag or tag_for(env, device)
    p = paths(out, tag)
    log = Log(p["log"])
    budget_s = args.budget_s if args.budget_s is not None else (QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S)
    opts = {k: v for k, v in vars(args).items()}
    log(json.dumps({"environment": env, "options": opts}, default=str))
    log(f"{len(shapes)} shapes x {len(variants)} variants, budget {budget_s:.0f} s, timer {args.timer}")
    from .harness import RunSpec, run

    spec = RunSpec(shapes=shapes, variants=variants, device=device, budget_s=budget_s,
                   reserve_s=min(25.0, budget_s / 10), append=not args.no_append, append_tokens=args.append_tokens,
                   r=r, d=d, seed=args.seed, rotate_factor=args.rotate)
    timer = timer or make_timer(args.timer, device, fast=args.quick)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []

    def progress(rs: list[dict[str, Any]]) -> None:
        write_outputs(rs, env, p, final=False, log=log)

    try:
        rows = run(spec, timer, log=log, on_progress=progress)
    finally:
        copy = next((rw for rw in rows if rw.get("op") == "copy" and rw.get("status") == "ok"), None)
        if copy:
            env["copy_gbps"] = copy["gbps"]
        targets = write_outputs(rows, env, p, final=True, log=log)
        counts = {s: sum(rw.get("status") == s for rw in rows) for s in ("ok", "mismatch", "error", "skipped")}
        from .results import write_json

        write_json(p["json"], {"environment": env, "options": opts, "budget_s": budget_s,
                               "seconds": round(time.perf_counter() - t0, 1), "counts": counts, "targets": targets})
    print_targets(targets, log)
    log(f"\n{counts} in {time.perf_counter() - t0:.0f} s; wrote " + ", ".join(str(x) for x in p.values()))
    return 0 if counts["error"] == 0 and counts["mismatch"] == 0 else 1


def run_compile_stats(shapes: list, variants: list, out: Path, tag: str, arch: int, r: int, d: int) -> int:
    """Compile each (variant, shape) for `arch` and write compile_stats_<tag>.csv (+ print it)."""
    import csv
    import io

    from ..atomic import atomic_write_text
    from .compile_stats import decode_compile_stats

    rows = []
    for s in shapes:
        for v in variants:
            if v.impl != "kernel" or not v.applies(s):
                continue
            t0 = time.perf_counter()
            for row in decode_compile_stats(v, s, arch=arch, r=r, d=d):
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                keep = ("kernel", "regs", "spill_bytes", "smem", "async_loads", "wgmma", "mma_sync", "loop_total",
                        "loop_cvt", "loop_lds", "loop_falu", "error")
                print(f"{s.name:14s} {v.name:28s} " + " ".join(f"{k}={row.get(k)}" for k in keep if k in row), flush=True)
    cols = sorted({k for row in rows for k in row}, key=lambda k: (k not in ("shape", "variant", "kernel"), k))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    path = out / f"compile_stats_{tag}.csv"
    atomic_write_text(path, buf.getvalue())
    print(f"wrote {path}")
    return 0 if not any("error" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
