"""scripts/bench_eval.py --smoke: the generation benchmark's plumbing on CPU (tiny model, both paths, the
loop-vs-HF check, the eager step split, the end-to-end lm-eval mode, the merged CSV / Markdown / JSON), in
seconds."""

from __future__ import annotations

import csv
import json

import pytest

from snapquant.bench.eval_gen import (
    COLUMNS,
    E2E_PATH,
    GSM8K_UNTIL,
    capacity,
    main,
    project_cell,
    project_queue,
    split_intervals,
    v3_layers_that_fit,
)
from snapquant.bench.eval_gen import (
    _ci as eval_gen_ci,
)

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
    parts = [float(loop[k]) for k in ("eager_attention_ms", "eager_experts_ms", "eager_rest_ms")]
    assert float(loop["tokens_per_s"]) > 0 and min(parts) > 0 and loop["split_clock"] == "cpu perf_counter"
    # the parts of the hooked step against the same step unhooked (a shared CPU box: a loose bound)
    assert 0.5 < float(loop["split_sum_over_step"]) < 2.0
    assert loop["experts"] == "snapquant_grouped_mm"
    data = json.loads(out.with_suffix(".json").read_text())
    check = data["checks"][0]
    # fp32 on CPU, snapmla: the loop's fixed-shape steps compute exactly HF's decode
    assert check["token_agree"] == 1.0 and check["logits_rel_step0"] == 0.0
    assert data["env"]["git_commit"] is not None and "| tiny (2L) | snapmla | 2 | 16 | loop |" in \
        out.with_suffix(".md").read_text()
    assert main([*args[:-2], "--paths", "loop", "--budget-s", "0", "--check-tokens", "0", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))  # smoke runs start afresh: one row, skipped
    assert [(r["path"], r["status"].split(" (")[0]) for r in rows] == [("loop", "skip: budget")]


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


def test_split_intervals_tile_the_step_and_give_nested_time_to_the_innermost_region():
    marks = [("mark", "start", 0.0), ("enter", "attention", 1.0), ("exit", "attention", 4.0),
             ("enter", "experts", 5.0), ("enter", "experts", 6.0), ("exit", "experts", 8.0),
             ("exit", "experts", 9.5), ("mark", "end", 10.0)]
    parts = split_intervals(marks, lambda a, b: b - a)
    assert parts == {"rest": 1.0 + 1.0 + 0.5, "attention": 3.0, "experts": 1.0 + 2.0 + 1.5}
    assert sum(parts.values()) == 10.0  # nothing counted twice, nothing lost
    with pytest.raises(ValueError, match="does not close"):
        split_intervals([("enter", "attention", 0.0), ("exit", "experts", 1.0), ("mark", "end", 2.0)],
                        lambda a, b: b - a)


def test_eager_step_split_parts_add_up_to_the_step_on_a_tiny_model():
    import torch

    from snapquant import patch
    from snapquant.bench import eval_gen

    model = eval_gen.build_model("tiny", None, torch.float32, "cpu", 99)
    patch(model, "snapmla", backend="reference")
    split = eval_gen.eager_step_split(model, "snapmla", 2, 16, steps=5)
    parts = split["eager_attention_ms"] + split["eager_experts_ms"] + split["eager_rest_ms"]
    assert min(split["eager_attention_ms"], split["eager_experts_ms"], split["eager_rest_ms"]) > 0
    # medians of parts vs the median hooked step: equal up to the spread of the 5 steps
    assert parts == pytest.approx(split["eager_hooked_ms"], rel=0.3)
    # against the step timed without hooks: the hooks cost little (loose: a shared 2-core box)
    assert 0.5 < split["split_sum_over_step"] < 2.0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), "hooks left behind"


