"""Offline lm-eval on a patched tiny model: a local JSONL task with a generation request and one with
likelihood requests, through `snapquant.eval.SnapquantLM` and `lm_eval.simple_evaluate`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

from snapquant import PRESETS
from snapquant.models.tiny import tiny_model
from tests.support.tokenizers import char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _tasks(path):
    data = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}}, "test_split": "test"}
    gen = {"task": "snapquant_tiny_gen", **data, "output_type": "generate_until",
           "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
           "metric_list": [{"metric": "exact_match"}]}
    mc = {"task": "snapquant_tiny_mc", **data, "output_type": "multiple_choice",
          "doc_to_text": "{{question}}", "doc_to_target": "{{label}}", "doc_to_choice": "{{choices}}",
          "metric_list": [{"metric": "acc"}]}
    return [gen, mc]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("lmeval") / "tiny.jsonl"
    rows = [{"question": f"Q{i}: 2+{i}=", "answer": str(2 + i), "choices": [str(2 + i), str(3 + i)], "label": 0}
            for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _evaluate(model, tok, config, task_file):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from snapquant.eval import SnapquantLM

    lm = SnapquantLM(pretrained=model, tokenizer=tok, kv_config=config, batch_size=2, device="cpu")
    # include_defaults=False: indexing lm-eval's thousands of built-in task YAMLs takes most of a minute
    out = lm_eval.simple_evaluate(model=lm, tasks=_tasks(task_file), limit=4, bootstrap_iters=0,
                                  log_samples=True, task_manager=TaskManager(include_defaults=False))
    return lm, out


def test_simple_evaluate_on_a_patched_model_records_the_preset(task_file):
    tok = char_tokenizer()
    model = tiny_model("deepseek_v3", vocab_size=128)
    lm, out = _evaluate(model, tok, "snapmla", task_file)
    assert out["config"]["snapquant_preset"] == "snapmla"
    assert out["config"]["snapquant_config"]["nope_dtype"] == "fp8_e4m3"
    assert "exact_match,none" in out["results"]["snapquant_tiny_gen"]
    assert "acc,none" in out["results"]["snapquant_tiny_mc"]
    assert len(out["samples"]["snapquant_tiny_gen"]) == 4 and len(out["samples"]["snapquant_tiny_mc"]) == 4
    assert "_snapquant_patch" in lm.model.__dict__


def test_generation_reads_the_quantized_cache_and_likelihood_sees_quantized_prefill(monkeypatch):
    """generate_until goes through a LatentCache; loglikelihoods change only with prefill: quantized."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from snapquant.cache import LatentCache
    from snapquant.eval import SnapquantLM

    tok = char_tokenizer()
    seen = []
    original = HFLM._model_generate

    def spy(self, context, max_length, stop, **kw):
        seen.append(kw.get(self._cache_kwarg))
        return original(self, context, max_length, stop, **kw)

    monkeypatch.setattr(HFLM, "_model_generate", spy)
    ll_reqs = [Instance("loglikelihood", {}, (f"Q{i}: 2+{i}=", str(2 + i)), i) for i in range(4)]
    gen_reqs = [Instance("generate_until", {}, (f"Q{i}: 2+{i}=", {"until": ["\n"], "max_gen_toks": 5}), i)
                for i in range(2)]
    lls = {}
    for name, cfg in [("bf16", PRESETS["bf16"]), ("snapmla", PRESETS["snapmla"]),
                      ("snapmla_q", PRESETS["snapmla"].replace(prefill="quantized"))]:
        lm = SnapquantLM(pretrained=tiny_model("deepseek_v3", vocab_size=128), tokenizer=tok, kv_config=cfg,
                         batch_size=2, device="cpu")
        lls[name] = [ll for ll, _ in lm.loglikelihood(ll_reqs)]
        texts = lm.generate_until(gen_reqs)
        assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert len(seen) == 3 * 1 and all(isinstance(c, LatentCache) and c.nbytes() > 0 for c in seen)
    assert lls["bf16"] == pytest.approx(lls["snapmla"], abs=1e-5)  # bf16 prefill: likelihoods unchanged
    assert max(abs(a - b) for a, b in zip(lls["bf16"], lls["snapmla_q"], strict=True)) > 1e-4


