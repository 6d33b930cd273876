"""Timers for GPU kernels: CUDA graphs over L2-rotated inputs, triton's do_bench, eager events, wall.

Every timer takes `fns`, one zero-argument callable per input set (the same work on different
buffers), and returns the median time of one call. Rotating through sets whose total footprint
exceeds the L2 cache (`rotation_sets`) keeps a small problem from being timed out of L2 (the H200's
is 50-60 MB: a B = 1, L = 32K bf16 cache is 38 MB).

    cudagraph  capture `calls` calls (cycling through the sets) in one CUDA graph, replay it `runs`
               times, each replay timed with CUDA events; per call = replay time / calls. No launch
               overhead, no host work: what the kernels cost back to back.
    do_bench   triton.testing.do_bench on set 0: flushes L2 (256 MB write) before every call, median.
    events     eager launches cycling through the sets, timed with CUDA events (includes launch cost).
    wall       perf_counter around eager calls, with a device sync if the device is CUDA (CPU runs).

The caller warms up (compiles) before timing; timers never see a first call.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError

TIMERS = ("cudagraph", "do_bench", "events", "wall")
DEFAULT_L2_BYTES = 60 * 2**20


@dataclass(frozen=True)
class Timing:
    us: float  # median per call
    us_p20: float
    us_p80: float
    runs: int  # timed samples
    calls_per_run: int
    timer: str
    samples: tuple[float, ...] = ()  # every per-call sample (us), for intervals on ratios between rows


def rotation_sets(footprint_bytes: float, l2_bytes: float = DEFAULT_L2_BYTES, factor: float = 4.0,
                  max_sets: int = 32) -> int:
    """Input sets to cycle through so that together they span `factor` x the L2 cache."""
    if not footprint_bytes > 0:
        raise ConfigError(f"footprint_bytes must be positive, got {footprint_bytes!r}")
    return max(1, min(max_sets, math.ceil(factor * l2_bytes / footprint_bytes)))


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_L2_BYTES
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def summarize(samples_us: Sequence[float], calls: int, timer: str) -> Timing:
    if not samples_us:
        raise RuntimeError("no timing samples")
    xs = sorted(samples_us)
    q = statistics.quantiles(xs, n=5) if len(xs) >= 2 else [xs[0]] * 4
    return Timing(statistics.median(xs), q[0], q[3], len(xs), calls, timer, tuple(samples_us))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WallTimer:
    """perf_counter around `calls` eager calls per sample (CPU runs and tests)."""

    name = "wall"

    def __init__(self, runs: int = 5, min_calls: int = 1, device: torch.device | str = "cpu") -> None:
        self.runs, self.min_calls, self.device = runs, min_calls, torch.device(device)

    def within(self, seconds: float, est_us: float, n_sets: int) -> WallTimer:
        """This timer with no more samples than fit in `seconds` at `est_us` per call (at least one):
        on a slow device (the CPU interpreter) one sample can take seconds, and a budget must hold."""
        per_sample_s = max(self.min_calls, n_sets) * max(est_us, 0.0) / 1e6
        fit = int(seconds // per_sample_s) if per_sample_s > 0 else self.runs
        return WallTimer(runs=max(1, min(self.runs, fit)), min_calls=self.min_calls, device=self.device)

    def __call__(self, fns: Sequence[Callable[[], object]], est_us: float | None = None) -> Timing:
        calls = max(self.min_calls, len(fns))
        samples = []
        for _ in range(self.runs):
            _sync(self.device)
            t0 = time.perf_counter()
            for i in range(calls):
                fns[i % len(fns)]()
            _sync(self.device)
            samples.append((time.perf_counter() - t0) * 1e6 / calls)
        return summarize(samples, calls, self.name)


class EventTimer:
    """Eager calls cycling through the sets, one CUDA-event sample per `calls` calls."""

    name = "events"

    def __init__(self, runs: int = 20, target_ms: float = 3.0, max_calls: int = 1000) -> None:
        self.runs, self.target_ms, self.max_calls = runs, target_ms, max_calls

    def __call__(self, fns: Sequence[Callable[[], object]], est_us: float | None = None) -> Timing:
        calls = calls_for(len(fns), est_us, self.target_ms, self.max_calls)
        pairs = []
        for _ in range(self.runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(calls):
                fns[i % len(fns)]()
            b.record()
            pairs.append((a, b))
        torch.cuda.synchronize()
        return summarize([a.elapsed_time(b) * 1e3 / calls for a, b in pairs], calls, self.name)


class CudaGraphTimer:
    """One CUDA graph of `calls` calls (cycling through the sets), replayed and timed with events."""

    name = "cudagraph"

    def __init__(self, runs: int = 25, target_ms: float = 4.0, max_calls: int = 2000, warmup_runs: int = 3) -> None:
        self.runs, self.target_ms, self.max_calls, self.warmup_runs = runs, target_ms, max_calls, warmup_runs

    def __call__(self, fns: Sequence[Callable[[], object]], est_us: float | None = None) -> Timing:
        calls = calls_for(len(fns), est_us, self.target_ms, self.max_calls)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # libraries (cuBLAS) set up their workspaces outside the capture
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        try:
            for _ in range(self.warmup_runs):
                graph.replay()
            pairs = []
            for _ in range(self.runs):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                pairs.append((a, b))
            torch.cuda.synchronize()
            return summarize([a.elapsed_time(b) * 1e3 / calls for a, b in pairs], calls, self.name)
        finally:
            del graph


class DoBenchTimer:
    """triton.testing.do_bench (L2 flushed before each call) on the first set; median."""

    name = "do_bench"

    def __init__(self, warmup_ms: int = 25, rep_ms: int = 100) -> None:
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def __call__(self, fns: Sequence[Callable[[], object]], est_us: float | None = None) -> Timing:
        import triton.testing

        try:
            ms = triton.testing.do_bench(fns[0], warmup=self.warmup_ms, rep=self.rep_ms, return_mode="all")
        except (TypeError, ValueError):  # a triton without return_mode="all": the median only
            ms = [triton.testing.do_bench(fns[0], warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")]
        ms = ms if isinstance(ms, (list, tuple)) else [ms]
        return summarize([m * 1e3 for m in ms], 1, self.name)


def calls_for(n_sets: int, est_us: float | None, target_ms: float, max_calls: int) -> int:
    """Calls per sample: about target_ms of work, a multiple of the number of sets, at least one round."""
    if n_sets < 1:
        raise ConfigError("at least one input set is needed")
    want = n_sets if not est_us or est_us <= 0 else math.ceil(target_ms * 1e3 / est_us)
    want = min(max(want, n_sets), max(max_calls, n_sets))
    return math.ceil(want / n_sets) * n_sets


def estimate_us(fns: Sequence[Callable[[], object]], device: torch.device, rounds: int = 2) -> float:
    """Rough per-call time from eager calls (sizes the graph); includes launch overhead."""
    _sync(device)
    t0 = time.perf_counter()
    n = rounds * len(fns)
    for i in range(n):
        fns[i % len(fns)]()
    _sync(device)
    return (time.perf_counter() - t0) * 1e6 / n


def make_timer(name: str, device: torch.device | str, *, fast: bool = False):
    """The timer called `name` (cudagraph falls back to events in the harness if capture fails)."""
    device = torch.device(device)
    if name not in TIMERS:
        raise ConfigError(f"timer={name!r} is not valid; allowed values: {', '.join(TIMERS)}")
    if device.type != "cuda" and name != "wall":
        raise ConfigError(f"timer={name!r} needs a CUDA device; use --timer wall on {device}")
    runs = 10 if fast else 25
    if name == "cudagraph":
        return CudaGraphTimer(runs=runs, target_ms=2.0 if fast else 4.0)
    if name == "events":
        return EventTimer(runs=runs)
    if name == "do_bench":
        return DoBenchTimer(rep_ms=50 if fast else 100)
    return WallTimer(runs=3 if fast else 5, device=device)
