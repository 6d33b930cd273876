"""Byte-level BPE tokenizer for the embedded model, trained here on the training split.

Newlines are isolated before the byte-level split, so every line boundary is also a token boundary.
That matters for evaluation: a prompt that ends at a line break (next-line completion) or right
before a value (key-value retrieval) then tokenizes exactly as the same text does mid-document,
so the model is never scored on a token sequence it could not have seen in training.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]


def build_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE `tokenizers.Tokenizer` on `texts` (deterministic for the same input)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf_tokenizer(tok, out_dir: Path | str, model_max_length: int = 4096) -> Path:
    """Save as a transformers-loadable folder (tokenizer.json + tokenizer_config.json)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",  # a decoder-only model: batched generate continues after the last real token
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
        indent=2) + "\n", encoding="utf-8")
    return out_dir


def load_fast_tokenizer(path: Path | str):
    """The raw `tokenizers.Tokenizer` (no transformers import): fast encoding in data workers."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} not found")
    return Tokenizer.from_file(str(path))


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` of any length, without special tokens (`tokenizer`: any transformers tokenizer).

    For callers that cut, window or only count the ids (never one model input longer than the model's
    context): transformers' "longer than the specified maximum sequence length" warning compares the whole
    text with the tokenizer's `model_max_length` and does not apply to them, so it is not asked for.
    """
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
