"""Training rows: right length, both kinds, deterministic per (seed, stream), synthetic docs packed."""

import numpy as np
import pytest

from snapquant.data.corpus import load_heldout
from snapquant.data.mixture import KIND_CODE, KIND_SYNTH, MixtureSpec, RowBuilder
from snapquant.data.tokenizer import EOS_TOKEN, load_fast_tokenizer
from snapquant.embedded import EMBEDDED_PATH
from snapquant.errors import ConfigError


@pytest.fixture(scope="module")
def corpus():
    tok = load_fast_tokenizer(EMBEDDED_PATH)
    # Any real code will do as the "corpus" here; the held-out text is at hand.
    ids = [i for r in load_heldout()[:4] for i in [*tok.encode(r["text"]).ids, tok.token_to_id(EOS_TOKEN)]]
    return np.asarray(ids, dtype=np.uint16), tok


def _rows(corpus, seed, stream, n=8):
    tokens, tok = corpus
    spec = MixtureSpec(seq_len=512, synthetic_fraction=0.5)
    b = RowBuilder(tokens, tok, tok.token_to_id(EOS_TOKEN), spec, seed, stream)
    return [b.row() for _ in range(n)]


def test_rows_shape_kinds_and_determinism(corpus):
    rows = _rows(corpus, 0, 0)
    assert all(r.shape == (513,) and r.dtype == np.int64 for r, _ in rows)
    assert {k for _, k in rows} == {KIND_CODE, KIND_SYNTH}
    again = _rows(corpus, 0, 0)
    assert all(np.array_equal(a, b) and ka == kb for (a, ka), (b, kb) in zip(rows, again, strict=True))
    other = _rows(corpus, 0, 1)
    assert not all(np.array_equal(a, b) for (a, _), (b, _) in zip(rows, other, strict=True))


def test_synthetic_rows_hold_retrieval_documents(corpus):
    _, tok = corpus
    texts = [tok.decode(r.tolist(), skip_special_tokens=False) for r, k in _rows(corpus, 3, 0, 24) if k == KIND_SYNTH]
    assert texts
    joined = "".join(texts)
    assert "assert " in joined and ("pass key" in joined or "PASS_KEY" in joined)
    assert all(t.count(EOS_TOKEN) >= 1 for t in texts)  # documents are EOS-separated


def test_spec_validation_names_the_field():
    with pytest.raises(ConfigError, match="synthetic_fraction"):
        MixtureSpec(synthetic_fraction=1.5)
    with pytest.raises(ConfigError, match="seq_len"):
        MixtureSpec(seq_len=16)
