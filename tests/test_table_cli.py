"""`snapquant table` / `snapquant plot` on bad input: one line, rc 2, nothing written; corrupt cells named."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from snapquant import ConfigError
from snapquant.analysis import build_table, load_results
from snapquant.analysis.results import CorruptResultWarning
from snapquant.cli import app
from snapquant.sweep import SweepSpec, run_sweep
from tests.support.sweep_fakes import FakeEvaluator

REPO = Path(__file__).resolve().parents[1]
SENTINEL = "an earlier table: must survive a rejected command\n"


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("res") / "out"
    spec = SweepSpec.from_dict({
        "name": "t", "model": "embedded", "fidelity": False, "output_dir": str(out),
        "tasks": [{"name": "fake_a", "limit": 40}, {"name": "fake_b", "limit": 30}],
        "presets": ["bf16", "snapmla", "per_tensor_fp8"]})
    run_sweep(spec, FakeEvaluator(), show_progress=False)
    return out


@pytest.fixture
def results(sweep_dir, tmp_path) -> Path:
    """A private copy of the sweep's results, with an earlier table.md in it."""
    d = tmp_path / "res"
    shutil.copytree(sweep_dir, d)
    (d / "table.md").write_text(SENTINEL)
    return d


def _invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_error(r) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def _untouched(d: Path, before: set[str]) -> None:
    assert (d / "table.md").read_text() == SENTINEL
    assert {p.name for p in d.iterdir()} == before  # no table.tex/.csv, no plots/


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize("command", ["table", "plot"])
@pytest.mark.parametrize("choice, named, valid", [
    ("fake_a=bogus", "'bogus'", "its metrics: acc"),
    ("fake_a=ac", "'ac'", "did you mean 'acc'?"),
    ("bogus_task=acc", "'bogus_task'", "tasks: fake_a, fake_b"),
    ("fake_c=acc", "'fake_c'", "tasks: fake_a, fake_b"),
])
def test_unknown_task_or_metric_is_one_line_and_writes_nothing(results, command, choice, named, valid):
    before = {p.name for p in results.iterdir()}
    line = _one_line_error(_invoke(command, results, "--metric", choice))
    assert named in line and valid in line and choice in line
    _untouched(results, before)


def test_repeated_metric_for_one_task_is_an_error(results):
    before = {p.name for p in results.iterdir()}
    line = _one_line_error(_invoke("table", results, "--metric", "fake_a=acc", "--metric", "fake_a=acc_norm"))
    assert "fake_a" in line and "twice" in line
    _untouched(results, before)


@pytest.mark.parametrize("alpha", ["7", "-1", "0", "1", "nan", "inf"])
def test_alpha_outside_zero_one_is_one_line_and_writes_nothing(results, alpha):
    before = {p.name for p in results.iterdir()}
    line = _one_line_error(_invoke("table", results, "--alpha", alpha))
    assert "alpha=" in line and "0 < alpha < 1" in line
    _untouched(results, before)


def test_valid_metric_and_alpha_still_make_the_table(results):
    r = _invoke("table", results, "--metric", "fake_a=acc", "--alpha", "0.01")
    assert r.exit_code == 0, r.output
    assert "p < 0.01" in (results / "table.md").read_text()


def test_library_checks_match_the_cli(sweep_dir):
    res = load_results(sweep_dir)
    with pytest.raises(ConfigError, match=r"no task 'nope'.*tasks: fake_a, fake_b"):
        build_table(res, metrics={"nope": "acc"})
    with pytest.raises(ConfigError, match=r"fake_b records no metric 'f1'; its metrics: acc"):
        build_table(res, metrics={"fake_b": "f1"})
    with pytest.raises(ConfigError, match="0 < alpha < 1"):
        build_table(res, alpha=1.5)


