"""Tables, paired significance tests and plots from sweep result JSONs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from snapquant import ConfigError
from snapquant.analysis import build_table, load_results, mcnemar_exact, paired_test
from snapquant.analysis.plots import plot_all
from snapquant.analysis.significance import binom_two_sided, mde_paired_binary, pair_samples
from snapquant.sweep import SweepSpec, run_sweep
from tests.support.sweep_fakes import FakeEvaluator


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("res") / "out"
    spec = SweepSpec.from_dict({
        "name": "t", "model": "embedded", "fidelity": False, "output_dir": str(out),
        "tasks": [{"name": "fake_a", "limit": 400}, {"name": "fake_b", "limit": 60}],
        "presets": ["bf16", "snapmla", "int4_kivi", "per_tensor_fp8"]})
    run_sweep(spec, FakeEvaluator(), show_progress=False)
    return out


# ---------------------------------------------------------------------- significance
def test_binomial_tail_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(0, 0), (0, 1), (3, 10), (5, 10), (10, 40), (120, 300)]:
        ref = 1.0 if n == 0 else stats.binomtest(k, n, 0.5).pvalue
        assert binom_two_sided(k, n) == pytest.approx(ref, rel=1e-9, abs=1e-300)


def test_mcnemar_counts_only_discordant_pairs():
    base = [1] * 50 + [0] * 50
    var = [1] * 50 + [0] * 50
    t = mcnemar_exact(base, var)
    assert t.p_value == 1.0 and t.delta == 0 and t.discordant == (0, 0)
    var2 = [0] * 12 + [1] * 38 + [0] * 50  # 12 answers lost, none gained
    t2 = mcnemar_exact(base, var2)
    assert t2.discordant == (12, 0) and t2.p_value == pytest.approx(2 * 0.5**12)
    assert t2.delta == pytest.approx(-0.12) and t2.significant()


def test_paired_test_detects_real_paired_shift_that_unpaired_stderr_hides():
    rng = np.random.default_rng(1)
    difficulty = rng.normal(0, 3, 300)  # large between-document variance
    base = difficulty + rng.normal(0, 0.1, 300)
    var = base - 0.1 + rng.normal(0, 0.1, 300)
    t = paired_test(list(base), list(var), "mean", n_resamples=4000, seed=0)
    assert t.test == "sign_flip_permutation" and t.p_value < 0.01 and t.ci_high < 0 < -t.ci_low
    unpaired_se = math.hypot(base.std() / math.sqrt(300), var.std() / math.sqrt(300))
    assert abs(t.delta) < unpaired_se  # invisible to value ± stderr, visible to the paired test
    same = paired_test(list(base), list(base + rng.normal(0, 1e-9, 300) * 0), "mean", n_resamples=2000)
    assert same.p_value == 1.0


def test_paired_permutation_uses_the_task_aggregation():
    # (loglik, words) pairs as lm-eval's word_perplexity logs them
    rng = np.random.default_rng(2)
    words = rng.integers(50, 500, 80)
    ll_base = -words * rng.uniform(1.0, 2.0, 80)
    ll_var = ll_base * 1.02  # 2% more nats per word
    base = list(zip(ll_base, words, strict=True))
    var = list(zip(ll_var, words, strict=True))
    t = paired_test(base, var, "weighted_perplexity", n_resamples=1000)
    ref = math.exp(-ll_var.sum() / words.sum()) - math.exp(-ll_base.sum() / words.sum())
    assert t.delta == pytest.approx(ref) and t.delta > 0 and t.p_value < 0.01
    assert t.ci_low <= t.delta <= t.ci_high


def test_pair_samples_aligns_on_doc_id():
    base = [{"doc_id": i, "doc_hash": f"h{i}", "metrics": {"acc": i % 2}} for i in range(5)]
    var = [{"doc_id": i, "doc_hash": f"h{i}", "metrics": {"acc": 1}} for i in (4, 2, 0, 9)]
    a, b = pair_samples(base, var, "acc")
    assert a == [0, 0, 0] and b == [1, 1, 1]


# ---------------------------------------------------------------------- tables
def _jsons(results_dir: Path) -> dict[str, dict]:
    return {d["label"]: d for d in (json.loads(p.read_text()) for p in (results_dir / "cells").glob("*.json"))}


def test_table_numbers_come_from_the_jsons(results_dir, tmp_path):
    cells = _jsons(results_dir)
    tab = build_table(load_results(results_dir))
    assert tab.baseline == "bf16"
    assert list(tab.cells["label"]) == ["bf16", "snapmla", "int4_kivi", "per_tensor_fp8"]
    base = cells["bf16"]["tasks"]
    for _, row in tab.long.iterrows():
        m = cells[row["label"]]["tasks"][row["task"]]["metrics"]["acc"]
        assert row["value"] == m["value"] and row["stderr"] == m["stderr"]
        if row["label"] != "bf16":
            assert row["delta"] == pytest.approx(m["value"] - base[row["task"]]["metrics"]["acc"]["value"])
            # the paired test is recomputed from the per-sample outcomes in the JSONs
            a = [s["metrics"]["acc"] for s in cells["bf16"]["samples"][row["task"]]]
            b = [s["metrics"]["acc"] for s in cells[row["label"]]["samples"][row["task"]]]
            assert row["p_value"] == pytest.approx(mcnemar_exact(a, b).p_value) and row["n_paired"] == len(a)
    by = tab.long.set_index(["label", "task"])
    assert by.loc[("int4_kivi", "fake_a"), "significant"]  # 360 B/token flips many of 400 answers
    assert tab.cells.set_index("label").loc["snapmla", "bytes_per_token"] == 644
    files = tab.save(tmp_path)
    md, tex = files["markdown"].read_text(), files["latex"].read_text()
    for lbl, d in cells.items():
        v = d["tasks"]["fake_a"]["metrics"]["acc"]
        k = 1 - math.floor(math.log10(v["stderr"]))
        assert f"{v['value']:.{k}f} ± {v['stderr']:.{k}f}" in md
        assert f"{v['value']:.{k}f}" + r" $\pm$ " + f"{v['stderr']:.{k}f}" in tex
        assert lbl.replace("_", r"\_") in tex
    assert "| int4_kivi |" in md and "(-" in md and "*)" in md and "| 360 |" in md
    # The last row is each task column's MDE at its n; the caption names each task's test and n.
    tests = tab.task_tests.set_index("task")
    for task, n in (("fake_a", 400), ("fake_b", 60)):
        assert tests.loc[task, "test"] == "mcnemar_exact" and tests.loc[task, "n"] == n
        assert f"{task} (acc): exact McNemar, n = {n} paired samples" in md
        sel = tab.long[(tab.long["task"] == task) & ~tab.long["is_baseline"]]
        psi = sel["discordant"].sum() / sel["n_paired"].sum()
        assert tests.loc[task, "mde"] == pytest.approx(mde_paired_binary(n, psi))
    mde_row = next(line for line in md.splitlines() if line.startswith("| MDE (α=0.05, power 0.8) |"))
    assert mde_row.split(" | ")[1:3] == [f"{tests.loc['fake_a', 'mde']:.3g}", f"{tests.loc['fake_b', 'mde']:.3g}"]
    assert tests.loc["fake_a", "mde"] < tests.loc["fake_b", "mde"]  # 400 vs 60 samples
    assert r"MDE ($\alpha$=0.05, power 0.8)" in tex
    assert pd.read_csv(files["tasks_csv"])["mde"].tolist() == pytest.approx(tests["mde"].tolist())
    assert r"\toprule" in tex and r"\end{tabular}" in tex
    csv = pd.read_csv(files["csv"])
    assert np.allclose(csv.sort_values(["label", "task"])["value"], tab.long.sort_values(["label", "task"])["value"])


def test_table_cli_and_plot_cli(results_dir, tmp_path):
    from typer.testing import CliRunner

    from snapquant.cli import app

    r = CliRunner().invoke(app, ["table", str(results_dir), "--out", str(tmp_path / "tab")])
    assert r.exit_code == 0, r.output
    assert "bf16 (baseline)" in r.stdout and (tmp_path / "tab" / "table.tex").exists()
    r = CliRunner().invoke(app, ["plot", str(results_dir), "--out", str(tmp_path / "fig")])
    assert r.exit_code == 0, r.output
    for stem in ("accuracy_vs_bytes", "task_deltas"):
        for ext in ("png", "pdf"):
            p = tmp_path / "fig" / f"{stem}.{ext}"
            assert p.exists() and p.stat().st_size > 5000
        assert (tmp_path / "fig" / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / "fig" / f"{stem}.pdf").read_bytes()[:4] == b"%PDF"
    r = CliRunner().invoke(app, ["table", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no results" in r.output


def test_plot_data_are_the_json_numbers(results_dir, tmp_path):
    cells = _jsons(results_dir)
    tab = build_table(load_results(results_dir))
    plot_all(tab, tmp_path)
    pts = pd.read_csv(tmp_path / "accuracy_vs_bytes.csv")
    assert len(pts) == 8
    for _, p in pts.iterrows():
        d = cells[p["label"]]
        assert p["value"] == d["tasks"][p["task"]]["metrics"]["acc"]["value"]
        assert p["bytes_per_token"] == d["bytes_per_token"]["per_layer"]
    deltas = pd.read_csv(tmp_path / "task_deltas.csv")
    assert len(deltas) == 6 and set(deltas["label"]) == {"snapmla", "int4_kivi", "per_tensor_fp8"}
    for _, p in deltas.iterrows():
        d, b = cells[p["label"]], cells["bf16"]
        ref = d["tasks"][p["task"]]["metrics"]["acc"]["value"] - b["tasks"][p["task"]]["metrics"]["acc"]["value"]
        assert p["delta"] == pytest.approx(ref) and p["ci_low"] <= p["delta"] <= p["ci_high"]


def test_table_without_baseline_and_bad_inputs(results_dir, tmp_path):
    res = [r for r in load_results(results_dir) if r["label"] != "bf16"]
    tab = build_table(res)
    assert tab.baseline is None and tab.long["delta"].isna().all()
    assert "no baseline row" in tab.to_markdown()
    with pytest.raises(ConfigError, match="not a cell label"):
        build_table(res, baseline="fp64")
    (tmp_path / "x.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ConfigError, match="not a snapquant sweep cell"):
        load_results(tmp_path / "x.json")
    with pytest.raises(ConfigError, match="no finished cell"):
        load_results(_empty(tmp_path))


def _empty(tmp_path: Path) -> Path:
    d = tmp_path / "empty"
    d.mkdir()
    return d
