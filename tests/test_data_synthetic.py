"""Synthetic retrieval documents: deterministic, sized in tokens, answers correct, train/eval disjoint."""

import re

import pytest

from snapquant.data.synthetic import (
    PASSKEY_QUESTION,
    kv_retrieval_example,
    kv_training_document,
    near_miss_keys,
    passkey_example,
    passkey_training_document,
    seed_rng,
)
from snapquant.embedded import load_tokenizer
from snapquant.errors import ConfigError

ENTRY = re.compile(r'^    "(\w+)": "(\d+)",$', re.M)
# Every line of a key-value document, training or evaluation, is one of these.
KV_LINE = re.compile(
    r'^(""".*"""|[A-Z]+ = \{|    "\w+": "\d+",|\}|def \w+\(name\):|    return [A-Z]+\[name\]|'
    r'assert \w+\("\w+"\) == "\d*"?|)$')


@pytest.fixture(scope="module")
def count():
    tok = load_tokenizer()
    return lambda s: len(tok(s, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("length", [256, 1024, 2048])
def test_kv_example_deterministic_and_sized(count, length):
    a = kv_retrieval_example(seed_rng("eval", "t", length), length, count, depth=0.3)
    b = kv_retrieval_example(seed_rng("eval", "t", length), length, count, depth=0.3)
    c = kv_retrieval_example(seed_rng("eval", "u", length), length, count, depth=0.3)
    assert a == b
    assert c["prompt"] != a["prompt"]
    n = count(a["prompt"] + a["answer"] + '"')
    assert 0.85 * length <= n <= length


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_kv_answer_is_the_queried_entry_at_depth(count, depth):
    ex = kv_retrieval_example(seed_rng("eval", "ans", depth), 1024, count, depth=depth)
    table = ENTRY.findall(ex["prompt"])
    keys = [k for k, _ in table]
    assert len(set(keys)) == len(keys) == ex["n_entries"]
    assert dict(table)[ex["key"]] == ex["answer"]
    assert keys.index(ex["key"]) == round(depth * (len(keys) - 1))
    assert ex["prompt"].endswith(f'("{ex["key"]}") == "')
    # The completed document is a valid program whose asserts (shots and question) all hold.
    exec(compile(ex["prompt"] + ex["answer"] + '"\n', "<kv>", "exec"), {})


def test_kv_training_document_is_a_correct_program_of_the_same_format(count):
    for i in range(5):
        doc = kv_training_document(seed_rng("train", "fmt", i), 600, count)
        exec(compile(doc, "<kv-train>", "exec"), {})
        assert doc.count("assert ") >= 1
        assert all(KV_LINE.match(line) for line in doc.split("\n")), doc
    ex = kv_retrieval_example(seed_rng("eval", "fmt"), 600, count)
    assert all(KV_LINE.match(line) for line in ex["prompt"].split("\n"))


def test_train_and_eval_instances_are_disjoint(count):
    train_pairs, eval_pairs = set(), set()
    for i in range(40):
        train_pairs |= set(ENTRY.findall(kv_training_document(seed_rng("train", 0, i), 512, count)))
        eval_pairs |= set(ENTRY.findall(kv_retrieval_example(seed_rng("eval", 0, i), 512, count)["prompt"]))
    assert len(train_pairs) > 500 and len(eval_pairs) > 500
    assert not train_pairs & eval_pairs
    assert seed_rng("train", 1).random() != seed_rng("eval", 1).random()
    with pytest.raises(ConfigError, match="namespace"):
        seed_rng("test", 1)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_classic(count, depth):
    ex = passkey_example(seed_rng("eval", "pk", depth), 1024, count, depth=depth)
    p = ex["prompt"]
    assert p.endswith(PASSKEY_QUESTION) and not p.endswith(" ")
    assert p.count(f"The pass key is {ex['answer']}.") == 1
    assert 0.85 * 1024 <= count(p + " " + ex["answer"]) <= 1024
    at = p.index("The pass key is") / len(p)
    assert abs(at - depth) < 0.1
    assert passkey_example(seed_rng("eval", "pk", depth), 1024, count, depth=depth) == ex


def test_passkey_code_haystack(count):
    lines = [f"x_{i} = {i} * 2\n" for i in range(2000)]
    ex = passkey_example(seed_rng("eval", "pkc"), 512, count, depth=0.5, haystack=lines)
    assert f"PASS_KEY = {ex['answer']}  #" in ex["prompt"]
    assert ex["prompt"].endswith("assert PASS_KEY ==")
    assert count(ex["prompt"] + " " + ex["answer"]) <= 512
    doc = passkey_training_document(seed_rng("train", "pkc"), 512, count, haystack=lines)
    key = re.search(r"PASS_KEY = (\d+)", doc).group(1)
    assert doc.endswith(f"assert PASS_KEY == {key}\n")


def test_bad_arguments_name_the_field(count):
    with pytest.raises(ConfigError, match="depth"):
        kv_retrieval_example(seed_rng("eval", 0), 512, count, depth=1.5)
    with pytest.raises(ConfigError, match="target_tokens"):
        passkey_example(seed_rng("eval", 0), 10, count, depth=0.5)
    with pytest.raises(ConfigError, match="haystack"):
        passkey_example(seed_rng("eval", 0), 512, count, depth=0.5, haystack=[])


@pytest.mark.parametrize("target", [200, 900, 3000])
def test_training_documents_fit_their_budget(count, target):
    for i in range(4):
        rng = seed_rng("train", "fit", target, i)
        doc = kv_training_document(rng, target, count, n_queries=24)
        assert count(doc) <= target and 1 <= doc.count("assert ") <= 24
        assert doc.count("assert ") == 24 or target < 1000
        assert count(passkey_training_document(seed_rng("train", "pfit", target, i), target, count)) <= target


def test_near_miss_keys_share_one_word_or_swap():
    keys = near_miss_keys("amber_fox", seed_rng("eval", "near"))
    assert "amber_fox" not in keys and len(keys) == len(set(keys))
    assert "fox_amber" in keys[:5]  # the swapped key comes early, so a few distractors include it
    for k in keys:
        a, b = k.split("_")
        assert (a == "amber") != (b == "fox") or (a, b) == ("fox", "amber"), k
    assert keys == near_miss_keys("amber_fox", seed_rng("eval", "near"))


@pytest.mark.parametrize("distractors", [0, 5, 1000])
def test_kv_distractors_are_near_misses_in_the_table(count, distractors):
    ex = kv_retrieval_example(seed_rng("eval", "dist"), 1024, count, depth=0.5, distractors=distractors)
    again = kv_retrieval_example(seed_rng("eval", "dist"), 1024, count, depth=0.5, distractors=distractors)
    assert ex == again
    table = ENTRY.findall(ex["prompt"])
    keys = [k for k, _ in table]
    assert len(set(keys)) == len(keys) == ex["n_entries"]
    # 1000 asks for more than the table holds: every other entry becomes a near miss.
    assert len(ex["distractor_keys"]) == min(distractors, ex["n_entries"] - 1)
    a, b = ex["key"].split("_")
    for k in ex["distractor_keys"]:
        assert k in keys and k != ex["key"]
        x, y = k.split("_")
        assert (x == a) != (y == b) or (x, y) == (b, a), k
    assert dict(table)[ex["key"]] == ex["answer"]
    # The shots never ask a distractor, and the completed program still holds.
    shots = re.findall(r'^assert \w+\("(\w+)"\) == "\d+"$', ex["prompt"], re.M)
    assert len(shots) == 2 and (distractors == 1000 or not set(shots) & set(ex["distractor_keys"]))
    exec(compile(ex["prompt"] + ex["answer"] + '"\n', "<kv>", "exec"), {})


def test_kv_digits_set_the_value_length(count):
    for digits in (5, 9, 12):
        ex = kv_retrieval_example(seed_rng("eval", "dig"), 1024, count, depth=0.2, digits=digits)
        assert all(len(v) == digits for _, v in ENTRY.findall(ex["prompt"])) and len(ex["answer"]) == digits
        assert count(ex["prompt"] + ex["answer"] + '"') <= 1024
    with pytest.raises(ConfigError, match="distractors"):
        kv_retrieval_example(seed_rng("eval", "dig"), 1024, count, distractors=-1)
    with pytest.raises(ConfigError, match="digits"):
        kv_retrieval_example(seed_rng("eval", "dig"), 1024, count, digits=0)