# ---------------------------------------------------------------------- corrupt cells
def _truncate_one_cell(results: Path) -> Path:
    victim = sorted((results / "cells").glob("*.json"))[1]
    text = victim.read_text()
    victim.write_text(text[: len(text) // 2])  # what a full disk or a copy cut short leaves
    return victim


@pytest.mark.parametrize("command", ["table", "plot"])
def test_truncated_cell_is_an_error_naming_the_file(results, command):
    victim = _truncate_one_cell(results)
    before = {p.name for p in results.iterdir()}
    line = _one_line_error(_invoke(command, results))
    assert str(victim) in line and "not valid JSON" in line and "--skip-corrupt" in line
    _untouched(results, before)


@pytest.mark.parametrize("command", ["table", "plot"])
def test_skip_corrupt_leaves_the_cell_out_with_a_warning_naming_it(results, command):
    victim = _truncate_one_cell(results)
    r = _invoke(command, results, "--skip-corrupt")
    assert r.exit_code == 0, r.output
    assert f"warning: left out corrupt cell result {victim}" in r.stderr
    assert "1 cell result file(s) left out" in r.stderr
    if command == "table":
        rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "---" not in ln]
        assert len(rows) == 1 + 2 + 1  # header + the two readable cells of three + the MDE row
        assert rows[-1].startswith("| MDE (")


def test_cell_with_missing_keys_or_a_foreign_cell_id_is_corrupt(results):
    cells = sorted((results / "cells").glob("*.json"))
    d = json.loads(cells[0].read_text())
    del d["tasks"]
    cells[0].write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=re.escape(f"{cells[0].name}: missing keys: tasks")):
        load_results(results)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = load_results(results, skip_corrupt=True)
    assert len(res) == 2 and [w.category for w in caught] == [CorruptResultWarning]
    d = json.loads(cells[1].read_text())
    cells[0].write_text(json.dumps(d))  # a copy of another cell under the wrong name
    with pytest.raises(ConfigError, match="does not match the file name"):
        load_results(results)


def test_corrupt_file_of_earlier_sweep_settings_is_not_in_the_table_anyway(results):
    (results / "cells" / "0123456789ab.json").write_text('{"schema": "snapquant.sweep.cell/1", "cel')
    assert len(load_results(results)) == 3  # not a cell of the current manifest: not a missing row
    with pytest.raises(ConfigError, match=r"0123456789ab\.json"):
        load_results(results, all_runs=True)


# ---------------------------------------------------------------------- inputs that are not results
def test_single_truncated_json_names_the_file(results, tmp_path):
    cell = sorted((results / "cells").glob("*.json"))[0]
    bad = tmp_path / "cell.json"
    bad.write_text(cell.read_text()[:100])
    line = _one_line_error(_invoke("table", bad, "--out", tmp_path / "o"))
    assert str(bad) in line and "not valid JSON" in line and "expected" in line
    assert not (tmp_path / "o").exists()
    (tmp_path / "empty.json").write_text("")
    line = _one_line_error(_invoke("table", tmp_path / "empty.json"))
    assert "empty.json: empty file" in line


def test_folder_of_unrelated_json_names_the_folder_or_the_file(tmp_path):
    d = tmp_path / "other"
    d.mkdir()
    (d / "a.json").write_text(json.dumps({"results": {"arc": 0.5}}))
    (d / "b.json").write_text(json.dumps([1, 2, 3]))
    line = _one_line_error(_invoke("table", d))
    assert str(d) in line and "none of its 2 JSON file(s)" in line and "snapquant.sweep.cell/1" in line
    (d / "c.json").write_text('{"a": 1}\n{"a": 2}\n')  # JSON lines under a .json name
    line = _one_line_error(_invoke("table", d))
    assert str(d / "c.json") in line and "not valid JSON" in line
    assert not (d / "table.md").exists()


def test_yaml_config_names_the_file_and_what_to_do(tmp_path):
    cfg = REPO / "configs" / "quickstart.yaml"
    line = _one_line_error(_invoke("table", cfg, "--out", tmp_path / "o"))
    assert str(cfg) in line and "YAML" in line and "snapquant sweep" in line
    line = _one_line_error(_invoke("plot", cfg, "--out", tmp_path / "o"))
    assert str(cfg) in line
    assert not (tmp_path / "o").exists()


def test_single_non_cell_json_is_an_error_even_when_skipping(tmp_path):
    f = tmp_path / "x.json"
    f.write_text(json.dumps([1]))
    line = _one_line_error(_invoke("table", f, "--skip-corrupt"))
    assert "x.json is not a snapquant sweep cell result (the JSON is an array, not an object)" in line


# ---------------------------------------------------------------------- fidelity tables
FID = {"num_sequences": 6, "seq_len": 30, "prompt_len": 8}


@pytest.fixture(scope="module")
def fid_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fid") / "out"
    spec = SweepSpec.from_dict({
        "name": "f", "model": "embedded", "fidelity": FID, "output_dir": str(out),
        "tasks": [{"name": "fake_a", "limit": 30}], "presets": ["bf16", "snapmla", "per_tensor_fp8"]})
    run_sweep(spec, FakeEvaluator(fidelity=True), show_progress=False)
    return out