def test_e2e_lmeval_mode_times_generate_until_and_records_the_path(tmp_path):
    out = tmp_path / "eval"
    args = ["--smoke", "--e2e-lmeval", "--paths", "", "--presets", "snapmla", "--e2e-batches", "2",
            "--e2e-n-batches", "2", "--out", str(out)]
    assert main(args) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert [(r["path"], r["batch"], r["status"]) for r in rows] == [(E2E_PATH, "2", "ok")]
    r = rows[0]
    # 2 batches x 2 rows x 6 tokens (a random tiny model emits no stop word within 6 tokens here)
    assert r["context"] == "24" and r["batches"] == "2" and float(r["gen_tokens"]) <= 6
    assert float(r["tokens_per_s"]) > 0 and float(r["steady_tokens_per_s"]) > 0
    assert r["gen_path"].startswith("loop x2") and "steps=static" in r["gen_path"]
    assert float(r["cells_per_hour"]) == pytest.approx(3600 / float(r["cell_1319_s"]))
    assert float(r["cell_tokens_per_s"]) == pytest.approx(1319 * 6 / float(r["cell_1319_s"]))  # 6 new tokens asked
    row = json.loads(out.with_suffix(".json").read_text())["rows"][0]
    assert 0 < row["first_prefill_s"] + row["first_decode_s"] <= row["first_batch_s"] <= row["total_s"]
    md = out.with_suffix(".md").read_text()
    assert "End to end through lm-eval's `generate_until`" in md and "| tiny (2L) | snapmla | 2 | 24 |" in md
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["env"]["e2e"]["until"] == list(GSM8K_UNTIL) and data["rows"][0]["total_s"] > 0
    # HF generate through the same call: the path column says so
    assert main([*args[:-2], "--e2e-generation", "hf", "--e2e-n-batches", "1", "--out", str(out)]) == 0
    r = next(iter(csv.DictReader(out.with_suffix(".csv").open())))
    assert r["status"] == "ok" and r["gen_path"].startswith("hf x1 (generation='hf')")


