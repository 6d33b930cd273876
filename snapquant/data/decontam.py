"""Near-duplicate detection between a held-out set and training text (word n-gram overlap).

Exact-hash deduplication misses vendored copies that differ by a line (setuptools'
`_distutils/version.py` vs the stdlib's `distutils/version.py`). Here every text becomes the set of
its word 5-grams (whitespace-separated words, hashed with crc32 so sets are stable across
processes, unlike Python's salted `hash`), and a held-out file and a training file are near
duplicates when the Jaccard similarity of their sets is at least `JACCARD_THRESHOLD` (0.5) or when
at least `CONTAINMENT_THRESHOLD` (0.8) of the held-out file's n-grams occur in the training file
(the held-out file pasted inside a larger one). Similarities are exact (an inverted index over the
held-out n-grams), not MinHash estimates: the held-out side is small, so exactness costs nothing.

Two directions:
- training side (`decontaminate`, the research corpus): training texts that are near duplicates of
  a held-out file are dropped, the held-out set stays fixed. A licence header shared by two
  unrelated modules gives a Jaccard of a few per cent: below both thresholds, and the file trains.
- held-out side (`heldout_overlaps`, the embedded model, trained already): a held-out file is
  contaminated when it is a near duplicate of a training file OR shares a verbatim passage of at
  least `SHARED_WORDS_THRESHOLD` (50) words with one (a licence header, a copied function: the
  model has seen those tokens, so they do not measure held-out behaviour). The passage length is
  the longest run of consecutive held-out 5-grams that all occur in one training file, plus 4.
  On the embedded corpus the longest shared passages of the clean files are 6-32 words (idioms,
  docstring boilerplate); the contaminated ones share 74-635.
  `TrainingSketch` keeps, per training file, only its n-gram count and the n-grams it shares with
  the held-out files: enough to recompute every similarity exactly without the training text.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .corpus import HELDOUT_FILE

NGRAM = 5
JACCARD_THRESHOLD = 0.5
CONTAINMENT_THRESHOLD = 0.8
SHARED_WORDS_THRESHOLD = 50


def ngram_hashes(text: str, n: int = NGRAM) -> np.ndarray:
    """uint32 crc32 hashes of the text's word n-grams in text order (one hash for texts under n words)."""
    words = text.split()
    if not words:
        return np.zeros(0, dtype=np.uint32)
    if len(words) < n:
        grams = [" ".join(words)]
    else:
        grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    return np.fromiter((zlib.crc32(g.encode("utf-8")) for g in grams), dtype=np.uint32, count=len(grams))


def shingles(text: str, n: int = NGRAM) -> np.ndarray:
    """Sorted unique uint32 crc32 hashes of the text's word n-grams (one hash for texts under n words)."""
    return np.unique(ngram_hashes(text, n))


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


# ---------------------------------------------------------------------- held-out side
@dataclass(frozen=True)
class HeldoutOverlap:
    """A held-out file's largest overlaps with any one training file (each with that file's name)."""

    path: str
    jaccard: float
    jaccard_with: str
    containment: float
    containment_with: str
    shared_words: int
    """Longest verbatim passage shared with one training file, in words (0 when none)."""
    shared_with: str

    def reasons(self, jaccard: float = JACCARD_THRESHOLD, containment: float = CONTAINMENT_THRESHOLD,
                shared_words: int = SHARED_WORDS_THRESHOLD) -> list[str]:
        """Which thresholds the file crosses (empty: clean)."""
        out = []
        if self.jaccard >= jaccard:
            out.append(f"jaccard {self.jaccard:.3f} >= {jaccard} with {self.jaccard_with}")
        if self.containment >= containment:
            out.append(f"containment {self.containment:.3f} >= {containment} with {self.containment_with}")
        if self.shared_words >= shared_words:
            out.append(f"{self.shared_words}-word passage (>= {shared_words}) shared with {self.shared_with}")
        return out

    def is_contaminated(self, **thresholds) -> bool:
        return bool(self.reasons(**thresholds))

    def to_dict(self) -> dict:
        return {"path": self.path, "jaccard": round(self.jaccard, 4), "jaccard_with": self.jaccard_with,
                "containment": round(self.containment, 4), "containment_with": self.containment_with,
                "shared_words": self.shared_words, "shared_with": self.shared_with}