def test_generation_loop_and_hf_give_the_same_lm_eval_results(task_file, caplog):
    """generate_until through the decode loop (eager and fixed-shape steps) and through HF generate: the same
    strings for ragged prompts, several stop strings and max_gen_toks; the same task results; each batch's
    path recorded in the results config; a request the loop cannot reproduce goes to HF with one warning."""
    import copy
    import logging

    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from snapquant.eval import SnapquantLM

    tok = char_tokenizer()
    base = tiny_model("deepseek_v3", moe=True, vocab_size=128)
    reqs = [Instance("generate_until", {}, (f"Q{i}: {'x' * i}2+{i}=", kw), i) for i, kw in enumerate(
        [{"until": ["\n"], "max_gen_toks": 6}, {"until": ["\n", "=", "a"], "max_gen_toks": 9},
         {"until": ["Q"], "max_gen_toks": 4, "do_sample": False}, {"until": ["\n"], "max_gen_toks": 6},
         {"until": ["\n"], "max_gen_toks": 5, "num_beams": 2}])]
    texts, results, infos = {}, {}, {}
    for path, steps in (("hf", "auto"), ("loop", "eager"), ("loop", "static")):
        lm = SnapquantLM(pretrained=copy.deepcopy(base), tokenizer=tok, kv_config="snapmla", batch_size=2,
                         device="cpu", generation=path, gen_batch_size=3, gen_steps=steps, gen_check_every=2)
        with caplog.at_level(logging.WARNING, logger="snapquant.eval.lm"):
            caplog.clear()
            texts[path, steps] = lm.generate_until(reqs)
        warned = [r for r in caplog.records if "HF generate for these requests" in r.getMessage()]
        assert len(warned) == (path == "loop") and (not warned or "num_beams=2" in warned[0].getMessage())
        if steps == "eager":  # generate_until above already compared the eager loop
            continue
        out = lm_eval.simple_evaluate(model=lm, tasks=_tasks(task_file)[:1], limit=4, bootstrap_iters=0,
                                      log_samples=True, task_manager=TaskManager(include_defaults=False))
        results[path, steps] = ([s["resps"] for s in out["samples"]["snapquant_tiny_gen"]],
                                out["results"]["snapquant_tiny_gen"]["exact_match,none"])
        infos[path, steps] = out["config"]["snapquant_generation"]
    assert texts["loop", "eager"] == texts["hf", "auto"] == texts["loop", "static"]
    assert any(texts["hf", "auto"]) and len(set(texts["hf", "auto"])) > 1  # real, differing generations
    assert results["hf", "auto"] == results["loop", "static"]
    hf, loop = infos["hf", "auto"], infos["loop", "static"]
    assert hf["default_path"] == "hf" and loop["default_path"] == "loop" and loop["steps"] == "static"
    paths = {(b["path"], b["reason"]): b["count"] for b in loop["batches"]}
    assert paths["loop", "generation='loop'"] >= 3 and any(p == "hf" and "num_beams" in r for p, r in paths)


def test_generation_auto_is_hf_on_cpu_and_bad_options_fail_before_loading():
    from snapquant.errors import ConfigError
    from snapquant.eval import SnapquantLM

    lm = SnapquantLM(pretrained=tiny_model("deepseek_v3", vocab_size=128), tokenizer=char_tokenizer(),
                     kv_config="snapmla", batch_size=2, device="cpu")
    info = lm.get_model_info()["snapquant_generation"]
    assert info["requested"] == "auto" and info["default_path"] == "hf" and "cpu" in info["default_reason"]
    for kw, field in (({"generation": "fast"}, "generation"), ({"gen_steps": "x"}, "gen_steps"),
                      ({"gen_batch_size": "0"}, "gen_batch_size"), ({"gen_check_every": 1.5}, "gen_check_every")):
        with pytest.raises(ConfigError, match=f"^{field} must be"):
            SnapquantLM(pretrained="/nonexistent/checkpoint", **kw)


def test_auto_on_a_cpu_model_takes_hf_generate_without_a_warning(caplog):
    """The CPU default is not a fallback: the main job on CPU prints no generation warning (the path is
    recorded in the results config instead)."""
    import logging

    from lm_eval.api.instance import Instance

    from snapquant.eval import SnapquantLM

    lm = SnapquantLM(pretrained=tiny_model("deepseek_v3", vocab_size=128), tokenizer=char_tokenizer(),
                     kv_config="snapmla", batch_size=1, device="cpu")
    with caplog.at_level(logging.WARNING, logger="snapquant.eval.lm"):
        lm.generate_until([Instance("generate_until", {}, ("Q: 2+2=", {"until": ["\n"], "max_gen_toks": 3}), 0)])
    assert not [r for r in caplog.records if "HF generate" in r.getMessage()]
    assert lm.get_model_info()["snapquant_generation"]["default_path"] == "hf"
