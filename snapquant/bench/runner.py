"""The decode benchmark run behind `snapquant bench` (and `python scripts/bench_decode.py`, the same command).

    snapquant bench --out results/bench            # the full run (~6-7 min on an H200)
    snapquant bench --quick --out /tmp/b           # 4 shapes, 8 variants (~2-3 min)
    snapquant bench --list                         # shapes and variants, then exit
    snapquant bench --replot results/bench/decode_h200.csv   # figure + summary again
    snapquant bench --compile-stats --out /tmp/cs  # no GPU needed: what the compiler makes of each
                                                   # variant (sm_90)
    snapquant bench --device cpu --out /tmp/b      # a smoke run of every step in the Triton interpreter

Files in --out (tag = h200 on an H200, else the GPU's name, cpu on CPU): decode_<tag>.csv (one row
per measurement), decode_<tag>.md (targets and tables), decode_<tag>.png/.pdf (the figure),
bench_<tag>.json (environment, options, timings of the run), bench_<tag>.log (progress lines).
Each is written atomically and the CSV / markdown after every shape, so a run stopped by its time
limit still leaves results. `--budget-s` bounds the measurements (default 400 s, quick 170 s): it is
checked before every measurement, a measurement is not started when the previous one of its shape
would not fit, and a wall-clock timer takes no more samples than fit; what the budget cuts is
recorded as status "skipped".

On CPU the kernels run in the Triton interpreter, thousands of times slower than on a GPU, so a CPU
run defaults to tiny sizes (CPU_SHAPES, kv_lora_rank 128 and rope_dim 16, 16-token appends, the
wall-clock timer) and refuses sizes the interpreter cannot get through within a budget.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..environment import device_environment
from ..errors import ConfigError, unknown_choice
from .shapes import BENCH_SHAPES, CPU_SHAPES, DecodeShape, parse_shapes
from .timing import TIMERS, make_timer
from .variants import VARIANTS, Variant, select_variants, with_kernel_options

DEFAULT_BUDGET_S, QUICK_BUDGET_S = 400.0, 170.0
GPU_DIMS, CPU_DIMS = (512, 64), (128, 16)  # CPU: r = 128 still fits ds_v32's 128-channel blocks
GPU_APPEND_TOKENS, CPU_APPEND_TOKENS = 65536, 16
# Largest sizes a CPU run accepts: in the interpreter one decode call over 4096 cached tokens, or
# one 512-token append, already takes seconds to tens of seconds, and a measurement makes several.
CPU_MAX_CACHED_TOKENS, CPU_MAX_APPEND_TOKENS = 4096, 512
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass
class BenchOptions:
    """What `snapquant bench` was asked for; None = the device's default (resolved by `plan`)."""

    out: Path = Path("results/bench")
    quick: bool = False
    shapes: str | None = None
    variants: str | None = None
    priority: int = 2
    budget_s: float | None = None
    timer: str = "auto"
    device: str = "auto"
    tag: str | None = None
    append: bool = True
    append_tokens: int | None = None
    rotate: float = 4.0
    dims: str | None = None
    seed: int = 0
    kernel_options: str | None = None  # "key=value,..." decode knobs: each core kernel variant runs again with them
    list: bool = False
    replot: Path | None = None
    compile_stats: bool = False
    arch: int = 90


@dataclass
class BenchPlan:
    """The options resolved for the device: every value the run uses, checked."""

    device: torch.device
    shapes: list[DecodeShape]
    variants: list[Variant]
    r: int
    d: int
    timer: str
    budget_s: float
    append_tokens: int
    kernel_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {"device": str(self.device), "shapes": [s.name for s in self.shapes],
                "variants": [v.name for v in self.variants], "dims": [self.r, self.d], "timer": self.timer,
                "budget_s": self.budget_s, "append_tokens": self.append_tokens, "kernel_options": self.kernel_options}


def _parse_dims(dims: str) -> tuple[int, int]:
    try:
        r, d = (int(x) for x in dims.split(","))
    except ValueError:
        raise ConfigError(f"--dims={dims!r} is not valid; expected kv_lora_rank,rope_dim, e.g. 512,64") from None
    if r < 1 or d < 1:
        raise ConfigError(f"--dims={dims!r} is not valid; both widths must be positive")
    return r, d


def resolve_device(name: str) -> torch.device:
    if not _DEVICE_RE.match(name):
        raise ConfigError(f"--device={name!r} is not valid; allowed values: auto, cuda, cuda:N, cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device={name!r} but CUDA is not available on this machine; use --device cpu")
    return torch.device(name)