@dataclass
class TrainingSketch:
    """Per training file: its number of distinct n-grams and the ones it shares with the held-out files.

    Jaccard and containment of a held-out file H and a training file T need |H|, |T| and |H & T|;
    H & T = H & (T & U) for U, the union of the held-out n-grams the sketch was built against, and
    the shared-passage length needs only which of H's n-grams are in T & U. So the sketch answers
    exactly for any held-out file in `heldout_sha256`, without the training text.
    """

    names: list[str]
    sizes: np.ndarray
    shared: list[np.ndarray]
    heldout_sha256: list[str]
    ngram: int = NGRAM

    @classmethod
    def build(cls, training: Iterable[tuple[str, str]], heldout_texts: Sequence[str], n: int = NGRAM
              ) -> TrainingSketch:
        """`training`: (name, text) pairs; `heldout_texts`: every held-out text the sketch must answer for."""
        union = np.unique(np.concatenate([shingles(t, n) for t in heldout_texts])) if heldout_texts else (
            np.zeros(0, dtype=np.uint32))
        names, sizes, shared = [], [], []
        for name, text in training:
            s = shingles(text, n)
            names.append(name)
            sizes.append(s.size)
            shared.append(s[np.isin(s, union, assume_unique=True)])
        return cls(names, np.asarray(sizes, dtype=np.int64), shared,
                   sorted(hashlib.sha256(t.encode("utf-8")).hexdigest() for t in heldout_texts), n)

    def to_json(self) -> dict:
        return {"format": "snapquant-ngram-sketch-v1", "ngram": self.ngram, "heldout_sha256": self.heldout_sha256,
                "files": [[nm, int(sz), [int(h) for h in sh]]
                          for nm, sz, sh in zip(self.names, self.sizes, self.shared, strict=True)]}

    @classmethod
    def from_json(cls, d: dict) -> TrainingSketch:
        files = d["files"]
        return cls([f[0] for f in files], np.asarray([f[1] for f in files], dtype=np.int64),
                   [np.asarray(f[2], dtype=np.uint32) for f in files], list(d["heldout_sha256"]), int(d["ngram"]))


def heldout_overlaps(heldout: Sequence[tuple[str, str]], sketch: TrainingSketch) -> list[HeldoutOverlap]:
    """For each (path, text) held-out file: its largest Jaccard, containment and shared passage.

    Raises ValueError for a held-out text the sketch was not built against (its answers would not
    be exact).
    """
    known = set(sketch.heldout_sha256)
    n = sketch.ngram
    # Inverted index over the sketch: which training files hold each shared n-gram.
    if any(s.size for s in sketch.shared):
        hashes = np.concatenate(sketch.shared)
        owners = np.concatenate([np.full(s.size, i, dtype=np.int64) for i, s in enumerate(sketch.shared)])
        order = np.argsort(hashes, kind="stable")
        hashes, owners = hashes[order], owners[order]
    else:
        hashes, owners = np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.int64)
    out = []
    for path, text in heldout:
        if hashlib.sha256(text.encode("utf-8")).hexdigest() not in known:
            raise ValueError(f"held-out file {path!r}: the n-gram sketch was not built against this text")
        seq = ngram_hashes(text, n)
        h = np.unique(seq)
        lo, hi = np.searchsorted(hashes, h, side="left"), np.searchsorted(hashes, h, side="right")
        runs = [owners[a:b] for a, b in zip(lo, hi, strict=True) if b > a]
        best = {"jaccard": (0.0, ""), "containment": (0.0, ""), "shared": (0, "")}
        if runs:
            counts = np.bincount(np.concatenate(runs), minlength=len(sketch.names))
            for t in np.flatnonzero(counts):
                inter = int(counts[t])
                jac = inter / (h.size + int(sketch.sizes[t]) - inter)
                cont = inter / h.size
                words = _longest_run(np.isin(seq, sketch.shared[t]))
                words = words + n - 1 if words else 0
                name = sketch.names[t]
                if jac > best["jaccard"][0]:
                    best["jaccard"] = (jac, name)
                if cont > best["containment"][0]:
                    best["containment"] = (cont, name)
                if words > best["shared"][0]:
                    best["shared"] = (words, name)
        out.append(HeldoutOverlap(path, best["jaccard"][0], best["jaccard"][1], best["containment"][0],
                                  best["containment"][1], int(best["shared"][0]), best["shared"][1]))
    return out


def _longest_run(mask: np.ndarray) -> int:
    if not mask.any():
        return 0
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return int((np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).max())


