"""Intervals and paired tests for per-position fidelity metrics, clustered by sequence.

Positions of one sequence are not independent (one confusing stretch of text moves many of them),
so the unit of resampling is the sequence:
- `position_metrics`: per-position KL(ref || quant), top-1 flip and both NLLs from two log-prob sets;
- `cluster_summary`: mean / median / p90 / p99 / max KL, share of positions above fixed KL
  thresholds, top-1 flip rate and perplexity delta, each with a percentile CI from
  `scipy.stats.bootstrap` over sequences (the statistic is recomputed on the concatenated positions
  of each resampled set of sequences);
- `paired_comparison`: config B - config A on the same positions, as the mean over sequences of the
  per-sequence difference, with a paired t CI and a two-sided sign-flip permutation p-value
  (under H0 each sequence's pair is exchangeable): the same test and interval as the benchmark
  tables' (`significance.permutation_pvalues` and `significance.jackknife_t_interval`). The
  permutation test is exact when 2^n <= n_resamples (n <= 13 at the default) and its randomized
  version keeps its level for any n, unlike a percentile-bootstrap p-value.
Every result carries n (sequences and positions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy import stats

from .significance import DEFAULT_RESAMPLES, jackknife_t_interval, permutation_pvalues

KL_THRESHOLDS = (0.01, 0.1, 1.0)


def position_metrics(ref_logprobs: torch.Tensor, quant_logprobs: torch.Tensor, targets: torch.Tensor
                     ) -> dict[str, np.ndarray]:
    """[N, P, V] log-probs (any float dtype, any device) and [N, P] targets -> [N, P] float64 arrays.

    KL in float64: KL of near-identical distributions is a difference of close numbers.
    """
    if ref_logprobs.shape != quant_logprobs.shape or ref_logprobs.dim() != 3 or targets.shape != ref_logprobs.shape[:2]:
        raise ValueError(f"ref {tuple(ref_logprobs.shape)} and quant {tuple(quant_logprobs.shape)} must be [N, P, V] "
                         f"and targets [N, P], got {tuple(targets.shape)}")
    out: dict[str, list] = {"kl": [], "flip": [], "nll_ref": [], "nll_quant": []}
    for i in range(ref_logprobs.shape[0]):  # one sequence at a time keeps float64 [P, V] small
        r = torch.log_softmax(ref_logprobs[i].double(), -1)
        q = torch.log_softmax(quant_logprobs[i].to(r.device).double(), -1)
        t = targets[i].to(r.device)[:, None]
        out["kl"].append((r.exp() * (r - q)).sum(-1).clamp_min(0.0).cpu())
        out["flip"].append((r.argmax(-1) != q.argmax(-1)).double().cpu())
        out["nll_ref"].append(-r.gather(-1, t).squeeze(-1).cpu())
        out["nll_quant"].append(-q.gather(-1, t).squeeze(-1).cpu())
    return {k: torch.stack(v).numpy() for k, v in out.items()}


def _statistics(thresholds: Sequence[float]) -> dict[str, Callable[[dict[str, np.ndarray]], float]]:
    st: dict[str, Callable] = {
        "kl_mean": lambda m: float(m["kl"].mean()),
        "kl_median": lambda m: float(np.median(m["kl"])),
        "kl_p90": lambda m: float(np.quantile(m["kl"], 0.90)),
        "kl_p99": lambda m: float(np.quantile(m["kl"], 0.99)),
        "kl_max": lambda m: float(m["kl"].max()),
        "flip_rate": lambda m: float(m["flip"].mean()),
        "ppl_delta": lambda m: math.exp(m["nll_quant"].mean()) - math.exp(m["nll_ref"].mean()),
    }
    for th in thresholds:
        st[f"share_kl_gt_{th:g}"] = (lambda th_: lambda m: float((m["kl"] > th_).mean()))(th)
    return st


@dataclass(frozen=True)
class Estimate:
    statistic: str
    value: float
    ci_low: float
    ci_high: float
    n_sequences: int
    n_positions: int


def cluster_summary(metrics: dict[str, np.ndarray], *, thresholds: Sequence[float] = KL_THRESHOLDS,
                    confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> list[Estimate]:
    """Each statistic of the per-position metrics ([N, P] arrays) with a cluster-bootstrap CI over sequences."""
    n = metrics["kl"].shape[0]
    npos = int(metrics["kl"].size)
    out = []
    for name, fn in _statistics(thresholds).items():
        value = fn({k: v.reshape(-1) for k, v in metrics.items()})
        if n < 2:
            out.append(Estimate(name, value, math.nan, math.nan, n, npos))
            continue

        def stat(idx, fn=fn):
            sel = np.asarray(idx, dtype=int)
            return fn({k: v[sel].reshape(-1) for k, v in metrics.items()})

        res = stats.bootstrap((np.arange(n),), stat, vectorized=False, paired=False, n_resamples=n_resamples,
                              confidence_level=confidence, method="percentile", random_state=seed)
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        out.append(Estimate(name, value, lo, hi, n, npos))
    return out


@dataclass(frozen=True)
class PairedComparison:
    metric: str
    delta: float
    """mean over sequences of (b - a) per-sequence values."""
    ci_low: float
    ci_high: float
    p_value: float
    n_sequences: int
    n_positions: int
    test: str = "sign-flip permutation (scipy.stats.permutation_test)"

    def to_dict(self) -> dict:
        return asdict(self)


def per_sequence(metrics: dict[str, np.ndarray], metric: str = "kl") -> np.ndarray:
    """Per-sequence mean of one per-position metric ([N])."""
    return metrics[metric].mean(axis=1)


def paired_comparison(a: np.ndarray, b: np.ndarray, *, metric: str = "kl_mean", n_positions: int = 0,
                      confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
                      ) -> PairedComparison:
    """b - a over paired per-sequence values: mean difference, paired t CI, sign-flip permutation p-value."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired per-sequence values must be equal-length 1-D arrays, got {a.shape} and {b.shape}")
    n = a.size
    d = b - a
    delta = float(d.mean()) if n else math.nan
    if n < 2:
        return PairedComparison(metric, delta, math.nan, math.nan, 1.0, n, n_positions)
    if np.all(d == 0):
        return PairedComparison(metric, 0.0, 0.0, 0.0, 1.0, n, n_positions)
    p = float(permutation_pvalues(a, b, n_resamples=n_resamples, seed=seed))
    iv = jackknife_t_interval(a, b, "mean", confidence)  # the paired t interval of the mean difference
    return PairedComparison(metric, delta, float(iv.low), float(iv.high), p, n, n_positions)


