"""scripts/bench_eval.py --smoke: the generation benchmark's plumbing on CPU (tiny model, both paths, the
loop-vs-HF check, the step split, the merged CSV / Markdown / JSON), in seconds."""

from __future__ import annotations

import csv
import json

import pytest

from snapquant.bench.eval_gen import COLUMNS, main, v3_layers_that_fit

pytestmark = pytest.mark.usefixtures("one_thread")


def test_smoke_run_writes_checked_rows_for_both_paths_and_merges_reruns(tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["--smoke", "--presets", "snapmla", "--batches", "2", "--contexts", "16", "--new-tokens", "4",
            "--check-tokens", "3", "--out", str(out)]
    assert main(args) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert tuple(rows[0]) == COLUMNS
    assert {(r["path"], r["status"]) for r in rows} == {("hf", "ok"), ("loop", "ok")}
    loop = next(r for r in rows if r["path"] == "loop")
    assert float(loop["tokens_per_s"]) > 0 and float(loop["attention_ms"]) > 0 and float(loop["experts_ms"]) > 0
    assert float(loop["attention_ms"]) + float(loop["experts_ms"]) <= float(loop["kernel_ms"]) * 1.001
    assert loop["experts"] == "snapquant_grouped_mm"
    data = json.loads(out.with_suffix(".json").read_text())
    check = data["checks"][0]
    # fp32 on CPU, snapmla: the loop's fixed-shape steps compute exactly HF's decode
    assert check["token_agree"] == 1.0 and check["logits_rel_step0"] == 0.0
    assert data["env"]["git_commit"] is not None and "| tiny (2L) | snapmla | 2 | 16 | loop |" in \
        out.with_suffix(".md").read_text()
    assert main([*args[:-2], "--paths", "loop", "--budget-s", "0", "--check-tokens", "0", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))  # smoke runs start afresh: one row, skipped
    assert [(r["path"], r["status"]) for r in rows] == [("loop", "skip: budget")]


def test_bad_options_fail_in_one_line_before_any_model(capsys):
    assert main(["--models", "v4"]) == 2
    assert "--models: unknown model shape 'v4'" in capsys.readouterr().err
    assert main(["--presets", "nonesuch"]) == 2


def test_v3_layers_that_fit_an_h200():
    # a V3 MoE layer: (257 experts x 3 x 7168 x 2048 + attention 187M) x 2 B = 21.8 GiB; 139 GiB free, 40
    # reserved, 0.9 GiB of embeddings and a 1.1 GiB dense layer leave 97 GiB: 4 MoE layers + the dense one
    assert v3_layers_that_fit(139 * 2**30, 32768) == 5
    assert v3_layers_that_fit(60 * 2**30, 32768) == 2  # never fewer than one MoE layer


def test_hf_path_passes_the_cache_under_the_forward_keyword(monkeypatch):
    # transformers 5.1x forwards take `past_key_values`, 5.2x `cache`; generate rejects the other one.
    import torch

    from snapquant.bench import eval_gen

    model = eval_gen.build_model("tiny", None, torch.float32, "cpu", 256)
    seen = {}

    class Stop(Exception):
        pass

    def fake_generate(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(model, "generate", fake_generate)
    for keyword in ("past_key_values", "cache"):
        monkeypatch.setattr(eval_gen, "cache_kwarg", lambda m, k=keyword: k)
        seen.clear()
        with pytest.raises(Stop):
            eval_gen.run_cell(model, "snapmla", 2, 8, "hf", 3, "auto")
        other = {"past_key_values", "cache"} - {keyword}
        assert keyword in seen and not other & set(seen), sorted(seen)
