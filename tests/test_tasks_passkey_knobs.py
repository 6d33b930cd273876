"""Pass-key difficulty knobs (`passkey_digits`, `passkey_distractors`): validation, determinism, the
near-miss distractors, lm-eval metadata, and calibration settings."""

from __future__ import annotations

import pytest

from snapquant.errors import ConfigError
from snapquant.eval import calibration
from snapquant.eval.calibration import Setting, parse_setting
from snapquant.eval.tasks import direct, sq_utils, task_manager
from snapquant.eval.tasks.sq_utils import ANSWER_RESERVE, get_tokenizer, token_counter


@pytest.mark.parametrize("haystack", ["repeat", "code"])
def test_distractors_are_labelled_near_misses_and_seeded(haystack):
    kw = {"haystack": haystack, "digits": 7, "distractors": 4}
    rows = sq_utils.passkey_rows([1024], seed=3, num_samples=2, **kw)
    assert rows == sq_utils.passkey_rows([1024], seed=3, num_samples=2, **kw)
    assert [r["prompt"] for r in rows] != [r["prompt"] for r in sq_utils.passkey_rows([1024], seed=4, num_samples=2,
                                                                                         **kw)]
    count = token_counter(get_tokenizer(None))
    for r in rows:
        key, decoys, p = r["answer"], r["distractor_keys"], r["prompt"]
        assert len(decoys) == 4 and len(set(decoys)) == 4 and key not in decoys
        for d in decoys:  # same length, exactly one digit changed, labelled as expired, once
            assert len(d) == len(key) and d[0] != "0" and sum(a != b for a, b in zip(d, key, strict=True)) == 1
            label = f"OLD_PASS_KEY = {d}  #" if haystack == "code" else f"The old pass key was {d}."
            assert p.count(d) == 1 and label in p
        needle = f"PASS_KEY = {key}  #" if haystack == "code" else f"The pass key is {key}."
        assert p.count(needle) == 1
        assert count(p + " " + key) <= 1024 - ANSWER_RESERVE
    assert sorted({r["depth"] for r in rows}) == sorted(sq_utils.PASSKEY_DEPTHS)  # the needle's depths are kept


def test_no_distractors_is_the_default_document():
    plain = sq_utils.passkey_rows([512], seed=3, num_samples=1)
    assert plain == sq_utils.passkey_rows([512], seed=3, num_samples=1, distractors=0)
    assert all(r["distractor_keys"] == [] and "old pass key" not in r["prompt"] for r in plain)
    # the key and filler of a document do not depend on the distractors drawn after them
    more = sq_utils.passkey_rows([512], seed=3, num_samples=1, distractors=2)
    assert [r["answer"] for r in more] == [r["answer"] for r in plain]


def test_knob_validation_is_one_line_naming_the_knob():
    bad = [({"passkey_digits": 0}, "passkey_digits"), ({"passkey_digits": 21}, "passkey_digits"),
           ({"passkey_digits": "5"}, "passkey_digits"), ({"passkey_digits": True}, "passkey_digits"),
           ({"passkey_distractors": -1}, "passkey_distractors"), ({"passkey_distractors": 1.5}, "passkey_distractors"),
           ({"passkey_distractors": True}, "passkey_distractors"),
           ({"passkey_digits": 2, "passkey_distractors": 18}, "passkey_distractors"),  # 17 near misses of 2 digits
           ({"max_seq_lengths": 1000}, "max_seq_lengths")]
    for knobs, key in bad:
        with pytest.raises(ConfigError, match=key) as e:
            sq_utils.passkey_docs(num_samples=1, **{"max_seq_lengths": [512], **knobs})
        assert "\n" not in str(e.value)
        for task in ("sq_passkey", "sq_passkey_code"):
            with pytest.raises(ConfigError, match=key) as e:
                calibration.build(Setting(task, knobs), 1)
            assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="kv_digits"):  # not a pass-key knob
        calibration.build(Setting("sq_passkey", {"kv_digits": 3}), 1)
    assert sq_utils.passkey_knobs({"passkey_digits": 2, "passkey_distractors": 17}) == {"digits": 2, "distractors": 17}


def test_metadata_knobs_reach_the_lm_eval_documents():
    tm = task_manager(include_defaults=False, num_samples=1, max_seq_lengths=[512], passkey_digits=8,
                      passkey_distractors=3)
    docs = list(tm.load(["sq_passkey_code"])["tasks"]["sq_passkey_code"].test_docs())
    rows = sq_utils.passkey_rows([512], num_samples=1, haystack="code", digits=8, distractors=3)
    assert [d["prompt"] for d in docs] == [r["prompt"] for r in rows]
    assert all(len(d["answer"]) == 8 and len(d["distractor_keys"]) == 3 for d in docs)


def test_calibration_setting_builds_and_scores(monkeypatch):
    s = parse_setting("sq_passkey:max_seq_lengths=1024,passkey_distractors=2")
    assert s.label() == "max_seq_lengths=1024,passkey_digits=5,passkey_distractors=2"
    assert parse_setting("sq_passkey_code").label() == (
        "max_seq_lengths=1024+2048+4096,passkey_digits=5,passkey_distractors=0")
    prompts, docs, _, max_new, stops = calibration.build(s, 7)
    assert len(docs) == 7 and {d["length"] for d in docs} == {1024} and max_new == ANSWER_RESERVE
    assert prompts == [d["prompt"] for d in docs] and stops == ["\n", "."]  # the YAML's generation_kwargs
    assert docs == sq_utils.passkey_rows([1024], num_samples=2, distractors=2)[:7]  # the first n, as lm-eval's --limit
    assert calibration.build(s, 7)[1] == docs

    def answer(pick):
        def gen(model, tok, ps, max_new_tokens, stops, batch_size=16):
            by_prompt = {d["prompt"]: d for d in docs}
            return [pick(by_prompt[p]) + "." for p in ps]
        return gen

    monkeypatch.setattr(direct, "greedy_generate", answer(lambda d: d["answer"]))
    assert calibration.score(None, None, s, 7) == [1.0] * 7
    monkeypatch.setattr(direct, "greedy_generate", answer(lambda d: d["distractor_keys"][0]))
    assert calibration.score(None, None, s, 7) == [0.0] * 7


def test_yaml_defaults_and_a_budget_too_small_for_the_distractors():
    tm = task_manager(include_defaults=False, num_samples=1, max_seq_lengths=[1024])
    plain = list(tm.load(["sq_passkey_code"])["tasks"]["sq_passkey_code"].test_docs())
    hard = list(tm.load(["sq_passkey"])["tasks"]["sq_passkey"].test_docs())
    assert all(len(d["answer"]) == 20 and len(d["distractor_keys"]) == 32 for d in hard)  # sq_passkey.yaml
    assert all(len(d["answer"]) == 5 and not d["distractor_keys"] for d in plain)  # its own metadata block
    with pytest.raises(ConfigError, match="passkey_distractors") as e:
        sq_utils.passkey_rows([512], num_samples=1, digits=20, distractors=32)
    assert "\n" not in str(e.value)