def estimates_frame(label: str, estimates: Sequence[Estimate]):
    """One tidy DataFrame row per statistic (pandas imported lazily)."""
    import pandas as pd

    return pd.DataFrame([{"config": label, **asdict(e)} for e in estimates])


@dataclass(frozen=True)
class BinEstimate:
    """The mean of one per-position metric over the positions [lo, hi) of every sequence."""

    lo: int
    hi: int
    value: float
    ci_low: float
    ci_high: float
    n_sequences: int
    n_positions: int


def binned_means(values: np.ndarray, positions: np.ndarray, edges: Sequence[int], *, confidence: float = 0.95,
                 n_resamples: int = 2000, seed: int = 0) -> list[BinEstimate]:
    """Per position bin: the mean of `values` ([N, P], row = sequence) over the bin's positions, with a
    percentile cluster-bootstrap CI over sequences (`scipy.stats.bootstrap`).

    `positions` ([P]) says which position each column is. Every sequence has the same positions, so
    the pooled mean over a resampled set of sequences is the mean of their per-sequence bin means:
    the bootstrap resamples those. Bins without positions are left out; with one sequence the CI is
    NaN, and when every sequence has the same bin mean (e.g. no flip anywhere) it is that value.
    """
    from itertools import pairwise

    values = np.asarray(values, dtype=float)
    positions = np.asarray(positions)
    if values.ndim != 2 or positions.shape != values.shape[1:]:
        raise ValueError(f"values must be [N, P] and positions [P], got {values.shape} and {positions.shape}")
    out = []
    for lo, hi in pairwise(edges):
        cols = (positions >= lo) & (positions < hi)
        if not cols.any():
            continue
        per_seq = values[:, cols].mean(axis=1)
        n, v = per_seq.size, float(per_seq.mean())
        if n < 2:
            lo_ci = hi_ci = math.nan
        elif np.ptp(per_seq) == 0:
            lo_ci = hi_ci = v
        else:
            res = stats.bootstrap((per_seq,), np.mean, vectorized=True, n_resamples=n_resamples,
                                  confidence_level=confidence, method="percentile", random_state=seed)
            lo_ci, hi_ci = float(res.confidence_interval.low), float(res.confidence_interval.high)
        out.append(BinEstimate(int(lo), int(hi), v, lo_ci, hi_ci, n, int(cols.sum()) * n))
    return out
