"""Text for analyses: reading a corpus file and cutting it into fixed-length token sequences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..data.tokenizer import encode_text
from ..errors import ConfigError


def load_texts(path: str | Path, field: str = "text") -> list[str]:
    """A .txt file (one document; blank-line separated paragraphs stay together) or .jsonl/.json with `field`."""
    return [text for _, text in load_documents(path, field)]


def load_documents(path: str | Path, field: str = "text") -> list[tuple[str, str]]:
    """(name, text) of every document of a .txt / .jsonl / .json source, in file order.

    A record's name is its "path", "name" or "id" field when it has one (the held-out code has
    "path"), else `FILE#INDEX`; a .txt file is one document named after the file.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"text source {p} does not exist")
    if p.suffix not in (".jsonl", ".json"):
        return [(p.name, p.read_text())]
    lines = p.read_text().splitlines() if p.suffix == ".jsonl" else None
    rows = [json.loads(x) for x in lines if x.strip()] if lines is not None else json.loads(p.read_text())
    docs = []
    for i, row in enumerate(rows):
        if isinstance(row, str):
            docs.append((f"{p.name}#{i}", row))
        elif isinstance(row, dict) and isinstance(row.get(field), str):
            name = next((str(row[k]) for k in ("path", "name", "id") if row.get(k) is not None), f"{p.name}#{i}")
            docs.append((name, row[field]))
        else:
            raise ConfigError(f"{p}: record {i} has no string field {field!r}")
    return docs


def token_batches(tokenizer: Any, texts: list[str], seq_len: int, num_sequences: int) -> torch.Tensor:
    """Concatenate the tokenized texts (EOS between documents) and cut `num_sequences` rows of `seq_len`.

    Equal-length rows without padding keep every position a real token, which the per-position
    metrics (KL, top-1, perplexity) and the teacher-forced captures rely on.
    """
    if seq_len < 2:
        raise ConfigError(f"seq_len={seq_len} must be at least 2")
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    need = seq_len * num_sequences
    for t in texts:
        ids.extend(encode_text(tokenizer, t))  # whole documents: rows are cut from the stream below
        if eos is not None:
            ids.append(eos)
        if len(ids) >= need:
            break
    if len(ids) < need:
        got = len(ids) // seq_len
        if got == 0:
            raise ConfigError(f"the text has {len(ids)} tokens, fewer than one sequence of seq_len={seq_len}")
        num_sequences = got
    return torch.tensor(ids[: seq_len * num_sequences], dtype=torch.long).view(num_sequences, seq_len)