def test_table_shows_fidelity_with_intervals_and_writes_the_fidelity_tables(fid_dir, tmp_path):
    d = tmp_path / "res"
    shutil.copytree(fid_dir, d)
    r = _invoke("table", d, "--baseline", "snapmla")
    assert r.exit_code == 0, r.output
    assert "KL mean [95% CI]" in r.stdout and "| 6 / 126 |" in r.stdout  # 6 sequences x (30 - 8 - 1) decode positions
    for name in ("fidelity.md", "fidelity.tex", "fidelity.csv", "fidelity_summary.csv", "fidelity_pairs.csv",
                 "fidelity_tail.md", "fidelity_tail.csv"):
        assert (d / name).is_file(), name
    comp = pd.read_csv(d / "fidelity.csv")
    row = comp[(comp["label"] == "per_tensor_fp8") & (comp["mode"] == "decode")].iloc[0]
    assert row["baseline"] == "snapmla" and (row["n_sequences"], row["n_positions"]) == (6, 126)
    assert row["kl_ratio_ci_low"] <= row["kl_ratio"] <= row["kl_ratio_ci_high"] and 0 < row["kl_delta_p"] <= 1
    assert "intervals over 6 sequence(s) are rough" in (d / "fidelity.md").read_text()
    assert len(pd.read_csv(d / "fidelity_pairs.csv")) == 2 * 3  # 3 pairs of cells, 2 modes
    # the planted position (sequence 1, decode position 3 -> predicted token 8 + 3 + 1) is listed
    tail = (d / "fidelity_tail.md").read_text()
    assert re.search(r"## snapmla \(decode\): 1 of 126 positions above 0\.1, carrying \d+% of the summed KL", tail)
    assert "| 1 | 12 | 2 |" in tail
    # an unquantized baseline has no KL to divide by
    r = _invoke("table", d)
    comp = pd.read_csv(d / "fidelity.csv")
    assert comp["kl_ratio"].isna().all() and (comp["kl_ratio_method"].str.contains("unquantized")).all()


def test_tail_lists_the_planted_position_with_its_decoded_context(fid_dir):
    from snapquant.analysis import build_fidelity_table
    from tests.support.sweep_fakes import PLANTED, LetterTokenizer, fake_tokens

    tab = build_fidelity_table(load_results(fid_dir), decode=LetterTokenizer().decode, tail_threshold=0.5, tail_top=3)
    t = tab.tail[(tab.tail["label"] == "snapmla") & (tab.tail["mode"] == "decode")]
    assert len(t) == 3 and t["kl"].is_monotonic_decreasing  # 1 above 0.5, filled up to the top 3
    top = t.iloc[0]
    seq, pos = PLANTED[0], FID["prompt_len"] + PLANTED[1] + 1
    ids = fake_tokens(FID["num_sequences"], FID["seq_len"])
    assert (top["sequence"], top["position"], top["kl"]) == (seq, pos, PLANTED[2])
    assert top["context"] == "".join(map(chr, ids[seq, :pos]))[-40:]
    assert top["next_token"] == top["ref_top1"] == chr(ids[seq, pos]) and top["quant_top1"] != top["ref_top1"]
    assert top["kl_share"] == pytest.approx(PLANTED[2] / top["kl_total"]) and top["kl_share"] > 0.5
    assert tab.tail[tab.tail["label"] == "bf16"].empty  # nothing moved: nothing listed


def _strip_to_old_format(d: Path) -> None:
    """Cells as written before intervals: no summary / per-sequence sums / arrays file, no n_sequences."""
    from snapquant.results_io import ARRAYS_KEY

    for f in (d / "cells").glob("*.json"):
        c = json.loads(f.read_text())
        c.pop(ARRAYS_KEY, None)
        for m in ("prefill", "decode"):
            for k in ("summary", "per_sequence", "interval", "n_sequences", "first_position"):
                c["fidelity"][m].pop(k, None)
        c["fidelity"].pop("tokens_sha256")
        f.write_text(json.dumps(c))
    for f in (d / "cells").glob("*.npz"):
        f.unlink()


def test_old_format_cells_still_make_the_table_without_the_new_columns(fid_dir, tmp_path):
    d = tmp_path / "old"
    shutil.copytree(fid_dir, d)
    _strip_to_old_format(d)
    r = _invoke("table", d)
    assert r.exit_code == 0, r.output
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("| snapmla |"))
    assert "[" not in row.split("|")[4]  # KL mean without an interval
    fid = (d / "fidelity.md").read_text()
    assert "paired comparison" not in fid and "point values only" in r.stderr
    assert "no per-position arrays file" in (d / "fidelity_tail.md").read_text()
