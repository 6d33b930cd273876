"""Task documents: same seed -> same docs, new seed -> new docs, lengths fit any tokenizer."""

import pytest

from snapquant.data.corpus import load_heldout
from snapquant.data.tokenizer import build_bpe, save_hf_tokenizer
from snapquant.errors import ConfigError
from snapquant.eval.tasks import sq_utils
from snapquant.eval.tasks.sq_utils import ANSWER_RESERVE, get_tokenizer, token_counter


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A different (tiny, English-trained) tokenizer: the tasks must size docs with it too."""
    d = tmp_path_factory.mktemp("tok")
    texts = ["The quick brown fox jumps over the lazy dog. 0123456789 = {}[]()\"'_:\n"] * 50
    save_hf_tokenizer(build_bpe(texts, vocab_size=320), d)
    return str(d)


@pytest.mark.parametrize("tokenizer", [None, "other"])
def test_kv_rows(tokenizer, other_tokenizer):
    name = other_tokenizer if tokenizer == "other" else None
    a = sq_utils.kv_rows(1024, seed=1, num_samples=6, tokenizer=name)
    assert a == sq_utils.kv_rows(1024, seed=1, num_samples=6, tokenizer=name)
    b = sq_utils.kv_rows(1024, seed=2, num_samples=6, tokenizer=name)
    assert all(x["prompt"] != y["prompt"] for x, y in zip(a, b, strict=True))
    count = token_counter(get_tokenizer(name))
    for r in a:
        assert count(r["prompt"] + r["answer"]) <= 1024 - ANSWER_RESERVE
    assert next(r["depth"] for r in a) == 0.0 and len({round(r["depth"], 1) for r in a}) == 6


def test_passkey_rows_cover_lengths_and_depths():
    rows = sq_utils.passkey_rows([512, 1024], seed=3, num_samples=1)
    assert sorted((r["length"], r["depth"]) for r in rows) == sorted(
        (n, d) for n in (512, 1024) for d in sq_utils.PASSKEY_DEPTHS)
    assert rows == sq_utils.passkey_rows([512, 1024], seed=3, num_samples=1)
    assert rows != sq_utils.passkey_rows([512, 1024], seed=4, num_samples=1)
    code = sq_utils.passkey_rows([512], seed=3, num_samples=1, haystack="code")
    assert all("PASS_KEY" in r["prompt"] for r in code)
    with pytest.raises(ConfigError, match="haystack"):
        sq_utils.passkey_rows([512], haystack="essay")


def test_completion_rows_are_real_next_lines():
    files = {r["path"]: r["text"] for r in load_heldout()}
    whole_line = {"prefix": 0.0, "words": 0, "copyable": False}
    rows = sq_utils.completion_rows(seed=5, num_samples=30, **whole_line)
    assert rows == sq_utils.completion_rows(seed=5, num_samples=30, **whole_line)
    assert rows != sq_utils.completion_rows(seed=6, num_samples=30, **whole_line)
    for r in rows:
        lines = files[r["path"]].split("\n")
        assert lines[r["line"]] == r["target"]
        assert ("\n".join(lines[: r["line"]]) + "\n").endswith(r["context"])
        assert r["context"].endswith("\n") and r["target"].strip()


def test_code_ppl_docs_are_the_heldout_files():
    ds = sq_utils.code_ppl_docs()["test"]
    assert sorted(ds["text"]) == sorted(r["text"] for r in load_heldout())
    sizes = [len(t.encode()) for t in ds["text"]]
    assert sizes == sorted(sizes)  # smallest first, so --limit gives a cheap estimate


def test_scorers():
    assert sq_utils.process_exact_match({"answer": "123"}, [" 123 "])["exact_match"] == 1.0
    assert sq_utils.process_exact_match({"answer": "123"}, ["1234"])["exact_match"] == 0.0
    m = sq_utils.process_passkey({"answer": "777", "length": 1024}, [" 777"])
    assert m["exact_match"] == 1.0 and m["1024"] == 1.0 and m["2048"] == -1
    assert sq_utils.aggregate_by_length([1.0, -1, 0.0]) == 0.5
    assert sq_utils.process_code_completion({"target": "    x = 1"}, ["x = 1\nmore"])["exact_match"] == 1.0
    assert sq_utils.process_ruler({"outputs": ["ab", "CD"], "max_length": 4096}, ["x cd AB"])["4096"] == 1.0


def test_metadata_validation_names_the_key():
    with pytest.raises(ConfigError, match="max_seq_lengths"):
        sq_utils.passkey_docs(max_seq_lengths=[1000])
    with pytest.raises(ConfigError, match="num_samples"):
        sq_utils.kv_retrieval_docs(context_tokens=1024, num_samples=0)
    with pytest.raises(ConfigError, match="context_tokens"):
        sq_utils.kv_retrieval_docs()


def test_kv_knobs_reach_the_documents():
    base = sq_utils.kv_rows(1024, seed=1, num_samples=3)
    assert base == sq_utils.kv_rows(1024, seed=1, num_samples=3, digits=sq_utils.KV_DIGITS,
                                    distractors=sq_utils.KV_DISTRACTORS)
    hard = sq_utils.kv_rows(1024, seed=1, num_samples=3, digits=10, distractors=12)
    assert hard == sq_utils.kv_rows(1024, seed=1, num_samples=3, digits=10, distractors=12)
    for r in hard:
        assert len(r["answer"]) == 10 and len(r["distractor_keys"]) == 12
        assert all(f'"{k}": "' in r["prompt"] for k in r["distractor_keys"]) and r["key"] not in r["distractor_keys"]
    # Metadata names, as a sweep's per-task `metadata:` gives them.
    ds = sq_utils.kv_retrieval_docs(context_tokens=1024, num_samples=3, sq_seed=1, kv_digits=10, kv_distractors=12)
    assert ds["test"]["prompt"] == [r["prompt"] for r in hard]


@pytest.mark.parametrize(("prefix", "words"), [(0.5, 0), (0.0, 2), (0.5, 1)])
def test_completion_knobs_cut_the_target_line(prefix, words):
    files = {r["path"]: r["text"] for r in load_heldout()}
    rows = sq_utils.completion_rows(seed=5, num_samples=40, prefix=prefix, words=words)
    assert rows == sq_utils.completion_rows(seed=5, num_samples=40, prefix=prefix, words=words)
    for r in rows:
        line = files[r["path"]].split("\n")[r["line"]]
        given = r["context"][r["context"].rfind("\n") + 1:]
        # context = the file up to the line + the line's first words; target = the words after them.
        assert line.startswith(given + r["target"]) and r["target"].strip()
        assert (given.strip() != "") == (prefix > 0) and not given.endswith(" ")
        assert r["to_eol"] == (given + r["target"] == line)
        rest = line[len(given):].split()
        assert r["target"].split() == (rest[:words] if words else rest)
    assert any(not r["to_eol"] for r in rows) == (words > 0)
    ds = sq_utils.code_completion_docs(num_samples=40, sq_seed=5, completion_prefix=prefix, completion_words=words)
    assert ds["test"]["target"] == [r["target"] for r in rows]


def test_completion_defaults_and_copyable_targets():
    rows = sq_utils.completion_rows(seed=5, num_samples=30)
    assert rows == sq_utils.completion_rows(seed=5, num_samples=30, prefix=sq_utils.COMPLETION_PREFIX,
                                            words=sq_utils.COMPLETION_WORDS, copyable=sq_utils.COMPLETION_COPYABLE)
    copy = sq_utils.completion_rows(seed=5, num_samples=30, prefix=0.5, copyable=True)
    names = sq_utils.IDENTIFIER
    for r in copy:  # every name and number of the target is in the context the model sees
        assert set(names.findall(r["target"])) <= set(names.findall(r["context"])), r
    # The filter removes items (so the test could fail), drawn in the unfiltered order.
    free = sq_utils.completion_rows(seed=5, num_samples=4000, prefix=0.5, copyable=False)
    assert any(not set(names.findall(r["target"])) <= set(names.findall(r["context"])) for r in free)
    kept = [r for r in free if set(names.findall(r["target"])) <= set(names.findall(r["context"]))]
    assert [(r["path"], r["line"]) for r in kept[:30]] == [(r["path"], r["line"]) for r in copy]


def test_completion_scorer_for_word_targets():
    doc = {"target": " foo(bar,", "to_eol": False}
    assert sq_utils.process_code_completion(doc, [" foo(bar, baz)\nx"])["exact_match"] == 1.0
    assert sq_utils.process_code_completion(doc, [" foo(bar,"])["exact_match"] == 1.0
    assert sq_utils.process_code_completion(doc, [" foo(bar,baz)"])["exact_match"] == 0.0
    assert sq_utils.process_code_completion(doc, [" foo(ba"])["exact_match"] == 0.0
    # A whole-line target (old documents have no to_eol) must match the whole line.
    assert sq_utils.process_code_completion({"target": " foo(bar,"}, [" foo(bar, baz)"])["exact_match"] == 0.0


def test_knob_validation_names_the_key():
    with pytest.raises(ConfigError, match="kv_digits"):
        sq_utils.kv_retrieval_docs(context_tokens=1024, num_samples=1, kv_digits=0)
    with pytest.raises(ConfigError, match="kv_distractors"):
        sq_utils.kv_retrieval_docs(context_tokens=1024, num_samples=1, kv_distractors=-2)
    with pytest.raises(ConfigError, match="completion_prefix"):
        sq_utils.code_completion_docs(num_samples=1, completion_prefix=1.0)
    with pytest.raises(ConfigError, match="completion_words"):
        sq_utils.code_completion_docs(num_samples=1, completion_words="two")
