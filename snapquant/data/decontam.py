"""Near-duplicate detection between a held-out set and training text (word n-gram Jaccard).

Exact-hash deduplication misses vendored copies that differ by a line (setuptools'
`_distutils/version.py` vs the stdlib's `distutils/version.py`). Here every text becomes the set of
its word 5-grams (whitespace-separated words, hashed with crc32 so sets are stable across
processes, unlike Python's salted `hash`), and a held-out file and a training file are near
duplicates when the Jaccard similarity of their sets is at least `JACCARD_THRESHOLD` (0.5) or when
at least `CONTAINMENT_THRESHOLD` (0.8) of the held-out file's n-grams occur in the training file
(the held-out file pasted inside a larger one). Similarities are exact (an inverted index over the
held-out n-grams), not MinHash estimates: the held-out side is small, so exactness costs nothing.

A licence header shared by two unrelated modules gives a Jaccard of a few per cent: below both
thresholds, as it should be.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

NGRAM = 5
JACCARD_THRESHOLD = 0.5
CONTAINMENT_THRESHOLD = 0.8


def shingles(text: str, n: int = NGRAM) -> np.ndarray:
    """Sorted unique uint32 crc32 hashes of the text's word n-grams (one hash for texts under n words)."""
    words = text.split()
    if not words:
        return np.zeros(0, dtype=np.uint32)
    if len(words) < n:
        grams = [" ".join(words)]
    else:
        grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    return np.unique(np.fromiter((zlib.crc32(g.encode("utf-8")) for g in grams), dtype=np.uint32, count=len(grams)))


@dataclass(frozen=True)
class Overlap:
    """The held-out file most similar to one training text."""

    heldout_index: int
    """Index into the held-out list (-1 when no n-gram is shared)."""
    jaccard: float
    containment: float
    """Share of the held-out file's n-grams present in the training text."""

    def is_near_duplicate(self, jaccard: float = JACCARD_THRESHOLD, containment: float = CONTAINMENT_THRESHOLD) -> bool:
        return self.jaccard >= jaccard or self.containment >= containment


class NearDuplicateIndex:
    """Inverted index over held-out n-gram sets; `overlap(text)` finds the closest held-out file."""

    def __init__(self, heldout_texts: Sequence[str], n: int = NGRAM):
        self.n = n
        sets = [shingles(t, n) for t in heldout_texts]
        self.sizes = np.array([s.size for s in sets], dtype=np.int64)
        if sets and sum(s.size for s in sets):
            hashes = np.concatenate(sets)
            owners = np.concatenate([np.full(s.size, i, dtype=np.int64) for i, s in enumerate(sets)])
            order = np.argsort(hashes, kind="stable")
            self.hashes, self.owners = hashes[order], owners[order]
        else:
            self.hashes = np.zeros(0, dtype=np.uint32)
            self.owners = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.sizes.size)

    def overlap(self, text: str) -> Overlap:
        return self.overlap_shingles(shingles(text, self.n))

    def overlap_shingles(self, s: np.ndarray) -> Overlap:
        if s.size == 0 or self.hashes.size == 0:
            return Overlap(-1, 0.0, 0.0)
        lo = np.searchsorted(self.hashes, s, side="left")
        hi = np.searchsorted(self.hashes, s, side="right")
        hit = hi > lo
        if not hit.any():
            return Overlap(-1, 0.0, 0.0)
        # Each held-out set has unique hashes, so a hash run lists each owner at most once.
        runs = [self.owners[a:b] for a, b in zip(lo[hit], hi[hit], strict=True)]
        counts = np.bincount(np.concatenate(runs), minlength=len(self))
        union = self.sizes + s.size - counts
        jac = np.where(union > 0, counts / np.maximum(union, 1), 0.0)
        cont = np.where(self.sizes > 0, counts / np.maximum(self.sizes, 1), 0.0)
        # The file closest to either threshold: it crosses one iff any held-out file does.
        best = int(np.argmax(np.maximum(jac / JACCARD_THRESHOLD, cont / CONTAINMENT_THRESHOLD)))
        return Overlap(best, float(jac[best]), float(cont[best]))


def decontaminate(train_texts: Iterable[str], heldout_texts: Sequence[str], *, n: int = NGRAM,
                  jaccard: float = JACCARD_THRESHOLD, containment: float = CONTAINMENT_THRESHOLD
                  ) -> tuple[list[int], list[Overlap]]:
    """Indices of training texts to drop (near duplicates of a held-out text) and every text's overlap."""
    index = NearDuplicateIndex(heldout_texts, n)
    drop, overlaps = [], []
    for i, t in enumerate(train_texts):
        ov = index.overlap(t)
        overlaps.append(ov)
        if ov.is_near_duplicate(jaccard, containment):
            drop.append(i)
    return drop, overlaps


def overlap_summary(overlaps: Sequence[Overlap], n_heldout: int, dropped: Sequence[int] = ()) -> dict:
    """For the model card: per held-out file, the largest overlap with a *kept* training text.

    Each training text reports its closest held-out file only, so this is the largest overlap among
    closest matches (every kept text is below both thresholds against every held-out file).
    """
    dropped_set = set(dropped)
    worst_j = np.zeros(n_heldout)
    worst_c = np.zeros(n_heldout)
    for i, ov in enumerate(overlaps):
        if i in dropped_set or ov.heldout_index < 0:
            continue
        worst_j[ov.heldout_index] = max(worst_j[ov.heldout_index], ov.jaccard)
        worst_c[ov.heldout_index] = max(worst_c[ov.heldout_index], ov.containment)
    return {
        "ngram": NGRAM, "jaccard_threshold": JACCARD_THRESHOLD, "containment_threshold": CONTAINMENT_THRESHOLD,
        "train_dropped": len(dropped_set), "heldout_files": n_heldout,
        "max_jaccard_kept": float(worst_j.max()) if n_heldout else 0.0,
        "max_containment_kept": float(worst_c.max()) if n_heldout else 0.0,
        "median_max_containment_kept": float(np.median(worst_c)) if n_heldout else 0.0,
    }
