"""The shipped tokenizer: loads offline, round-trips, and keeps line breaks as token boundaries."""

import pytest

from snapquant.data.tokenizer import EOS_TOKEN, PAD_TOKEN, build_bpe, load_fast_tokenizer, save_hf_tokenizer
from snapquant.embedded import EMBEDDED_PATH, load_tokenizer

SAMPLES = [
    'def f(x):\n    return {"a": 1, "b": [2, 3]}\n\n\nclass A:\n\tpass\n',
    "assert lookup(\"amber_falcon\") == \"4821930\"\n",
    "The pass key is 71432. Remember it.\nWhat is the pass key? The pass key is 71432.",
    "unicode: é ü 中文 🙂\r\n  trailing   \n",
]


def test_shipped_tokenizer_roundtrips_and_has_specials():
    tok = load_tokenizer()
    assert len(tok) == 8192
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.eos_token_id != tok.pad_token_id
    for s in SAMPLES:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == s
        assert tok.eos_token_id not in ids


@pytest.mark.parametrize("split", [(SAMPLES[0], 9), (SAMPLES[1], 5), (SAMPLES[2], 20)])
def test_newline_is_a_token_boundary(split):
    """Prompts that end at a line break tokenize exactly as the same text does inside a document."""
    text, cut = split
    cut = text.index("\n", cut) + 1
    fast = load_fast_tokenizer(EMBEDDED_PATH)

    def enc(s):
        return fast.encode(s, add_special_tokens=False).ids

    assert enc(text) == enc(text[:cut]) + enc(text[cut:])


def test_build_bpe_is_deterministic(tmp_path):
    texts = SAMPLES * 20
    a, b = build_bpe(texts, vocab_size=300), build_bpe(texts, vocab_size=300)
    assert a.to_str() == b.to_str()
    save_hf_tokenizer(a, tmp_path / "tok", model_max_length=128)
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.model_max_length == 128 and tok.decode(tok(SAMPLES[0])["input_ids"]) == SAMPLES[0]


def test_tokenizers_pad_on_the_left(tmp_path):
    """Decoder-only model: batched generate needs left padding, from the saved config and from load_tokenizer."""
    from transformers import AutoTokenizer

    save_hf_tokenizer(build_bpe(SAMPLES * 20, vocab_size=300), tmp_path / "tok")
    for path in (tmp_path / "tok", EMBEDDED_PATH):  # what the trainer writes, and the shipped files
        plain = AutoTokenizer.from_pretrained(str(path))
        assert plain.padding_side == "left", path
    legacy = tmp_path / "legacy"  # a folder written before padding_side was saved still loads left-padded
    legacy.mkdir()
    for f in (tmp_path / "tok").iterdir():
        legacy.joinpath(f.name).write_bytes(f.read_bytes())
    cfg = legacy / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"padding_side": "left"', '"padding_side": "right"'))
    assert AutoTokenizer.from_pretrained(str(legacy)).padding_side == "right"
    tok = load_tokenizer(legacy)
    batch = tok(["x = 1\n", SAMPLES[0]], padding=True)
    assert tok.padding_side == "left" and batch["attention_mask"][0][0] == 0 and batch["attention_mask"][0][-1] == 1
