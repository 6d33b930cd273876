"""snapquant.bench.e2e (scripts/bench_e2e.py): the largest-context fit, and a CPU smoke run of the whole
benchmark (stock, patched eager and the DecodeGraph step) with tiny contexts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from snapquant.bench import e2e as bench_e2e
from tests.support import fake_flash_mla

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


def test_kv_budget_batches_and_the_anchor_comparison():
    # 1 layer, 65 tokens: bf16 1152 B/token -> 74880 B per request, snapmla 644 -> 41860 B
    assert bench_e2e.budget_batch(214748 / 2**30, "bf16", 1, 64, 8) == 2
    assert bench_e2e.budget_batch(214748 / 2**30, "snapmla", 1, 64, 8) == 5
    assert bench_e2e.budget_batch(214748 / 2**30, "snapmla", 1, 64, 3) == 3  # capped
    assert bench_e2e.budget_batch(1e-9, "bf16", 1, 64, 8) == 0
    key = ("kv_budget", 64, "graph")
    anchor = [0.010, 0.011, 0.009, 0.010, 0.010]  # seconds per step at batch 2: 200 tokens/s
    mine = [0.0125, 0.0120, 0.0130, 0.0125, 0.0125]  # at batch 5: 400 tokens/s
    rows = [{"scenario": "kv_budget", "context": 64, "mode": "graph", "variant": v, "batch": b}
            for v, b in (("bf16@flashmla", 2), ("snapmla", 5))]
    comps = bench_e2e.compare_to_anchor(rows, {key: (anchor, 2)}, {(key, "bf16@flashmla"): anchor,
                                                                   (key, "snapmla"): mine})
    assert len(comps) == 1 and comps[0]["speedup_vs_flashmla"] == pytest.approx(2.0)
    lo, hi = comps[0]["ci95"]
    assert lo <= 2.0 <= hi and comps[0]["n"] == [5, 5] and "speedup_vs_flashmla" not in rows[0]
    assert bench_e2e.parse_variants("bf16@flashmla, snapmla", "triton") == [
        ("bf16@flashmla", "bf16", "flashmla"), ("snapmla", "snapmla", "triton")]


@pytest.mark.slow  # covered by default: test_kv_budget_batches_and_the_anchor_comparison, tests/test_flashmla.py
def test_flashmla_anchor_at_a_batch_and_at_a_kv_memory_budget(tmp_path, one_thread, monkeypatch):
    """bf16 on FlashMLA (the fake) against snapmla, at --batch and at the largest batch whose cache fits the
    budget: 0.0002 GiB = 214748 B holds 2 requests of 65 bf16 tokens (74880 B each at 1152 B/token, one layer)
    and 5 of snapmla (41860 B each at 644 B/token)."""
    fake = fake_flash_mla.install(monkeypatch)
    out = tmp_path / "e2e.json"
    with fake_flash_mla.on_cpu():
        rc = bench_e2e.main(["--device", "cpu", "--dtype", "bfloat16", "--layers", "1", "--contexts", "64",
                             "--steps", "3", "--graphs", "--no-stock", "--backend", "reference", "--presets",
                             "bf16@flashmla,snapmla", "--kv-budget-gib", "0.0002", "--max-batch", "8",
                             "--out", str(out)])
    assert rc == 0 and fake.RECORDER.calls > 0
    data = json.loads(out.read_text())
    rows = {(r["scenario"], r["variant"], r["mode"]): r for r in data["rows"]}
    assert {k[:2] for k in rows} == {(s, v) for s in ("batch", "kv_budget") for v in ("bf16@flashmla", "snapmla")}
    assert rows[("kv_budget", "bf16@flashmla", "eager")]["batch"] == 2 and rows[("kv_budget", "snapmla", "eager")]["batch"] == 5
    for r in data["rows"]:
        assert "graph_error" not in r and r["backend"] == ("flashmla" if r["variant"] == "bf16@flashmla" else "reference")
        if r["variant"] == "snapmla":  # a ratio with its interval and n, against the anchor in the same scenario
            assert r["speedup_vs_flashmla_lo"] <= r["speedup_vs_flashmla"] <= r["speedup_vs_flashmla_hi"]
        if r["mode"] == "graph":
            assert r["logits_rel_vs_eager"] < 1e-5
    comps = data["env"]["comparisons"]
    assert {(c["scenario"], c["mode"]) for c in comps} == {(s, m) for s in ("batch", "kv_budget") for m in ("eager", "graph")}
    assert all(c["n"][0] >= 3 and c["ci95"] is not None for c in comps)
    assert next(c for c in comps if c["scenario"] == "kv_budget")["anchor_batch"] == 2


def test_flashmla_not_installed_is_one_line_and_the_rest_runs(tmp_path, one_thread, monkeypatch, capsys):
    fake_flash_mla.uninstall(monkeypatch)
    out = tmp_path / "e2e.json"
    rc = bench_e2e.main(["--device", "cpu", "--layers", "1", "--contexts", "64", "--steps", "1", "--no-stock",
                         "--backend", "reference", "--presets", "bf16@flashmla,snapmla", "--out", str(out)])
    assert rc == 0 and "bf16@flashmla: FlashMLA not installed" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {r["variant"] for r in data["rows"]} == {"snapmla"} and data["env"]["comparisons"] == []
    assert bench_e2e.main(["--presets", "bf16@nonesuch"]) == 2  # a bad entry: one line, before any model


def test_script_is_the_command_line_of_the_module():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--contexts" in out.stdout and "--budget-gib" in out.stdout


def test_plot_draws_one_linear_panel_per_scenario_and_no_empty_capacity_panel(tmp_path, monkeypatch):
    """Bars from 0 on a linear axis (heights compare as ratios), a panel per scenario (batch; equal KV memory
    at each variant's own batch), and the largest-context panel only when a fit exists."""
    import matplotlib.pyplot as plt

    from snapquant.bench import e2e

    rows = [{"scenario": sc, "context": 32768, "variant": v, "mode": "graph", "batch": b, "tokens_per_s": t}
            for sc, v, b, t in (("batch", "bf16@flashmla", 32, 6985.0), ("batch", "snapmla", 32, 7759.0),
                                ("kv_budget", "bf16@flashmla", 56, 8472.0), ("kv_budget", "snapmla", 101, 12216.0))]
    env = {"batch": 32, "layers": 8, "device": "cpu", "budget_gib": 64.0, "kv_budget_gib": 16.0}
    figs = []
    real = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figs.append(fig), real(fig))[1])
    e2e.plot(tmp_path / "p.png", rows, env)
    axes = figs[0].axes
    assert len(axes) == 2 and all(ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0 for ax in axes)
    assert "equal KV-cache memory (16.0 GiB)" in axes[1].get_title()
    assert sorted(round(b.get_height()) for b in axes[1].patches) == [8472, 12216]
    assert (tmp_path / "p.png").is_file() and (tmp_path / "p.pdf").is_file()
    rows[0]["max_context_in_budget"] = 90000
    e2e.plot(tmp_path / "q.png", rows, env)
    assert len(figs[1].axes) == 3 and figs[1].axes[2].get_ylabel() == "largest context (K tokens)"
