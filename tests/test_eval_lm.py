"""Offline lm-eval on a patched tiny model: a local JSONL task with a generation request and one with
likelihood requests, through `snapquant.eval.SnapquantLM` and `lm_eval.simple_evaluate`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

from snapquant import PRESETS
from snapquant.models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _char_tokenizer():
    """A character-level fast tokenizer built offline (ids 0-3 special, printable ASCII after)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


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
    tok = _char_tokenizer()
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

    tok = _char_tokenizer()
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
