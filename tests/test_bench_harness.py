"""The decode benchmark harness on CPU: real kernels in the Triton interpreter at toy dims, an injected
fake timer (timing itself is measured by scripts, never by tests), results, plot and command line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from snapquant.atomic import atomic_write_text
from snapquant.bench import harness, results
from snapquant.bench.harness import Budget, RunSpec, run
from snapquant.bench.runner import BenchOptions, run_bench
from snapquant.bench.shapes import DecodeShape, uniform_shape
from snapquant.bench.timing import Timing, WallTimer, calls_for, make_timer, rotation_sets, summarize
from snapquant.bench.variants import BY_NAME, _v
from snapquant.errors import ConfigError
from tests.support import fake_flash_mla

R, D = 64, 16  # toy widths: the interpreter runs every kernel


class FakeTimer:
    """Calls every input set once (so a broken callable still fails) and reports a fixed time per
    variant family, so the ratios are known."""

    name = "fake"

    def __init__(self, us: dict[str, float] | None = None) -> None:
        self.us = us or {}
        self.calls: list[int] = []

    def __call__(self, fns, est_us=None) -> Timing:
        for f in fns:
            f()
        self.calls.append(len(fns))
        us = self.us.get("next", 100.0)
        return Timing(us, us * 0.99, us * 1.01, 3, len(fns), self.name)


def tiny_spec(variants, shapes=None, **kw) -> RunSpec:
    shapes = shapes or [uniform_shape(2, 4, 70), DecodeShape("mixedtiny", 3, 2, (5, 130, 64))]
    return RunSpec(shapes=shapes, variants=variants, device=torch.device("cpu"), budget_s=600, reserve_s=0,
                   append=False, copy=False, read=False, r=R, d=D, **kw)


@pytest.mark.slow  # covered by default: each kernel against the reference (test_kernels_*)
def test_run_times_every_variant_and_checks_numerics():
    names = ["bf16", "snapmla", "snapmla_kv_only", "torch", "snapmla+balanced", "snapmla+bm64+rcp", "torch_sdpa"]
    variants = sorted((BY_NAME[n] for n in names), key=lambda v: v.priority)
    timer = FakeTimer()
    logged: list[str] = []
    rows = run(tiny_spec(variants), timer, log=logged.append)
    assert len(rows) == 2 * len(names)  # every variant applies to both shapes (bm64: rows < 64)
    by = {(r["shape"], r["variant"]): r for r in rows}
    for (shape, name), r in by.items():
        assert r["status"] == "ok", (shape, name, r.get("error"))
        assert r["us"] == 100.0 and r["timer"] == "fake" and r["l2_sets"] == 1
        assert r["gbps"] == pytest.approx(r["bytes"] / 100e-6 / 1e9)
    # knob variants match their mode's default tightly; modes match the BF16 kernel loosely
    assert by[("2x4x70", "snapmla+balanced")]["check_rel_l2"] <= 2e-3
    assert by[("2x4x70", "snapmla+bm64+rcp")]["check_rel_l2"] <= 5e-3
    assert 1e-4 < by[("2x4x70", "snapmla")]["check_rel_l2"] < 0.25  # fp8 query + cache: percents
    assert by[("mixedtiny", "torch")]["check_rel_l2"] < 2e-2  # masked padding in the dense baseline
    assert by[("2x4x70", "bf16")].get("check_rel_l2") is None
    assert by[("mixedtiny", "bf16")]["tokens"] == 5 + 130 + 64
    assert all(c == 1 for c in timer.calls)  # CPU: no L2 rotation
    assert any("inputs built" in m for m in logged)


def test_mismatch_and_errors_are_rows_not_crashes():
    bad_tol = _v("snapmla_strict", "fp8", "snapmla", "fp8_e4m3", "fp8_scale_fused", check="bf16", tol=1e-9)
    bad_knob = _v("bf16_bad", "bf16", "bf16", priority=1, block_m=3)  # rejected by the launcher
    variants = [BY_NAME["bf16"], bad_tol, bad_knob, BY_NAME["snapmla_kv_only"]]
    rows = run(tiny_spec(variants, shapes=[uniform_shape(2, 4, 70)]), FakeTimer(), log=lambda m: None)
    by = {r["variant"]: r for r in rows}
    assert by["snapmla_strict"]["status"] == "mismatch" and "tol" in by["snapmla_strict"]["error"]
    assert by["snapmla_strict"]["us"] == 100.0  # still timed: a slow-but-wrong or fast-but-wrong is visible
    assert by["bf16_bad"]["status"] == "error" and "block_m" in by["bf16_bad"]["error"]
    assert by["snapmla_kv_only"]["status"] == "ok"


def test_budget_cuts_later_measurements_as_skipped():
    clock = iter([0.0] + [0.0] * 5 + [1e9] * 1000)  # the budget runs out after a few checks
    budget = Budget(100.0, clock=lambda: next(clock))
    variants = [BY_NAME["bf16"], BY_NAME["snapmla"], BY_NAME["snapmla_kv_only"], BY_NAME["snapmla+balanced"]]
    rows = run(tiny_spec(variants), FakeTimer(), log=lambda m: None, budget=budget)
    status = [r["status"] for r in rows]
    assert "ok" in status and "skipped" in status
    assert all(r["error"] == "time budget" for r in rows if r["status"] == "skipped")
    assert len(rows) == 2 * len(variants)  # every (shape, variant) is accounted for


def test_append_rows_check_bits_against_the_validated_kernel():
    rows = [harness.measure_append(name, layout, tpp, 70, FakeTimer(), torch.device("cpu"), r=R, d=D,
                                   log=lambda m: None)
            for name, layout, tpp in (("a1", "snapmla", 1), ("a8", "snapmla", 8), ("b8", "bf16", 8))]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok"]
    assert rows[1]["check_rel_l2"] == 0.0 and rows[0].get("check_rel_l2") is None
    assert rows[0]["bytes"] == 70 * ((R + D) * 2 + (R + 4 + 2 * D) + 8)


def test_timing_helpers():
    assert calls_for(3, est_us=None, target_ms=4, max_calls=100) == 3
    assert calls_for(3, est_us=100.0, target_ms=4, max_calls=1000) == 42  # 40 rounded up to 3 sets
    assert calls_for(4, est_us=1.0, target_ms=4, max_calls=100) == 100
    assert calls_for(5, est_us=1e6, target_ms=4, max_calls=100) == 5
    assert rotation_sets(21e6, 50e6, 4.0) == 10  # B=1, L=32K FP8 cache: 10 copies beyond 4 x L2
    assert rotation_sets(600e6, 50e6, 4.0) == 1
    t = summarize([5.0, 1.0, 3.0, 2.0, 4.0], 7, "x")
    assert (t.us, t.runs, t.calls_per_run) == (3.0, 5, 7) and t.us_p20 < t.us < t.us_p80
    n = []
    w = WallTimer(runs=2)(lambda_list := [lambda: n.append(1), lambda: n.append(2)])
    assert w.timer == "wall" and len(n) == 4 and w.calls_per_run == len(lambda_list)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        make_timer("cudagraph", "cpu")
    with pytest.raises(ConfigError, match="timer"):
        make_timer("stopwatch", "cpu")


# ------------------------------------------------------------------------------------------ results
def _row(shape, variant, us, family="fp8", mode="q8p8", layout="snapmla", status="ok", op="decode", gbps=None):
    return {"op": op, "shape": shape, "variant": variant, "us": us, "family": family, "mode": mode,
            "layout": layout, "status": status, "gbps": gbps, "label": shape}


def test_ratios_and_targets():
    rows = [
        _row("128x16x4096", "bf16", 224.0, family="bf16", mode="q16p16", layout="bf16", gbps=2700.0),
        _row("128x16x4096", "bf16+bm64", 200.0, family="bf16", mode="q16p16", layout="bf16", gbps=3020.0),
        _row("128x16x4096", "snapmla", 320.0, gbps=1054.0),
        _row("128x16x4096", "snapmla+bm64", 110.0, gbps=3070.0),
        _row("128x16x4096", "snapmla+fast_wrong", 50.0, status="mismatch", gbps=6000.0),
        _row("128x16x4096", "snapmla_kv_only", 100.0, mode="q16p16", gbps=3300.0),  # not the SnapMLA mode
        _row("1x128x32768", "bf16", 100.0, family="bf16", mode="q16p16", layout="bf16"),
        _row("1x128x32768", "snapmla", 104.0),
        _row("append65536", "append_snapmla", 50.0, op="append", gbps=2300.0),
    ]
    results.add_ratios(rows)
    assert rows[2]["fp8_over_bf16"] == pytest.approx(320 / 224) and rows[2]["speedup_vs_bf16"] == pytest.approx(0.7)
    assert "fp8_over_bf16" not in rows[4]  # mismatch rows get no ratio
    t = {(e["key"], e["pick"]): e for e in results.evaluate_targets(rows)}
    assert t[("h16_speedup", "default")]["passed"] is False
    best = t[("h16_speedup", "best")]  # best FP8 (passing, SnapMLA mode) vs best BF16: 200 / 110
    assert best["value"] == pytest.approx(200 / 110) and best["passed"] is True
    assert best["variants"] == "snapmla+bm64 vs bf16+bm64"
    assert t[("h16_fp8_gbps", "best")]["value"] == 3070.0 and t[("h16_bf16_gbps", "best")]["passed"] is True
    assert t[("b1_ratio", "default")]["value"] == pytest.approx(1.04) and t[("b1_ratio", "default")]["passed"]
    assert t[("append_gbps", "default")]["passed"] is True
    assert t[("h64_speedup", "default")]["value"] is None and t[("h64_speedup", "default")]["passed"] is None


def test_csv_round_trip_markdown_and_atomic_writes(tmp_path):
    rows = [_row("128x16x4096", "bf16", 224.0, family="bf16", gbps=2700.0),
            {**_row("128x16x4096", "snapmla", float("nan"), status="error"), "error": "RuntimeError: x, y"}]
    results.add_ratios(rows)
    path = tmp_path / "d.csv"
    atomic_write_text(path, results.to_csv(rows))
    back = results.read_csv(path)
    assert back[0]["us"] == 224.0 and back[0]["variant"] == "bf16" and back[1]["us"] is None
    assert back[1]["error"] == "RuntimeError: x, y"
    assert list(back[0]) == results.COLUMNS
    md = results.to_markdown(rows, {"gpu": "NVIDIA H200", "torch": "2.11"}, results.evaluate_targets(rows))
    assert "## Targets\n" in md and "issue" not in md and "| bf16 |" in md and "NVIDIA H200" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.csv"]  # no temporary left behind


def test_plot_writes_png_and_pdf(tmp_path):
    from snapquant.bench.plot import plot_decode

    rows = [_row("128x16x4096", "bf16", 224.0, family="bf16", mode="q16p16", layout="bf16"),
            _row("128x16x4096", "snapmla", 320.0), _row("128x16x4096", "snapmla+bm64", 110.0),
            _row("128x16x4096", "torch", 900.0, family="torch", mode="q16p16", layout="bf16"),
            _row("1x128x32768", "bf16", 100.0, family="bf16", mode="q16p16", layout="bf16"),
            _row("1x128x32768", "snapmla", 104.0)]
    written = plot_decode(rows, tmp_path / "f.png", tmp_path / "f.pdf")
    assert [p.name for p in written] == ["f.png", "f.pdf"]
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "f.pdf").read_bytes()[:4] == b"%PDF"
    assert plot_decode([_row("x", "snapmla", 1.0)], tmp_path / "g.png") == []  # no baseline, no figure


# ------------------------------------------------------------------------------------------ command line
def test_main_end_to_end_on_cpu_and_replot(tmp_path, capsys, monkeypatch):
    fake_flash_mla.uninstall(monkeypatch)  # the FlashMLA rows say so (tests/test_bench_anchor.py: installed)
    out = tmp_path / "bench"
    rc = run_bench(BenchOptions(device="cpu", dims=f"{R},{D}", shapes="2x4x70", variants="snapmla,torch", out=out,
                                append_tokens=16, budget_s=600), timer=FakeTimer())
    assert rc == 1  # ds_v32 appends cannot run at r = 64 (block 128): recorded as errors, exit 1
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench_cpu.json", "bench_cpu.log", "decode_cpu.csv", "decode_cpu.md", "decode_cpu.pdf",
                     "decode_cpu.png"]
    rows = results.read_csv(out / "decode_cpu.csv")
    dec = {r["variant"]: r for r in rows if r["op"] == "decode"}
    assert set(dec) == {"bf16", "snapmla", "torch", "flashmla"}
    assert all(r["status"] == "ok" for n, r in dec.items() if n != "flashmla")
    assert dec["flashmla"]["status"] == "skipped" and dec["flashmla"]["error"] == "FlashMLA not installed"
    assert [r["status"] for r in rows if r["op"] == "read"] == ["ok"]  # the read-bandwidth probe
    assert dec["snapmla"]["fp8_over_bf16"] == 1.0  # the fake timer says 100 us for everything
    app = [r for r in rows if r["op"] == "append"]
    assert {r["status"] for r in app if r["layout"] != "ds_v32"} == {"ok"}
    assert {r["status"] for r in app if r["layout"] == "ds_v32"} == {"error"}
    meta = json.loads((out / "bench_cpu.json").read_text())
    assert meta["counts"]["ok"] == 3 + 6 + 1 and meta["environment"]["device"] == "cpu"
    assert meta["environment"]["read_gbps"] > 0
    assert "Targets: none measured" in (out / "bench_cpu.log").read_text()  # no target shape on CPU
    assert meta["options"]["resolved"]["dims"] == [R, D] and meta["options"]["resolved"]["timer"] == "wall"
    (out / "decode_cpu.png").unlink()
    assert run_bench(BenchOptions(replot=out / "decode_cpu.csv", out=out)) == 0
    assert (out / "decode_cpu.png").exists()
    assert run_bench(BenchOptions(list=True)) == 0 and "snapmla+balanced" in capsys.readouterr().out


def test_snapquant_bench_command_forwards_to_the_harness():
    from typer.testing import CliRunner

    from snapquant.cli import app

    res = CliRunner().invoke(app, ["bench", "--list"])
    assert res.exit_code == 0 and "shape 128x16x4096" in res.output
    res = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--budget-s" in res.output and "--no-append" in res.output
    assert "usage: bench_decode" not in res.output  # one typer help, like the other commands


def test_nan_guard_of_rel_l2():
    a = torch.ones(3)
    assert harness.rel_l2(a, a) == 0.0 and math.isclose(harness.rel_l2(2 * a, a), 1.0)


def test_cuda_graph_timer_control_flow_with_a_fake_device(monkeypatch):
    """The CUDA-graph timer's bookkeeping (capture `calls` calls cycling through the sets, replay,
    per-call time = replay time / calls) against a fake device whose clock advances 7 us per call;
    and the fallback to eager events when capture fails. No GPU needed: torch.cuda is stubbed."""
    from snapquant.bench import timing

    clock = {"us": 0.0}
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["us"]

        def elapsed_time(self, other):
            return (other.t - self.t) / 1e3  # ms

    class Graph:
        capturing = None

        def __init__(self):
            self.ops = []

        def replay(self):
            for op in self.ops:
                op()

    class Capture:
        def __init__(self, g):
            self.g = g

        def __enter__(self):
            Graph.capturing = self.g

        def __exit__(self, *exc):
            Graph.capturing = None

    class Stream:
        def wait_stream(self, other):
            pass

    class StreamCtx:
        def __init__(self, s):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    for name, value in {"Event": Event, "CUDAGraph": Graph, "graph": Capture, "Stream": Stream,
                        "stream": StreamCtx, "current_stream": lambda: Stream(),
                        "synchronize": lambda *a: None}.items():
        monkeypatch.setattr(timing.torch.cuda, name, value)

    def make_fn(i):
        def fn():
            log.append(f"set{i}")
            if Graph.capturing is not None:  # under capture: recorded, not run
                Graph.capturing.ops.append(lambda: clock.__setitem__("us", clock["us"] + 7.0))
            else:
                clock["us"] += 7.0
        return fn

    fns = [make_fn(0), make_fn(1), make_fn(2)]
    t = timing.CudaGraphTimer(runs=5, target_ms=0.1, warmup_runs=2)(fns, est_us=7.0)
    assert t.us == pytest.approx(7.0) and t.runs == 5 and t.timer == "cudagraph"
    assert t.calls_per_run == 15  # 100 us / 7 us -> 15 calls, a multiple of the 3 sets
    assert log[:3] == ["set0", "set1", "set2"] and log[3:18] == ["set0", "set1", "set2"] * 5  # warm-up, capture

    def broken():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(timing.torch.cuda, "CUDAGraph", lambda: (_ for _ in ()).throw(RuntimeError("no graphs")))
    t = harness.time_fns(timing.CudaGraphTimer(runs=3, target_ms=0.05), [make_fn(0)], torch.device("cpu"),
                         log.append)
    assert t.timer == "events" and t.us == pytest.approx(7.0) and any("timing eagerly" in m for m in log)
    with pytest.raises(RuntimeError):
        harness.time_fns(timing.EventTimer(runs=2), [broken], torch.device("cpu"), log.append)


def test_sdpa_expansion_estimate_matches_the_h200_oom_messages():
    from snapquant.bench.harness import sdpa_expansion_bytes

    # K alone (r + d = 576 wide, fp32) was the 144 GiB allocation at B=128 H=128 L=4K
    k_only = sdpa_expansion_bytes(128, 1, 128, 4096, 512, 64) * 576 // (2 * 512 + 64)
    assert k_only == 144 * 2**30
    assert sdpa_expansion_bytes(1, 1, 16, 1024, 512, 64) == 16 * 1024 * 1088 * 4


# ------------------------------------------------------------------------------------------ CPU runs
def test_bench_command_errors_are_one_line_before_anything_runs(tmp_path):
    from typer.testing import CliRunner

    from snapquant.cli import app

    cases = [(["--timer", "cudagraph"], "--timer='cudagraph' needs a CUDA device"),
             (["--timer", "stopwatch"], "--timer='stopwatch' is not valid"),
             (["--shapes", "128x16x4096"], "--shapes: 128x16x4096 caches 524288 tokens"),
             (["--append-tokens", "65536"], "--append-tokens=65536"),
             (["--dims", "512"], "--dims='512'"), (["--budget-s", "0"], "--budget-s=0"),
             (["--priority", "5"], "--priority=5"), (["--variants", "nope*"], "variant 'nope*' matches nothing"),
             (["--device", "tpu"], "--device='tpu'")]
    for args, msg in cases:
        out = tmp_path / args[0].strip("-")
        res = CliRunner().invoke(app, ["bench", "--device", "cpu", "--out", str(out), *args])
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], (
            args, res.output)
        assert not out.exists()  # nothing ran, nothing was written


def test_cpu_runs_pick_cpu_sized_defaults():
    from snapquant.bench.runner import CPU_APPEND_TOKENS, CPU_DIMS, plan
    from snapquant.bench.shapes import CPU_SHAPES

    p = plan(BenchOptions(device="cpu"))
    assert p.shapes == list(CPU_SHAPES) and (p.r, p.d) == CPU_DIMS and p.timer == "wall"
    assert p.append_tokens == CPU_APPEND_TOKENS <= 64 and p.budget_s == 400
    assert max(s.tokens for s in p.shapes) <= 256
    assert plan(BenchOptions(device="cpu", quick=True)).budget_s == 170
    # explicit choices win; the ds_v32 layout's 128-channel blocks fit the CPU default width
    assert (plan(BenchOptions(device="cpu", dims="64,16")).r, CPU_DIMS[0] % 128) == (64, 0)
    assert plan(BenchOptions(device="cpu", append=False, append_tokens=10**6)).append_tokens == 10**6


def test_a_measurement_that_would_not_fit_the_budget_is_not_started(monkeypatch):
    """Fake time: every measurement takes 30 s. With 100 s the run measures at 0, 30 and 60 s and
    skips the rest, ending at 90 s; starting a fourth at 90 s (10 s left) would end at 120 s."""
    import types

    now = {"s": 0.0}
    monkeypatch.setattr(harness, "time", types.SimpleNamespace(perf_counter=lambda: now["s"]))

    class SlowTimer(FakeTimer):
        def __call__(self, fns, est_us=None):
            now["s"] += 30.0
            return super().__call__(fns, est_us)

    variants = [BY_NAME[n] for n in ("bf16", "snapmla", "snapmla_kv_only", "torch", "snapmla+balanced")]
    spec = tiny_spec(variants, shapes=[uniform_shape(2, 4, 70)])
    rows = run(spec, SlowTimer(), log=lambda m: None, budget=Budget(100.0, clock=lambda: now["s"]))
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "skipped", "skipped"]
    assert now["s"] == 90.0 <= 100.0


def test_wall_timer_takes_no_more_samples_than_fit():
    t = WallTimer(runs=5)
    assert t.within(2.5, est_us=1e6, n_sets=1).runs == 2  # 1 s per sample
    assert t.within(2.5, est_us=0.5e6, n_sets=2).runs == 2  # 2 calls per sample
    assert t.within(0.1, est_us=1e6, n_sets=1).runs == 1  # always one sample
    assert t.within(100.0, est_us=1.0, n_sets=1).runs == 5  # never more than asked


def test_snapquant_bench_on_cpu_uses_the_cpu_defaults(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from snapquant.bench import runner
    from snapquant.cli import app

    monkeypatch.setattr(runner, "make_timer", lambda *a, **k: FakeTimer())
    fake_flash_mla.uninstall(monkeypatch)
    out = tmp_path / "b"
    res = CliRunner().invoke(app, ["bench", "--device", "cpu", "--variants", "bf16", "--no-append", "--out", str(out)])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "bench_cpu.json").read_text())
    resolved = meta["options"]["resolved"]
    assert resolved["dims"] == [128, 16] and resolved["shapes"] == ["2x4x64", "mixed3x4"]
    # the two shapes and the read probe; FlashMLA's two rows say it is not installed
    assert resolved["timer"] == "wall" and meta["counts"] == {"ok": 3, "mismatch": 0, "error": 0, "skipped": 2}
