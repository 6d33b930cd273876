"""The task calibration: settings parse and fail early, intervals are exact, the sample-size search
inverts the MDE, and the script writes its table (tiny random model: the numbers mean nothing, the
columns and the arithmetic do)."""

import importlib.util
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from scipy import stats

from snapquant.analysis.significance import mde_paired_binary
from snapquant.embedded import TINY_ARCH, embedded_config, load_tokenizer
from snapquant.errors import ConfigError
from snapquant.eval import calibration
from snapquant.eval.calibration import Setting, parse_setting

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "calibrate_tasks.py"


@pytest.fixture(scope="module")
def tiny():
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(embedded_config(TINY_ARCH, max_position_embeddings=4096)).eval(), load_tokenizer()


def _script():
    spec = importlib.util.spec_from_file_location("calibrate_tasks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_setting_and_early_errors():
    s = parse_setting("sq_code_completion:completion_prefix=0.5,completion_words=2,completion_copyable=true")
    assert s == Setting("sq_code_completion", {"completion_prefix": 0.5, "completion_words": 2,
                                               "completion_copyable": True})
    assert s.label() == "completion_copyable=True,completion_prefix=0.5,completion_words=2"
    assert parse_setting("sq_kv_retrieval_2k:kv_digits=4").label() == (
        f"kv_digits=4,kv_distractors={calibration.sq_utils.KV_DISTRACTORS}")
    with pytest.raises(ConfigError, match="key=value"):
        parse_setting("sq_kv_retrieval_1k:kv_digits")
    with pytest.raises(ConfigError, match="not calibrated"):
        calibration.build(Setting("sq_ruler_cwe"), 1)
    with pytest.raises(ConfigError, match="completion_prefix"):
        calibration.build(Setting("sq_kv_retrieval_1k", {"completion_prefix": 0.5}), 1)
    with pytest.raises(ConfigError, match="kv_digits"):
        calibration.build(Setting("sq_kv_retrieval_1k", {"kv_digits": 0}), 1)


def test_script_rejects_a_bad_setting_before_loading_the_model(monkeypatch, capsys):
    import snapquant

    monkeypatch.setattr(snapquant, "load_embedded", lambda **k: pytest.fail("model loaded"))
    assert _script().main(["sq_code_completion:completion_prefix=1.5"]) == 2
    assert "completion_prefix" in capsys.readouterr().err


def test_clopper_pearson_interval():
    low, high = calibration.proportion_interval(7, 10)
    # Clopper-Pearson bounds are beta quantiles: Beta(k, n-k+1) at 2.5% and Beta(k+1, n-k) at 97.5%.
    assert low == pytest.approx(stats.beta.ppf(0.025, 7, 4), abs=1e-9)
    assert high == pytest.approx(stats.beta.ppf(0.975, 8, 3), abs=1e-9)
    assert calibration.proportion_interval(0, 10)[0] == 0.0 and calibration.proportion_interval(10, 10)[1] == 1.0


@pytest.mark.parametrize("discordance", [0.05, 0.2])
def test_n_for_mde_inverts_the_mde(discordance):
    n = calibration.n_for_mde(discordance, 0.05)
    assert mde_paired_binary(n, discordance) <= 0.05
    # Below ~90% of it the MDE is above target (the exact test's discreteness wiggles by a few samples).
    assert mde_paired_binary(int(0.9 * n), discordance) > 0.05
    assert calibration.n_for_mde(discordance, 0.001, n_max=500) is None


def test_calibrate_rows_and_script_table(tiny, tmp_path, monkeypatch):
    import snapquant

    model, tok = tiny
    # Two generated tokens: a random model never stops early, and the scores mean nothing here anyway.
    rows = calibration.calibrate(model, tok, [Setting("sq_kv_retrieval_1k", {"kv_digits": 5})], 2,
                                 compare="per_tensor_fp8", max_new_tokens=2, log=lambda m: None)
    (row,) = rows
    assert set(row) == set(calibration.CSV_COLUMNS)
    assert row["n"] == 2 and row["accuracy"] == row["correct"] / 2
    assert (row["ci_low"], row["ci_high"]) == calibration.proportion_interval(row["correct"], 2)
    assert row["discordance"] == row["discordant"] / 2
    assert row["mde"] == mde_paired_binary(2, row["discordance"]) or math.isinf(row["mde"])

    monkeypatch.setattr(snapquant, "load_embedded", lambda **k: (model, tok))
    out = tmp_path / "cal"
    assert _script().main(["--n", "2", "--max-new-tokens", "2", "--output-dir", str(out),
                           "sq_kv_retrieval_1k:kv_digits=5",
                           "sq_code_completion:completion_prefix=0.5,completion_words=1"]) == 0
    table = pd.read_csv(out / "calibration.csv")
    assert list(table.columns) == calibration.CSV_COLUMNS and list(table["n"]) == [2, 2]
    assert (table["ci_low"] <= table["accuracy"]).all() and (table["accuracy"] <= table["ci_high"]).all()
    md = (out / "calibration.md").read_text()
    assert "95% CI (Clopper-Pearson)" in md and "`kv_digits=5,kv_distractors=" in md and "commit" in md


def test_script_writes_each_setting_and_resume_keeps_finished_rows(tiny, tmp_path, monkeypatch):
    import snapquant

    model, tok = tiny
    monkeypatch.setattr(snapquant, "load_embedded", lambda **k: (model, tok))
    script, out = _script(), tmp_path / "cal"
    args = ["--n", "1", "--max-new-tokens", "1", "--output-dir", str(out)]
    scored, real = [], calibration.calibrate

    def counting(model, tok, settings, *a, **k):
        scored.extend(s.label() for s in settings)
        return real(model, tok, settings, *a, **k)

    monkeypatch.setattr(calibration, "calibrate", counting)
    assert script.main([*args, "sq_kv_retrieval_1k:kv_digits=5"]) == 0
    first = json.loads((out / "calibration.json").read_text())
    assert "partial" not in first["run"] and first["rows"][0]["commit"] == first["run"]["commit"]

    monkeypatch.setattr(script, "code_unchanged", lambda commit: True)
    first["run"]["commit"] = first["rows"][0]["commit"] = "a" * 40  # as if scored at an earlier commit
    (out / "calibration.json").write_text(json.dumps(first))
    scored.clear()
    assert script.main([*args, "--resume", "sq_kv_retrieval_1k:kv_digits=5", "sq_kv_retrieval_1k:kv_digits=6"]) == 0
    second = json.loads((out / "calibration.json").read_text())
    assert scored == [second["rows"][1]["knobs"]] and "kv_digits=6" in scored[0]
    assert second["rows"][0] == first["rows"][0] and "aaaaaaa" in second["run"]["resumed"]
    assert "partial" not in second["run"] and len(pd.read_csv(out / "calibration.csv")) == 2

    scored.clear()  # other arguments (n) or other code: every setting scored again
    assert script.main(["--n", "2", *args[2:], "--resume", "sq_kv_retrieval_1k:kv_digits=5"]) == 0
    assert len(scored) == 1
    monkeypatch.setattr(script, "code_unchanged", lambda commit: False)
    scored.clear()
    assert script.main(["--n", "2", *args[2:], "--resume", "sq_kv_retrieval_1k:kv_digits=5"]) == 0
    assert len(scored) == 1
    monkeypatch.undo()
    assert not _script().code_unchanged("0" * 40)  # an unknown commit never passes
