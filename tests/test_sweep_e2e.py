"""A real sweep end to end: tiny MLA checkpoint, snapquant.patch, lm-eval tasks, fidelity, table, plots.

3 presets x 2 tasks (a rolling log-likelihood task and a generation task) on a random-weight model
with the embedded model's architecture family and tokenizer, small enough for CI (~30 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.checkpoints import tiny_checkpoint

pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate (pip install accelerate)")

from snapquant.results_io import is_valid_cell
from snapquant.sweep import SweepSpec, execute


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def test_real_sweep_three_presets_two_tasks(tiny_ckpt, tmp_path):
    spec = SweepSpec.from_dict({
        "name": "e2e", "model": str(tiny_ckpt), "dtype": "float32", "device": "cpu", "batch_size": 4,
        "tasks": [{"name": "sq_code_ppl", "limit": 1},
                  {"name": "sq_code_completion", "limit": 3, "gen_kwargs": {"max_gen_toks": 4}}],
        "presets": ["bf16", "snapmla", "per_tensor_fp8"], "bootstrap_iters": 50,
        "fidelity": {"num_sequences": 2, "seq_len": 24, "prompt_len": 12},
        "output_dir": str(tmp_path / "out")})
    res = execute(spec, show_progress=False)
    assert not res.report.failed, res.report.failed
    cells = {d["label"]: d for d in (json.loads(p.read_text()) for p in (tmp_path / "out" / "cells").glob("*.json"))}
    assert set(cells) == {"bf16", "snapmla", "per_tensor_fp8"}
    for lbl, d in cells.items():
        assert is_valid_cell(d)
        assert set(d["tasks"]) == {"sq_code_ppl", "sq_code_completion"}
        assert d["tasks"]["sq_code_completion"]["primary_metric"] == "exact_match"
        assert len(d["samples"]["sq_code_completion"]) == 3 and len(d["samples"]["sq_code_ppl"]) == 1
        assert d["lm_eval"]["sq_code_ppl"]["results"]["sq_code_ppl"]["word_perplexity,none"] > 1
        assert d["model"]["kv_lora_rank"] == 64 and d["model"]["num_mla_layers"] == 2
        assert d["env"]["packages"]["lm_eval"] and d["timing"]["task:sq_code_ppl"] > 0
        assert d["kv_config"]["name"] == lbl
        fid = d["fidelity"]
        assert fid["decode"]["n_positions"] == 2 * (24 - 12 - 1) and fid["prefill"]["n_positions"] == 2 * 23
    # the unquantized cell reproduces the unpatched model; quantized ones move the distributions
    assert cells["bf16"]["fidelity"]["decode"]["kl_max"] < 1e-9
    assert cells["bf16"]["fidelity"]["decode"]["top1_agree"] == 1.0
    assert cells["snapmla"]["fidelity"]["decode"]["kl_mean"] > 1e-12
    # log-likelihood requests never decode: with BF16 prefill they are bit-identical in every cell
    ppl = {lbl: d["tasks"]["sq_code_ppl"]["metrics"]["word_perplexity"]["value"] for lbl, d in cells.items()}
    assert len(set(ppl.values())) == 1
    assert cells["per_tensor_fp8"]["bytes_per_token"]["per_layer"] == 80  # (64 + 16) fp8 bytes
    # table and figures were written from these files
    md = res.files["markdown"].read_text()
    assert "| bf16 (baseline) |" in md and "sq_code_completion (exact_match)" in md
    assert {p.name for p in res.plots} >= {"accuracy_vs_bytes.png", "accuracy_vs_bytes.pdf", "task_deltas.pdf",
                                           "fidelity_vs_bytes.png", "fidelity_vs_bytes.pdf"}
    # fidelity with intervals, its arrays beside each cell, the tail decoded with the sweep's tokenizer
    assert len(list((tmp_path / "out" / "cells").glob("*.npz"))) == 3
    s = cells["snapmla"]["fidelity"]["decode"]["summary"]["kl_mean"]
    assert s["ci_low"] <= s["value"] <= s["ci_high"] and "KL mean [95% CI]" in md
    assert {"fidelity_markdown", "fidelity_tail_markdown"} <= set(res.files)
    tail = res.fidelity.tail[res.fidelity.tail["label"] == "snapmla"]
    assert len(tail) and not tail["context"].str.contains("<[0-9]+>").any() and tail["context"].str.len().max() > 0
    tab = res.table.long.set_index(["label", "task"])
    assert tab.loc[("snapmla", "sq_code_ppl"), "delta"] == 0.0
    # rerun: everything is finished, nothing is evaluated, the model is not even loaded
    again = execute(spec, show_progress=False, report=False)
    assert again.report.ran == [] and len(again.report.already_done) == 3


def test_per_task_metadata_reaches_the_task(tiny_ckpt, tmp_path):
    """lm-eval ignores simple_evaluate(metadata=...) once a TaskManager is given: ours must carry it."""
    spec = SweepSpec.from_dict({
        "name": "meta", "model": str(tiny_ckpt), "dtype": "float32", "device": "cpu", "fidelity": False,
        # 512 tokens hold no distractor keys of the task's default (the old documents: 5 digits, none)
        "tasks": [{"name": "sq_passkey", "limit": 2, "metadata": {"max_seq_lengths": [512], "num_samples": 2,
                                                                  "passkey_digits": 5, "passkey_distractors": 0},
                   "gen_kwargs": {"max_gen_toks": 4}}],
        "presets": ["bf16", "snapmla"], "bootstrap_iters": 0, "output_dir": str(tmp_path / "out")})
    res = execute(spec, show_progress=False, report=False)
    assert not res.report.failed, res.report.failed
    for p in (tmp_path / "out" / "cells").glob("*.json"):
        d = json.loads(p.read_text())
        r = d["lm_eval"]["sq_passkey"]["results"]["sq_passkey"]
        assert r["512,none"] != -1 and r["1024,none"] == -1  # only 512-token documents were built
        assert len(d["samples"]["sq_passkey"]) == 2


def test_no_progress_sweep_prints_only_our_output(tiny_ckpt, tmp_path):
    """`--no-progress`: no lm-eval log chatter and no tqdm bars (lm-eval's request loops, transformers'
    weight loading) in what the user sees; the table still prints."""
    import yaml
    from typer.testing import CliRunner

    from snapquant.cli import app

    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "quiet", "model": str(tiny_ckpt), "dtype": "float32", "device": "cpu", "batch_size": 4,
        "tasks": [{"name": "sq_code_ppl", "limit": 1},
                  {"name": "sq_code_completion", "limit": 1, "gen_kwargs": {"max_gen_toks": 2}}],
        "presets": ["bf16", "snapmla"], "bootstrap_iters": 0, "fidelity": False,
        "output_dir": str(tmp_path / "out")}))
    res = CliRunner().invoke(app, ["sweep", str(cfg), "--no-progress"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "| snapmla |" in out and "2 cells run" in out
    for chatter in ("it/s]", "s/it]", "%|", "Running loglikelihood", "Loading weights", "[Task:",
                    "Passed an already-initialized model", "model kwarg is not of type", "Custom kwargs"):
        assert chatter not in out, (chatter, out)


def test_quiet_libraries_silences_inside_and_restores_after():
    import io
    import logging

    import tqdm
    import tqdm.auto

    from snapquant.sweep.quiet import quiet_libraries

    lm_eval_logger = logging.getLogger("lm_eval")
    level = lm_eval_logger.level
    init = tqdm.std.tqdm.__init__
    with quiet_libraries():
        assert lm_eval_logger.getEffectiveLevel() == logging.ERROR
        for cls in (tqdm.tqdm, tqdm.auto.tqdm):
            buf = io.StringIO()
            assert sum(cls(range(3), file=buf, disable=False)) == 3 and buf.getvalue() == ""
    assert lm_eval_logger.level == level and tqdm.std.tqdm.__init__ is init
    buf = io.StringIO()
    list(tqdm.tqdm(range(3), file=buf))
    assert "3/3" in buf.getvalue()
