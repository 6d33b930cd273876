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
    rows = sq_utils.completion_rows(seed=5, num_samples=30)
    assert rows == sq_utils.completion_rows(seed=5, num_samples=30)
    assert rows != sq_utils.completion_rows(seed=6, num_samples=30)
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
