"""Every snapquant task runs through lm-eval on a model (the embedded one once it is trained, a tiny
random DeepSeek-V3 with the embedded tokenizer before), and the direct harness agrees with lm-eval."""

import pytest
import torch

from snapquant.embedded import TINY_ARCH, embedded_config, has_weights, load_embedded, load_tokenizer
from snapquant.eval.tasks import direct, sq_utils, task_manager

TASKS = ["sq_code_ppl", "sq_code_completion", "sq_kv_retrieval_1k", "sq_passkey", "sq_passkey_code"]
RULER = ["sq_niah_single_1", "sq_niah_multikey_2", "sq_niah_multikey_3", "sq_ruler_cwe", "sq_ruler_fwe"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    if has_weights():
        return load_embedded(dtype="float32")
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(embedded_config(TINY_ARCH, max_position_embeddings=4096)).eval()
    return model, load_tokenizer()


def _evaluate(model_and_tokenizer, tasks, limit, lengths=(1024,), **kw):
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    model, tok = model_and_tokenizer
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, max_length=4096)
    # sq_passkey's default distractor keys need >= 1K tokens; the old documents (5 digits, none) fit 512
    tm = task_manager(include_defaults=False, num_samples=3, max_seq_lengths=list(lengths), passkey_digits=5,
                      passkey_distractors=0)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=limit, bootstrap_iters=0,
                                   log_samples=True, **kw)


@pytest.fixture(scope="module")
def results(model_and_tokenizer):
    # Kept small for CPU CI: transformers re-expands the whole latent cache at every decode step.
    # 16 new tokens at most (the retrieval tasks' own limit), pass keys at 512 tokens.
    return _evaluate(model_and_tokenizer, TASKS, limit=2, lengths=(512,), gen_kwargs="max_gen_toks=16")


@pytest.mark.slow  # covered by default: both lm-eval request kinds on our tasks (test_sweep_e2e)
def test_snapquant_tasks_run_through_lm_eval(results):
    r = results["results"]
    assert set(TASKS) <= set(r)
    for name in ("sq_code_completion", "sq_kv_retrieval_1k", "sq_passkey", "sq_passkey_code"):
        assert 0.0 <= r[name]["exact_match,none"] <= 1.0
        assert len(results["samples"][name]) == 2
    assert r["sq_passkey"]["512,none"] in (0.0, 0.5, 1.0) and r["sq_passkey"]["4096,none"] == -1
    assert r["sq_code_ppl"]["bits_per_byte,none"] > 0 and r["sq_code_ppl"]["word_perplexity,none"] > 1
    # Prompts reach the model untouched (no stripping), ending where the answer starts.
    kv = results["samples"]["sq_kv_retrieval_1k"][0]
    assert kv["arguments"][0][0] == kv["doc"]["prompt"] and kv["arguments"][0][0].endswith(') == "')
    comp = results["samples"]["sq_code_completion"][0]
    assert comp["arguments"][0][0] == comp["doc"]["context"]


@pytest.mark.slow  # the direct harness serves the embedded trainer (slow too)
def test_direct_harness_agrees_with_lm_eval(results, model_and_tokenizer):
    model, tok = model_and_tokenizer
    for name, stops in (("sq_kv_retrieval_1k", ['"', "\n"]), ("sq_passkey", ["\n", "."])):
        samples = results["samples"][name]
        prompts = [s["doc"]["prompt"] for s in samples]
        ours = direct.greedy_generate(model, tok, prompts, sq_utils.ANSWER_RESERVE, stops, batch_size=2)
        assert ours == [s["resps"][0][0] for s in samples], name
    texts = [s["doc"]["text"] for s in results["samples"]["sq_code_ppl"]]
    ppl = direct.score_code_ppl(model, tok, max_length=4096, texts=texts)
    assert ppl["bits_per_byte"] == pytest.approx(results["results"]["sq_code_ppl"]["bits_per_byte,none"], rel=1e-4)


@pytest.mark.slow  # covered by default: the RULER documents (test_ruler_docs_are_deterministic)
def test_ruler_subset_runs_offline_with_local_tokenizer(model_and_tokenizer):
    res = _evaluate(model_and_tokenizer, RULER, limit=1, gen_kwargs="max_gen_toks=2")
    for name in RULER:
        assert 0.0 <= res["results"][name]["1024,none"] <= 1.0, name
        assert res["samples"][name][0]["doc"]["max_length"] == 1024


def test_ruler_docs_are_deterministic():
    a = sq_utils.ruler_niah_single_1(max_seq_lengths=[1024])["test"]
    b = sq_utils.ruler_niah_single_1(max_seq_lengths=[1024])["test"]
    c = sq_utils.ruler_niah_single_1(max_seq_lengths=[1024], sq_seed=7)["test"]
    assert a[:5] == b[:5] and a[:5] != c[:5] and len(a) == 500
    count = sq_utils.token_counter(sq_utils.get_tokenizer(None))
    assert all(count(x["input"]) <= 1024 for x in a.select(range(5)))


def test_difficulty_knobs_reach_lm_eval_documents():
    """Metadata given to the task manager builds the same documents as the sq_utils builders."""
    tm = task_manager(include_defaults=False, num_samples=2, kv_digits=11, kv_distractors=5,
                      completion_prefix=0.5, completion_words=1, completion_copyable=True)
    tasks = tm.load(["sq_kv_retrieval_1k", "sq_code_completion"])["tasks"]
    kv = list(tasks["sq_kv_retrieval_1k"].test_docs())
    assert [d["prompt"] for d in kv] == [r["prompt"] for r in sq_utils.kv_rows(1024, num_samples=2, digits=11,
                                                                              distractors=5)]
    assert all(len(d["answer"]) == 11 and len(d["distractor_keys"]) == 5 for d in kv)
    comp = list(tasks["sq_code_completion"].test_docs())
    assert [d["target"] for d in comp] == [r["target"] for r in sq_utils.completion_rows(
        num_samples=2, prefix=0.5, words=1, copyable=True)]


@pytest.mark.slow  # covered by default: test_difficulty_knobs_reach_lm_eval_documents (the documents) and
# test_tasks_docs.py::test_completion_scorer_for_word_targets (the scorer lm-eval calls)
def test_word_targets_score_the_same_in_lm_eval_and_direct(model_and_tokenizer):
    """A knob-built completion task through lm-eval gives the direct harness's generations and scores."""
    model, tok = model_and_tokenizer
    knobs = {"completion_prefix": 0.5, "completion_words": 1}
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, max_length=4096)
    res = lm_eval.simple_evaluate(model=lm, tasks=["sq_code_completion"], limit=3, bootstrap_iters=0,
                                  log_samples=True, gen_kwargs="max_gen_toks=6",
                                  task_manager=task_manager(include_defaults=False, **knobs))
    samples = res["samples"]["sq_code_completion"]
    prompts = [s["doc"]["context"] for s in samples]
    ours = direct.greedy_generate(model, tok, prompts, 6, ["\n"], batch_size=2)
    assert ours == [s["resps"][0][0] for s in samples]
    assert [sq_utils.process_code_completion(s["doc"], [g])["exact_match"] for s, g in zip(samples, ours, strict=True)
            ] == [s["exact_match"] for s in samples]