def heldout_summary(overlaps: Sequence[HeldoutOverlap], **thresholds) -> dict:
    """Counts and the largest remaining overlaps after dropping contaminated held-out files (for the card)."""
    kept = [o for o in overlaps if not o.is_contaminated(**thresholds)]
    dropped = [o for o in overlaps if o.is_contaminated(**thresholds)]

    def worst(key: str) -> dict:
        if not kept:
            return {"value": 0, "path": None, "with": None}
        o = max(kept, key=lambda o: getattr(o, key))
        partner = {"jaccard": o.jaccard_with, "containment": o.containment_with, "shared_words": o.shared_with}[key]
        return {"value": getattr(o, key), "path": o.path, "with": partner}

    return {
        "ngram": NGRAM,
        "thresholds": {"jaccard": thresholds.get("jaccard", JACCARD_THRESHOLD),
                       "containment": thresholds.get("containment", CONTAINMENT_THRESHOLD),
                       "shared_words": thresholds.get("shared_words", SHARED_WORDS_THRESHOLD)},
        "heldout_files_checked": len(overlaps), "dropped": len(dropped), "kept": len(kept),
        "max_remaining": {k: worst(k) for k in ("jaccard", "containment", "shared_words")},
    }


# ---------------------------------------------------------------------- the model card
CARD_BEGIN = "<!-- heldout-decontamination: written by scripts/decontam_heldout.py from heldout_decontam.json -->"
CARD_END = "<!-- /heldout-decontamination -->"


def _repo_path(p: Path) -> str:
    return p.relative_to(Path(__file__).resolve().parents[2]).as_posix()


def heldout_card_lines(record: dict) -> list[str]:
    """The model card's 'Held-out decontamination' section from `heldout_decontam.json`."""
    s = record["summary"]
    th = s["thresholds"]
    dropped = [f for f in record["files"] if f["status"] == "dropped"]
    mr = s["max_remaining"]
    lines = [
        CARD_BEGIN, "## Held-out decontamination", "",
        f"Every held-out file was compared with all {record['training_files']} training files of "
        f"`corpus_manifest.jsonl` (exact sets of whitespace-word {s['ngram']}-grams). A held-out file is dropped "
        f"when, against one training file, its Jaccard similarity is >= {th['jaccard']}, or >= {th['containment']} "
        f"of its {s['ngram']}-grams occur in it (containment), or the two share a verbatim passage of "
        f">= {th['shared_words']} words (a licence header, a copied function). The model was trained already, "
        f"so the held-out set shrinks: {s['dropped']} of {s['heldout_files_checked']} files dropped, "
        f"{s['kept']} kept in `{_repo_path(HELDOUT_FILE)}` (all evaluation reads these); the dropped "
        "ones (`heldout_dropped.jsonl`) stay excluded from training by hash.", "",
    ]
    if dropped:
        lines += ["| dropped held-out file | Jaccard | containment | longest shared passage (words) | closest training file |",
                  "|---|---|---|---|---|"]
        lines += [f"| {f['path']} | {f['jaccard']:.3f} | {f['containment']:.3f} | {f['shared_words']} | "
                  f"{f['shared_with'] or f['jaccard_with']} |" for f in dropped]
        lines.append("")
    lines.append(
        f"Largest overlaps left among the {s['kept']} kept files: Jaccard {mr['jaccard']['value']:.3f} "
        f"({mr['jaccard']['path']} vs {mr['jaccard']['with']}), containment {mr['containment']['value']:.3f} "
        f"({mr['containment']['path']} vs {mr['containment']['with']}), longest shared passage "
        f"{mr['shared_words']['value']} words ({mr['shared_words']['path']} vs {mr['shared_words']['with']}).")
    sc = record.get("scores")
    if sc:
        lines += ["", "bf16 on the two groups (direct harness, CPU): kept files "
                  f"{sc['kept']['bits_per_byte']:.4f} bits/byte (token perplexity {sc['kept']['token_perplexity']:.3f}, "
                  f"{sc['kept']['files']} files)"
                  + (f", dropped files {sc['dropped']['bits_per_byte']:.4f} bits/byte (token perplexity "
                     f"{sc['dropped']['token_perplexity']:.3f}, {sc['dropped']['files']} files)" if sc.get("dropped") else "")
                  + "."]
    if record.get("scores_predate_check"):
        lines += ["", f"The code scores in the BF16 tables above (perplexity, completion, pass keys in code) were "
                  f"measured before this check, on all {s['heldout_files_checked']} files."]
    lines += ["", f"Reproduce: `python scripts/decontam_heldout.py`; `tests/test_data_decontam.py` recomputes every "
              f"number here from `{record['sketch']}` (each training file's {s['ngram']}-gram count and the "
              f"{s['ngram']}-grams it shares with the held-out files).", CARD_END]
    return lines
