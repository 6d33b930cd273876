"""snapquant.bench.e2e (scripts/bench_e2e.py): the largest-context fit, and a CPU smoke run of the whole
benchmark (stock, patched eager and the DecodeGraph step) with tiny contexts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from snapquant.bench import e2e as bench_e2e

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_e2e.py"


def test_fit_max_context_is_the_budget_crossing_of_the_peak_line():
    gib = 2.0**30
    # peak = 2 GiB + 1 MiB per token: a 10 GiB budget holds (10 - 2) GiB / 1 MiB = 8192 tokens
    pts = [(1024, 2 * gib + 1024 * 2**20), (4096, 2 * gib + 4096 * 2**20)]
    assert bench_e2e.fit_max_context(pts, 10 * gib) == 8192
    assert bench_e2e.fit_max_context(pts[:1], 10 * gib) is None  # one point: no line
    assert bench_e2e.fit_max_context([(1, 5.0), (2, 5.0)], 10.0) is None  # flat: unbounded
    assert bench_e2e.fit_max_context(pts, 1 * gib) == 0  # the fixed part alone exceeds the budget
    assert bench_e2e.fit_max_context(pts, 10 * gib + 2**20 * 100) % 64 == 0  # whole pages


def test_cpu_smoke_run_writes_rows_for_every_variant_and_mode(tmp_path, one_thread):
    out = tmp_path / "e2e.json"
    rc = bench_e2e.main(["--device", "cpu", "--layers", "1", "--contexts", "64,128", "--steps", "1",
                         "--graphs", "--backend", "reference", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    got = {(r["context"], r["variant"], r["mode"]) for r in data["rows"]}
    want = {(L, v, m) for L in (64, 128) for v, m in
            (("stock", "eager"), ("bf16", "eager"), ("bf16", "graph"), ("snapmla", "eager"), ("snapmla", "graph"))}
    assert got == want
    for r in data["rows"]:
        assert r["ms_per_step"] > 0 and "graph_error" not in r
        if r["mode"] == "graph":  # the fixed-shape step reproduces the eager patched step
            assert r["logits_rel_vs_eager"] < 1e-5
    snap = [r for r in data["rows"] if r["variant"] == "snapmla"]
    assert all(r["bytes_per_token_layer"] == 644 for r in snap)  # the SnapMLA format at V2-Lite dims
    assert data["env"]["seeds"] and data["env"]["environment"]["packages"]["torch"]
    assert out.with_suffix(".csv").read_text().count("\n") == len(data["rows"]) + 1


def test_script_is_the_command_line_of_the_module():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--contexts" in out.stdout and "--budget-gib" in out.stdout
