"""Training rows for the embedded model: real code windows mixed with synthetic retrieval documents.

A row is `seq_len + 1` token ids (inputs and shifted targets). Code rows are random windows of the
tokenized corpus. Synthetic rows pack documents (EOS-separated) drawn from:
- key-value lookups written as Python (`kv_training_document`), many answered asserts per table;
- classic pass keys (repeated-sentence filler) and pass keys hidden in real training code.
Half of the synthetic documents fill the whole row, so retrieval is trained over every distance up
to `seq_len`. All randomness comes from `seed_rng("train", seed, stream, ...)`: the evaluation
tasks use the "eval" namespace, so no instance is shared.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .synthetic import kv_training_document, passkey_training_document, seed_rng

KIND_CODE, KIND_SYNTH = 0, 1


@dataclass(frozen=True)
class MixtureSpec:
    seq_len: int = 4096
    synthetic_fraction: float = 0.4
    # Shares among synthetic documents; the rest of the mass is key-value lookups.
    passkey_share: float = 0.15
    passkey_code_share: float = 0.15
    full_length_share: float = 0.5
    min_doc_tokens: int = 128

    def __post_init__(self) -> None:
        if self.seq_len < 256:
            raise ConfigError(f"seq_len={self.seq_len} must be >= 256")
        for name in ("synthetic_fraction", "passkey_share", "passkey_code_share", "full_length_share"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name}={v} must lie in [0, 1]")
        if self.passkey_share + self.passkey_code_share > 1.0:
            raise ConfigError("passkey_share + passkey_code_share must not exceed 1")


class RowBuilder:
    """Builds rows from a token array and a `tokenizers.Tokenizer`; one instance per data worker."""

    def __init__(self, tokens: np.ndarray, tokenizer, eos_id: int, spec: MixtureSpec, seed: int, stream: int):
        if tokens.size < spec.seq_len + 2:
            raise ConfigError(f"corpus has {tokens.size} tokens, fewer than one row of {spec.seq_len + 1}")
        self.tokens = tokens
        self.tok = tokenizer
        self.eos = eos_id
        self.spec = spec
        self.rng = seed_rng("train", "mixture", seed, stream)
        self.np_rng = np.random.default_rng(self.rng.getrandbits(63))
        self.n_docs = 0

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def code_window(self, n: int) -> np.ndarray:
        start = int(self.np_rng.integers(0, self.tokens.size - n))
        return np.asarray(self.tokens[start:start + n], dtype=np.int64)

    def code_lines(self, n_tokens: int) -> list[str]:
        """Real training code as whole lines (the haystack of code pass keys)."""
        text = self.tok.decode(self.code_window(n_tokens).tolist(), skip_special_tokens=True)
        lines = [ln + "\n" for ln in text.split("\n")[1:-1]]  # drop the cut first/last lines
        return lines or ["pass\n"]

    def synthetic_document(self, target: int) -> list[int]:
        self.n_docs += 1
        rng = seed_rng("train", "doc", self.rng.getrandbits(64))
        r = rng.random()
        spec = self.spec
        if r < spec.passkey_share:
            text = passkey_training_document(rng, target, self.count)
        elif r < spec.passkey_share + spec.passkey_code_share:
            text = passkey_training_document(rng, target, self.count, haystack=self.code_lines(target + 64))
        else:
            text = kv_training_document(rng, target, self.count, n_queries=rng.randint(4, 24))
        return self.encode(text)

    def row(self) -> tuple[np.ndarray, int]:
        """One row of `seq_len + 1` ids and its kind (KIND_CODE or KIND_SYNTH)."""
        n = self.spec.seq_len + 1
        if self.rng.random() >= self.spec.synthetic_fraction:
            return self.code_window(n), KIND_CODE
        ids: list[int] = []
        while len(ids) < n:
            room = n - len(ids) - 1
            if room < self.spec.min_doc_tokens:
                ids.extend(self.code_window(room + 1).tolist())
                break
            if self.rng.random() < self.spec.full_length_share:
                target = room
            else:
                target = self.rng.randint(self.spec.min_doc_tokens, room)
            ids.extend(self.synthetic_document(max(64, target)))
            ids.append(self.eos)
        return np.asarray(ids[:n], dtype=np.int64), KIND_SYNTH

    def rows(self) -> Iterator[tuple[np.ndarray, int]]:
        while True:
            yield self.row()