def plan(opts: BenchOptions) -> BenchPlan:
    """Check every option and resolve the device's defaults; raises ConfigError naming the option.
    Nothing is written and nothing runs before this has passed."""
    if opts.priority not in (0, 1, 2):
        raise ConfigError(f"--priority={opts.priority} is not valid; allowed values: 0 (core), 1 (variants), 2 (sweeps)")
    if opts.budget_s is not None and not 0 < opts.budget_s < float("inf"):
        raise ConfigError(f"--budget-s={opts.budget_s} is not valid; expected a positive number of seconds")
    if opts.append_tokens is not None and opts.append_tokens < 1:
        raise ConfigError(f"--append-tokens={opts.append_tokens} is not valid; expected an integer >= 1")
    if not opts.rotate >= 0:
        raise ConfigError(f"--rotate={opts.rotate} is not valid; expected a number >= 0 (0: no rotation)")
    if opts.timer != "auto" and opts.timer not in TIMERS:
        raise unknown_choice("--timer", opts.timer, ("auto", *TIMERS))
    device = torch.device("cuda") if opts.compile_stats else resolve_device(opts.device)
    cpu = device.type != "cuda"
    timer = opts.timer if opts.timer != "auto" else ("wall" if cpu else "cudagraph")
    if cpu and timer != "wall":
        raise ConfigError(f"--timer={timer!r} needs a CUDA device; use --timer wall (or auto) on cpu")
    r, d = _parse_dims(opts.dims) if opts.dims else (CPU_DIMS if cpu else GPU_DIMS)
    shapes = parse_shapes(opts.shapes, quick=opts.quick, cpu=cpu)
    variants = select_variants(opts.variants, quick=opts.quick, max_priority=opts.priority)
    kernel_options = _kernel_options(opts.kernel_options)
    variants = with_kernel_options(variants, kernel_options)
    append_tokens = opts.append_tokens or (CPU_APPEND_TOKENS if cpu else GPU_APPEND_TOKENS)
    budget_s = opts.budget_s if opts.budget_s is not None else (QUICK_BUDGET_S if opts.quick else DEFAULT_BUDGET_S)
    if cpu:  # sizes one interpreted measurement gets through in seconds, not hours
        big = [s for s in shapes if s.tokens > CPU_MAX_CACHED_TOKENS]
        if big:
            raise ConfigError(f"--shapes: {big[0].name} caches {big[0].tokens} tokens; a CPU run (Triton interpreter) "
                              f"takes at most {CPU_MAX_CACHED_TOKENS} per shape, e.g. "
                              f"{','.join(s.name for s in CPU_SHAPES)} (the default); use a GPU for real shapes")
        if opts.append and append_tokens > CPU_MAX_APPEND_TOKENS:
            raise ConfigError(f"--append-tokens={append_tokens}: a CPU run (Triton interpreter) appends at most "
                              f"{CPU_MAX_APPEND_TOKENS} tokens (default {CPU_APPEND_TOKENS}), or pass --no-append")
    return BenchPlan(device, shapes, variants, r, d, timer, budget_s, append_tokens, kernel_options)


def _kernel_options(text: str | None) -> dict[str, Any]:
    """--kernel-options as the patch's triton backend validates them (ConfigError naming the option)."""
    if not text:
        return {}
    from ..attention.backends import kernel_options_from_text, parse_kernel_options

    options = kernel_options_from_text(text)
    try:
        parse_kernel_options("triton", options)
    except ConfigError as e:
        raise ConfigError(f"--kernel-options: {e}") from None
    return options


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
    if all(t["value"] is None for t in targets):
        log("\nTargets: none measured (no target shape in this run)")
        return
    log("\nTargets:")
    for t in targets:
        v = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        mark = "-" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        log(f"  [{mark}] {t['target']} ({t['shape']}, {t['pick']}): {v} vs {t['threshold']:g}  {t['variants']}")


# ------------------------------------------------------------------------------------------ the run
def run_bench(opts: BenchOptions, *, timer: Any = None, echo: bool = True) -> int:
    """The whole benchmark (or --list / --replot / --compile-stats); returns the exit code: 0, or 1
    when a measurement errored or mismatched. Bad options raise ConfigError before anything runs.
    `timer` replaces the timer (tests inject a fake one)."""
    out = Path(opts.out)
    if opts.list:
        for s in (*BENCH_SHAPES, *CPU_SHAPES):
            print(f"shape {s.name:14s} {s.label}{'  (CPU runs)' if s in CPU_SHAPES else ''}")
        for v in VARIANTS:
            print(f"variant p{v.priority} {v.name:28s} {v.family:5s} {v.layout:8s} {v.mode} {v.knob_label}  {v.note}")
        return 0
    if opts.replot:
        csv_path = Path(opts.replot)
        if not csv_path.is_file() or csv_path.suffix != ".csv":
            raise ConfigError(f"--replot={str(csv_path)!r} is not a CSV file of an earlier run (decode_<tag>.csv)")
        p = replot(csv_path, out, opts.tag)
        print(f"wrote {p['md']}, {p['png']}, {p['pdf']}")
        return 0
    bp = plan(opts)
    if opts.compile_stats:
        return run_compile_stats(bp.shapes, bp.variants, out, opts.tag or f"sm{opts.arch}", opts.arch, bp.r, bp.d)

    device = bp.device
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
    timer = timer or make_timer(bp.timer, device, fast=opts.quick)
    env = device_environment(device)
    tag = opts.tag or tag_for(env, device)
    p = paths(out, tag)
    log = Log(p["log"], echo=echo)
    record = {**{k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(opts).items()},
              "resolved": bp.record()}
    log(json.dumps({"environment": env, "options": record}, default=str))
    log(f"{len(bp.shapes)} shapes x {len(bp.variants)} variants, budget {bp.budget_s:.0f} s, timer {bp.timer}, "
        f"dims r={bp.r} d={bp.d}" + ("" if device.type == "cuda" else " (CPU: Triton interpreter, tiny sizes)"))
    from .harness import RunSpec, run

    spec = RunSpec(shapes=bp.shapes, variants=bp.variants, device=device, budget_s=bp.budget_s,
                   reserve_s=min(25.0, bp.budget_s / 10), append=opts.append, append_tokens=bp.append_tokens,
                   r=bp.r, d=bp.d, seed=opts.seed, rotate_factor=opts.rotate)
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
        read = next((rw for rw in rows if rw.get("op") == "read" and rw.get("status") == "ok"), None)
        if read:
            env["read_gbps"] = read["gbps"]
        targets = write_outputs(rows, env, p, final=True, log=log)
        counts = {s: sum(rw.get("status") == s for rw in rows) for s in ("ok", "mismatch", "error", "skipped")}
        from .results import write_json

        write_json(p["json"], {"environment": env, "options": record, "budget_s": bp.budget_s,
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

