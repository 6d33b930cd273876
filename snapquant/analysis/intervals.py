"""Intervals for per-position fidelity means (next-token KL, top-1 agreement) of one decode run.

Positions of one sequence are not independent samples: they share the cache prefix, so an error
in an early cached token moves many later distributions, and a per-position bootstrap would give
intervals that are too narrow. These use a non-overlapping **block bootstrap** (Kunsch 1989;
Carlstein 1986): each sequence is cut into blocks of `block` consecutive positions, and whole blocks
are resampled, keeping the short-range dependence inside a block. The statistic is the ratio of
resampled sums to resampled counts, so it equals the plain mean over positions when nothing is
resampled, with a shorter last block weighted by its size. The resampling and the BCa interval are
scipy.stats.bootstrap's.

- `block_mean_ci`: mean of one configuration, with its 95% interval;
- `paired_block_ci`: a paired comparison of two configurations on the SAME positions (same blocks
  drawn for both): the difference of means, or their ratio (how many times the KL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_BLOCK = 16
"""Positions per block: 48 blocks in the experiments' 4 sequences of 191 decode positions, enough to
resample; long enough to hold the short-range dependence of consecutive predictions. The tables
record it, and the experiments' --block changes it."""


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    n_positions: int
    n_blocks: int
    method: str

    def to_dict(self, prefix: str) -> dict[str, float | int | str]:
        return {prefix: self.estimate, f"{prefix}_ci_low": self.low, f"{prefix}_ci_high": self.high,
                f"{prefix}_n_positions": self.n_positions, f"{prefix}_n_blocks": self.n_blocks}


def blocks(values: np.ndarray, block: int = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """[N, S] per-position values -> (sums, counts) of non-overlapping blocks within each row."""
    v = np.asarray(values, dtype=float)
    if v.ndim == 1:
        v = v[None]
    if v.ndim != 2 or v.shape[1] == 0:
        raise ValueError(f"values must be [sequences, positions] with positions > 0, got shape {v.shape}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    edges = list(range(0, v.shape[1], block))
    sums = np.stack([v[:, e:e + block].sum(axis=1) for e in edges], axis=1).ravel()
    counts = np.stack([np.full(v.shape[0], min(block, v.shape[1] - e), dtype=float) for e in edges], axis=1).ravel()
    return sums, counts


def _bootstrap(data: tuple[np.ndarray, ...], statistic, n_resamples: int, seed: int, confidence: float):
    import warnings

    from scipy import stats

    # degenerate data (every resample equal: BCa's acceleration is 0/0) is handled below
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=n_resamples,
                              confidence_level=confidence, method="BCa", random_state=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(lo) and math.isfinite(hi)):  # BCa is undefined when every resample agrees
        lo = hi = float(statistic(*data, axis=-1))
    return lo, hi


def block_mean_ci(values: np.ndarray, block: int = DEFAULT_BLOCK, *, confidence: float = 0.95,
                  n_resamples: int = 4000, seed: int = 0) -> Interval:
    """Mean over all positions of `values` [N, S], with a block-bootstrap BCa interval."""
    sums, counts = blocks(values, block)
    est = float(sums.sum() / counts.sum())
    if sums.size < 2 or np.all(sums / counts == est):
        return Interval(est, est, est, int(counts.sum()), sums.size, "exact" if sums.size > 1 else "none")
    lo, hi = _bootstrap((sums, counts), lambda s, c, axis=-1: s.sum(axis) / c.sum(axis),
                        n_resamples, seed, confidence)
    return Interval(est, lo, hi, int(counts.sum()), sums.size, f"block bootstrap BCa, {block} positions/block")


def paired_block_ci(base: np.ndarray, variant: np.ndarray, kind: str = "ratio", block: int = DEFAULT_BLOCK, *,
                    confidence: float = 0.95, n_resamples: int = 4000, seed: int = 0) -> Interval:
    """mean(variant) / mean(base) (`kind="ratio"`) or mean(variant) - mean(base) (`"difference"`) on the
    same positions, with a paired block-bootstrap BCa interval (the same blocks drawn for both)."""
    b, v = np.asarray(base, dtype=float), np.asarray(variant, dtype=float)
    if b.shape != v.shape:
        raise ValueError(f"paired values must have the same shape, got {b.shape} and {v.shape}")
    if kind not in ("ratio", "difference"):
        raise ValueError(f"kind must be 'ratio' or 'difference', got {kind!r}")
    sb, counts = blocks(b, block)
    sv, _ = blocks(v, block)
    if kind == "ratio":
        def stat(x, y, c, axis=-1):
            return y.sum(axis) / x.sum(axis)
    else:
        def stat(x, y, c, axis=-1):
            return (y.sum(axis) - x.sum(axis)) / c.sum(axis)
    est = float(stat(sb, sv, counts))
    if sb.size < 2:
        return Interval(est, est, est, int(counts.sum()), sb.size, "none")
    lo, hi = _bootstrap((sb, sv, counts), stat, n_resamples, seed, confidence)
    return Interval(est, lo, hi, int(counts.sum()), sb.size, f"paired block bootstrap BCa, {block} positions/block")