def test_refill_rows_project_the_cell_per_request_not_per_batch(tmp_path):
    """With refill one generate call serves every request; projecting it as one batch of `batch` rows would
    multiply its time by ceil(1319 / batch)."""
    out = tmp_path / "eval"
    assert main(["--smoke", "--e2e-lmeval", "--paths", "", "--presets", "snapmla", "--e2e-batches", "2",
                 "--e2e-n-batches", "2", "--refill", "3", "--out", str(out)]) == 0
    rows = {r["path"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    plain, refill = rows[f"{E2E_PATH}/stop3"], rows[f"{E2E_PATH}/stop3+refill"]
    assert refill["batches"] == 1 and plain["batches"] == 2
    assert refill["cell_1319_s"] == pytest.approx(refill["total_s"] * 1319 / 4)


def test_synthetic_requests_encode_to_the_prompt_length_and_stop_words_decode():
    from snapquant.bench.eval_gen import e2e_requests, synthetic_tokenizer

    tok = synthetic_tokenizer(500)
    assert len(tok) == 500
    reqs = e2e_requests(tok, 3, 40, 7)
    assert [len(tok(r.args[0], add_special_tokens=False)["input_ids"]) for r in reqs] == [40] * 3
    assert reqs[0].args[1] == {"until": list(GSM8K_UNTIL), "do_sample": False, "temperature": 0.0, "max_gen_toks": 7}
    for word in GSM8K_UNTIL:  # each stop string is one token a model can emit
        ids = tok.encode(word, add_special_tokens=False)
        assert len(ids) == 1 and word in tok.decode([7, *ids])


def test_project_cell_and_capacity_arithmetic():
    # first batch 20 s, then ceil(1319 / 128) - 1 = 10 more at 8 s
    assert project_cell(20.0, 8.0, 128) == 100.0 and project_cell(5.0, 4.0, 2000) == 5.0
    # slot refill: 96 requests served as one queue in 16 s -> 1319 requests at the same time per request
    assert project_queue(16.0, 96) == pytest.approx(16.0 * 1319 / 96)
    rows = [{"model": "m", "preset": p, "batch": 32, "context": 32768, "path": "loop", "status": "ok",
             "tokens_per_s": t, "peak_gib": peak, "weights_gib": 30.0, "cache_gib": cache}
            for p, t, peak, cache in (("bf16", 1000.0, 70.0, 32.0), ("snapmla", 1300.0, 56.0, 18.0))]
    cap = {c["preset"]: c for c in capacity(rows, 110.0)}
    # bf16: 40 GiB / 32 = 1.25 GiB per request -> 80 / 1.25 = 64; cache only: 1 GiB, fixed 8 -> 72
    assert (cap["bf16"]["max_batch_peak"], cap["bf16"]["max_batch_cache"]) == (64, 72)
    # snapmla: 26 / 32 = 0.8125 -> 98; cache 0.5625, fixed 8 -> 128
    assert (cap["snapmla"]["max_batch_peak"], cap["snapmla"]["max_batch_cache"]) == (98, 128)
    assert cap["snapmla"]["max_batch_cache_vs_bf16"] == pytest.approx(128 / 72)
    assert cap["snapmla"]["tokens_per_s_vs_bf16"] == pytest.approx(1.3) and cap["bf16"]["tokens_per_s_vs_bf16"] == 1.0
    assert capacity(rows, None) == []
    # with per-step samples, the decode ratio gets its bootstrap interval and n; bf16's own row none
    rows[0]["step_ms_samples"] = [13.0, 13.2, 12.8, 13.1, 12.9, 13.0]
    rows[1]["step_ms_samples"] = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8]
    cap = {c["preset"]: c for c in capacity(rows, 110.0)}
    lo, hi = cap["snapmla"]["tokens_per_s_vs_bf16_lo"], cap["snapmla"]["tokens_per_s_vs_bf16_hi"]
    assert lo <= 1.3 <= hi and lo < hi and hi - lo < 0.1 and cap["snapmla"]["steps_n"] == 6
    assert cap["bf16"]["tokens_per_s_vs_bf16_lo"] is None
    med = cap["snapmla"]["median_step_ratio_vs_bf16"]
    assert med == pytest.approx(13.0 / 10.0) and lo <= med <= hi  # the point the interval is for, inside it
    assert eval_gen_ci(cap["snapmla"]) == f"{med:.3f} [{lo:.3f}, {hi:.3f}] (n = 6)"


def test_fill_cache_appends_in_chunks_and_a_longer_fill_extends_a_shorter_one(monkeypatch):
    """The fill draws and appends FILL_CHUNK tokens at a time (bounded temporaries at 128 x 32K), and the
    values of a request's first tokens do not depend on how long the fill is."""
    import torch

    from snapquant.bench import eval_gen
    from snapquant.cache import LatentCache, LatentLayer
    from snapquant.models.tiny import tiny_model

    monkeypatch.setattr(eval_gen, "FILL_CHUNK", 8)
    model = tiny_model("deepseek_v3", moe=True)
    sizes = []
    real = LatentLayer.append
    monkeypatch.setattr(LatentLayer, "append", lambda self, lat, rope, *a, **k: (sizes.append(lat.shape[1]),
                                                                                 real(self, lat, rope, *a, **k))[1])
    long = eval_gen.fill_cache(LatentCache("bf16", model), model, 2, 20)
    n_layers = len(long.latent_layers)
    assert n_layers == model.config.num_hidden_layers and sizes == [8, 8, 4] * n_layers
    short = eval_gen.fill_cache(LatentCache("bf16", model), model, 2, 8)
    assert long.get_seq_length() == 20 and short.get_seq_length() == 8
    for a, b in zip(long.latent_layers, short.latent_layers, strict=True):
        (la, ra), (lb, rb) = a.dense(torch.float32), b.dense(torch.float32)
        assert la.shape[-2] == 20 and torch.equal(la[..., :8, :], lb) and torch.equal(ra[..., :8, :], rb)
        assert not torch.equal(la[..., 8:16, :], la[..., :8, :])  # each chunk its own draw


def test_kernels_option_profiles_the_step_and_a_prefill(tmp_path):
    """--kernels adds, per loop cell, where the step's and one prefill's time goes (aten ops on CPU, CUDA
    kernels on a GPU): the heaviest names with ms per call, which add up to no more than the busy total."""
    out = tmp_path / "eval"
    assert main(["--smoke", "--presets", "snapmla", "--paths", "loop", "--check-tokens", "0", "--no-split",
                 "--kernels", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert rows and all(r["status"] == "ok" for r in rows)
    # the loop rows say which step kernels ran: on CPU neither fused norms nor the fused rotary
    assert {r["step_fusions"] for r in rows} == {"norms=torch; rotary=torch"}
    for r in rows:
        k = r["kernels"]
        for part in ("step", "prefill"):
            t = k[part]
            assert t["busy_ms"] > 0 and t["kernels"] and t["clock"] == "cpu aten self time"
            assert sum(x["ms"] for x in t["kernels"]) <= t["busy_ms"] * (1 + 1e-9)
            assert all(x["name"].startswith("aten::") for x in t["kernels"])
    md = out.with_suffix(".md").read_text()
    assert "Where the device time goes" in md and "`aten::" in md
    assert "kernels" not in out.with_suffix(".csv").read_text().splitlines()[0]
