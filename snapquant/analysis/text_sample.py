"""Token sequences that represent a text source: many documents, each entered past its header.

Cutting rows from the start of a concatenated corpus scores the first document only, from its
licence block on. `sample_sequences` instead
- skips each document's header (`header_end`: for Python source, the leading comments, shebang and
  encoding lines and the module docstring; other text is entered at its start);
- spreads the rows over documents round-robin: every document long enough for one row gives one
  before any gives a second, so a row (the unit the cluster bootstrap resamples) is close to a
  document, and a document gives at most as many rows as it holds without overlap;
- places each document's rows at seeded random, non-overlapping token offsets past its header;
- falls back, when the documents cannot hold the rows one by one (short documents, or rows longer
  than most documents), to rows at seeded random non-overlapping offsets of the stream of all
  documents (headers skipped, EOS between them), each row recording the documents it spans;
- raises one ConfigError line when even the stream is too short.
Every row records where it came from (document, token offset past the header, line in the
document), so the context of a large-KL position can be found.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.tokenizer import encode_text
from ..errors import ConfigError
from .text import load_documents

PER_DOCUMENT = "per-document"
STREAM = "stream"


def header_end(text: str) -> int:
    """Character offset where the body of a Python source file starts (0 for text that is not Python).

    The header is, from the top: every blank line and every line whose first non-blank character
    is '#' (shebang, PEP 263 encoding cookie, licence and copyright blocks, editor modelines),
    the module docstring (a string-literal first statement, as `ast.get_docstring` defines it,
    through its last line) and the blank and comment lines after it. Code is never header, not
    even `from __future__` imports or `__all__`. A text that does not parse as Python has no
    header (prose may start with a '#' heading that is content). A file that is all header
    returns len(text).
    """
    try:
        with warnings.catch_warnings():  # invalid escape sequences in old sources warn, they are not errors
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return 0
    doc = None
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant) \
            and isinstance(tree.body[0].value.value, str):
        doc = (tree.body[0].lineno, tree.body[0].end_lineno)
    lines = text.splitlines(keepends=True)
    pos, i = 0, 0  # char offset of line i (0-based)
    while i < len(lines):
        if doc is not None and i + 1 == doc[0]:
            for line in lines[i:doc[1]]:
                pos += len(line)
            i = doc[1]
            continue
        stripped = lines[i].strip()
        if stripped and not stripped.startswith("#"):
            break
        pos += len(lines[i])
        i += 1
    return pos


@dataclass(frozen=True)
class Origin:
    """Where one row of a sample came from."""

    row: int
    document: str
    """The document the row starts in (a held-out file's path)."""
    token_offset: int
    """Tokens from the end of that document's header to the row's first token."""
    line: int
    """1-based line of the document on which the row's first token starts."""
    spans: str
    """Every document piece in the row, `name[start:end]` in tokens past the header, ' | '-separated."""


@dataclass
class TextSample:
    """[N, T] token ids and where each row came from."""

    input_ids: torch.Tensor
    origins: list[Origin]
    source: str
    method: str
    """'per-document' (each row inside one document) or 'stream' (rows of the concatenated documents)."""
    seed: int
    skip_headers: bool
    pieces: list[list[tuple[int, str, int]]]
    """Per row, its document pieces: (column where the piece starts, document, token offset past the header)."""
    num_documents: int | None = None
    """Documents in the source."""
    documents_holding_a_row: int | None = None
    """Documents long enough (past their header) for one whole row: fewer than the rows means a stream sample."""

    def locate(self, row: int, column: int) -> tuple[str, int]:
        """(document, token offset past its header) of the token at `column` of `row`; in a stream row,
        the EOS between two documents counts as the end of the earlier one."""
        start, name, offset = next(p for p in reversed(self.pieces[row]) if p[0] <= column)
        return name, offset + column - start

    def records(self) -> list[dict[str, Any]]:
        return [asdict(o) for o in self.origins]

    def describe(self) -> dict[str, Any]:
        """What a results file records about the text: source, method, seed, and every row's origin."""
        n, t = self.input_ids.shape
        return {"source": self.source, "method": self.method, "seed": self.seed, "skip_headers": self.skip_headers,
                "num_sequences": n, "seq_len": t, "documents": len({o.document for o in self.origins}),
                "sequences": self.records()}


@dataclass
class _Body:
    name: str
    text: str
    header_chars: int
    ids: list[int]


def _line_of(tokenizer: Any, body: _Body, k: int) -> int:
    """1-based line of the document at body token k (the tokenizer's decode of the prefix; exact where
    decoding round-trips, as it does for byte-level BPE)."""
    prefix = tokenizer.decode(body.ids[:k]) if k else ""
    return body.text.count("\n", 0, body.header_chars) + prefix.count("\n") + 1


def _starts(rng: np.random.Generator, length: int, count: int, width: int) -> list[int]:
    """`count` non-overlapping windows of `width` in [0, length), uniformly placed: sorted slack + i * width."""
    slack = length - count * width
    gaps = np.sort(rng.integers(0, slack + 1, size=count))
    return [int(g) + i * width for i, g in enumerate(gaps)]


def _round_robin(rng: np.random.Generator, capacity: Sequence[int], n: int) -> list[int]:
    """Rows per document: one each in a seeded order, then a second each, ..., skipping full documents."""
    order = [int(i) for i in rng.permutation(len(capacity))]
    counts = [0] * len(capacity)
    while n:
        for i in order:
            if n and counts[i] < capacity[i]:
                counts[i] += 1
                n -= 1
    return counts


def sample_sequences(tokenizer: Any, source: str | Path, seq_len: int, num_sequences: int, *, seed: int = 0,
                     skip_headers: bool = True, field: str = "text") -> TextSample:
    """`num_sequences` rows of `seq_len` tokens from the documents of `source` (.txt / .jsonl / .json).

    Deterministic for a given source, tokenizer and seed. Per-document when the documents can hold
    the rows without overlap, else from the stream (module docstring); ConfigError when the source
    holds fewer than `num_sequences * seq_len` tokens past its headers.
    """
    if seq_len < 2 or num_sequences < 1:
        raise ConfigError(f"seq_len={seq_len} must be at least 2 and num_sequences={num_sequences} at least 1")
    docs = load_documents(source, field)
    bodies = []
    for name, text in docs:
        h = header_end(text) if skip_headers else 0
        bodies.append(_Body(name, text, h, encode_text(tokenizer, text[h:])))
    rng = np.random.default_rng(seed)
    capacity = [len(b.ids) // seq_len for b in bodies]
    rows: list[list[int]] = []
    origins: list[Origin] = []
    pieces: list[list[tuple[int, str, int]]] = []
    if sum(capacity) >= num_sequences:
        method = PER_DOCUMENT
        counts = _round_robin(rng, capacity, num_sequences)
        for b, c in zip(bodies, counts, strict=True):
            for k in _starts(rng, len(b.ids), c, seq_len) if c else ():
                origins.append(Origin(len(rows), b.name, k, _line_of(tokenizer, b, k), f"{b.name}[{k}:{k + seq_len}]"))
                pieces.append([(0, b.name, k)])
                rows.append(b.ids[k:k + seq_len])
    else:
        method = STREAM
        eos = getattr(tokenizer, "eos_token_id", None)
        stream: list[int] = []
        starts: list[int] = []  # stream offset where each body starts
        for b in bodies:
            starts.append(len(stream))
            stream.extend(b.ids)
            if eos is not None:
                stream.append(eos)
        if len(stream) < num_sequences * seq_len:
            raise ConfigError(
                f"text source {source} cannot give {num_sequences} sequences of seq_len={seq_len}: its "
                f"{len(bodies)} document(s) hold {len(stream)} tokens{' past their headers' if skip_headers else ''}, "
                f"enough for {len(stream) // seq_len}; lower num_sequences or seq_len, or use a longer source")
        for s in _starts(rng, len(stream), num_sequences, seq_len):
            first = int(np.searchsorted(starts, s, side="right")) - 1
            spans, row_pieces, j = [], [], first
            while j < len(starts) and starts[j] < s + seq_len:
                b = bodies[j]
                lo, hi = max(s - starts[j], 0), min(s + seq_len - starts[j], len(b.ids))
                if hi > lo or j == first:  # the first piece may be the EOS that ends its document
                    row_pieces.append((starts[j] + lo - s, b.name, lo))
                if hi > lo:
                    spans.append(f"{b.name}[{lo}:{hi}]")
                j += 1
            b = bodies[first]
            k = min(s - starts[first], len(b.ids))
            origins.append(Origin(len(rows), b.name, k, _line_of(tokenizer, b, k), " | ".join(spans)))
            pieces.append(row_pieces)
            rows.append(stream[s:s + seq_len])
    ids = torch.tensor(rows, dtype=torch.long).view(num_sequences, seq_len)
    return TextSample(ids, origins, str(source), method, seed, skip_headers, pieces, len(bodies),
                      sum(1 for c in capacity if c))
