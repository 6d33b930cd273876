"""Intervals and paired tests for per-position fidelity metrics, clustered by sequence.

Positions of one sequence are not independent (they share the cache prefix, and one confusing
stretch of text moves many of them), so the unit of resampling and of pairing is the sequence:

- `position_metrics`: per-position KL(ref || quant), top-1 flip, both NLLs and both top-1 tokens
  from two log-prob sets;
- `sequence_aggregates`: per-sequence sums (positions, KL, flips, NLLs, positions above each KL
  threshold, the largest KL) from which every smooth statistic and every paired comparison is
  recomputed: what a sweep's cell JSON keeps;
- `cluster_summary`: mean / median / p90 / p99 / max KL, share of positions above fixed KL
  thresholds, top-1 flip rate and perplexity delta, each with a percentile interval from
  `scipy.stats.bootstrap` over sequences (every statistic recomputed on the positions of each
  resampled set of whole sequences);
- `paired_comparison`: config B - config A on the same positions, with the sign-flip permutation
  p-value over sequences and the paired t (jackknife t for pooled means) interval: the tables' own
  test and interval (`significance.permutation_pvalues`, `significance.jackknife_t_interval`);
- `paired_ratio`: sum_B / sum_A (e.g. how many times the mean KL) with a percentile
  cluster-bootstrap interval, the same sequences drawn for both;
- `compare_fidelity`: the three a fidelity table shows (KL mean difference, KL ratio, flip-rate
  difference) from two configurations' per-sequence aggregates.
Every result carries n (sequences and positions). Why these intervals: docs/statistics.md
("Per-sequence fidelity").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from scipy import stats

from .significance import DEFAULT_RESAMPLES, jackknife_t_interval, permutation_pvalues

KL_THRESHOLDS = (0.01, 0.1, 1.0)
BOOTSTRAP_RESAMPLES = 2000
"""Cluster-bootstrap resamples: the Monte Carlo error of a 95% percentile bound is then about
1% of the interval's width, well below its sampling error at tens of sequences."""
SUMMARY_METHOD = "percentile"
RATIO_METHOD = "percentile"
_QUANTILES = {"kl_median": 0.5, "kl_p90": 0.9, "kl_p99": 0.99}


def threshold_key(th: float) -> str:
    """'share_kl_gt_0.1' (statistic) and 'kl_gt_0.1' (per-sequence count) name a KL threshold."""
    return f"kl_gt_{th:g}"


def statistic_names(thresholds: Sequence[float] = KL_THRESHOLDS) -> list[str]:
    """The statistics `cluster_summary` reports, in order."""
    return ["kl_mean", *_QUANTILES, "kl_max", *(f"share_{threshold_key(t)}" for t in thresholds), "flip_rate",
            "ppl_delta"]


# ---------------------------------------------------------------------- per position, per sequence
def position_metrics(ref_logprobs: torch.Tensor, quant_logprobs: torch.Tensor, targets: torch.Tensor
                     ) -> dict[str, np.ndarray]:
    """[N, P, V] log-probs (any float dtype, any device) and [N, P] targets -> [N, P] arrays.

    kl, flip (0/1), nll_ref, nll_quant in float64 (KL of near-identical distributions is a
    difference of close numbers); ref_top1, quant_top1 as int64 token ids.
    """
    if ref_logprobs.shape != quant_logprobs.shape or ref_logprobs.dim() != 3 or targets.shape != ref_logprobs.shape[:2]:
        raise ValueError(f"ref {tuple(ref_logprobs.shape)} and quant {tuple(quant_logprobs.shape)} must be [N, P, V] "
                         f"and targets [N, P], got {tuple(targets.shape)}")
    out: dict[str, list] = {k: [] for k in ("kl", "flip", "nll_ref", "nll_quant", "ref_top1", "quant_top1")}
    for i in range(ref_logprobs.shape[0]):  # one sequence at a time keeps float64 [P, V] small
        r = torch.log_softmax(ref_logprobs[i].double(), -1)
        q = torch.log_softmax(quant_logprobs[i].to(r.device).double(), -1)
        t = targets[i].to(r.device)[:, None]
        rt, qt = r.argmax(-1), q.argmax(-1)
        out["kl"].append((r.exp() * (r - q)).sum(-1).clamp_min(0.0).cpu())
        out["flip"].append((rt != qt).double().cpu())
        out["nll_ref"].append(-r.gather(-1, t).squeeze(-1).cpu())
        out["nll_quant"].append(-q.gather(-1, t).squeeze(-1).cpu())
        out["ref_top1"].append(rt.cpu())
        out["quant_top1"].append(qt.cpu())
    return {k: torch.stack(v).numpy() for k, v in out.items()}


def sequence_aggregates(metrics: Mapping[str, np.ndarray], thresholds: Sequence[float] = KL_THRESHOLDS
                        ) -> dict[str, np.ndarray]:
    """[N, P] per-position metrics -> [N] per-sequence sums: n_positions, kl_sum, kl_max, flip_count,
    nll_ref_sum, nll_quant_sum and one count of positions with KL above each threshold."""
    kl = np.asarray(metrics["kl"], dtype=float)
    if kl.ndim != 2 or kl.shape[1] == 0:
        raise ValueError(f"per-position metrics must be [sequences, positions] with positions > 0, got {kl.shape}")
    out = {"n_positions": np.full(kl.shape[0], kl.shape[1], dtype=float), "kl_sum": kl.sum(1), "kl_max": kl.max(1),
           "flip_count": np.asarray(metrics["flip"], dtype=float).sum(1),
           "nll_ref_sum": np.asarray(metrics["nll_ref"], dtype=float).sum(1),
           "nll_quant_sum": np.asarray(metrics["nll_quant"], dtype=float).sum(1)}
    for th in thresholds:
        out[threshold_key(th)] = (kl > th).sum(1).astype(float)
    return out


def per_sequence(metrics: Mapping[str, np.ndarray], metric: str = "kl") -> np.ndarray:
    """Per-sequence mean of one per-position metric ([N])."""
    return np.asarray(metrics[metric], dtype=float).mean(axis=1)


# ---------------------------------------------------------------------- one configuration
@dataclass(frozen=True)
class Estimate:
    statistic: str
    value: float
    ci_low: float
    ci_high: float
    n_sequences: int
    n_positions: int
    method: str = SUMMARY_METHOD


def _smooth_statistics(agg: Mapping[str, np.ndarray], thresholds: Sequence[float]):
    """name -> f(idx [..., n] of sequence indices) -> [...]: each statistic from per-sequence sums."""
    def tot(key, idx):
        return agg[key][idx].sum(-1)

    fns = {
        "kl_mean": lambda i: tot("kl_sum", i) / tot("n_positions", i),
        "kl_max": lambda i: agg["kl_max"][i].max(-1),
        "flip_rate": lambda i: tot("flip_count", i) / tot("n_positions", i),
        "ppl_delta": lambda i: (np.exp(tot("nll_quant_sum", i) / tot("n_positions", i))
                                - np.exp(tot("nll_ref_sum", i) / tot("n_positions", i))),
    }
    for th in thresholds:
        fns[f"share_{threshold_key(th)}"] = (lambda k: lambda i: tot(k, i) / tot("n_positions", i))(threshold_key(th))
    return fns


def cluster_summary(metrics: Mapping[str, np.ndarray], *, thresholds: Sequence[float] = KL_THRESHOLDS,
                    confidence: float = 0.95, n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                    statistics: Sequence[str] | None = None) -> list[Estimate]:
    """Each statistic of the per-position metrics ([N, P] arrays) with a cluster-bootstrap CI over sequences.

    Percentile intervals (`scipy.stats.bootstrap`, whole sequences resampled with replacement, all
    statistics on the same resamples). The maximum has no valid bootstrap interval (a resample
    cannot exceed the observed maximum, so the upper end is the estimate itself): its interval only
    says how much it rests on one sequence; the tail listing is what reports it honestly.
    `statistics` restricts the output to those names (default: `statistic_names(thresholds)`).
    """
    names = list(statistics) if statistics is not None else statistic_names(thresholds)
    unknown = set(names) - set(statistic_names(thresholds))
    if unknown:
        raise ValueError(f"unknown statistics {sorted(unknown)}; known: {', '.join(statistic_names(thresholds))}")
    kl = np.asarray(metrics["kl"], dtype=float)
    agg = sequence_aggregates(metrics, thresholds)
    smooth = _smooth_statistics(agg, thresholds)
    quants = [q for q in names if q in _QUANTILES]
    order_stats = _ResampledQuantiles(kl)
    n, npos = kl.shape[0], int(kl.size)

    def statistic(idx: np.ndarray, axis: int = -1) -> np.ndarray:
        idx = np.moveaxis(np.asarray(idx, dtype=np.int64), axis, -1)
        out = {k: smooth[k](idx) for k in names if k in smooth}
        if quants:  # no closed form from sums: order statistics of each resample's positions
            qs = order_stats(idx.reshape(-1, idx.shape[-1]), [_QUANTILES[q] for q in quants])
            for j, q in enumerate(quants):
                out[q] = qs[:, j].reshape(idx.shape[:-1])
        return np.stack([np.asarray(out[k], dtype=float) for k in names])

    values = statistic(np.arange(n))
    if n < 2:
        return [Estimate(k, float(v), math.nan, math.nan, n, npos) for k, v in zip(names, values, strict=True)]
    lo, hi = _bootstrap((np.arange(n),), statistic, SUMMARY_METHOD, confidence, n_resamples, seed, values,
                        batch=max(1, 4_000_000 // npos) if quants else None)
    return [Estimate(k, float(v), float(a), float(b), n, npos)
            for k, v, a, b in zip(names, values, lo, hi, strict=True)]


class _ResampledQuantiles:
    """np.quantile (linear) of the positions of resampled sequences, without concatenating them.

    All positions are sorted once; a resample that draws sequence i c_i times repeats each of its
    positions c_i times, so the k-th smallest value of the concatenation is the first sorted
    position at which the running count of repeats exceeds k. That running count is c @ C, with
    C[i, j] the number of sequence i's positions among the j + 1 smallest: one matrix product and
    a binary search per resample instead of a sort of the concatenation.
    """

    def __init__(self, kl: np.ndarray):
        flat = kl.ravel()
        order = np.argsort(flat, kind="stable")
        self.values = flat[order]
        self.n = kl.shape[0]
        self.running = np.cumsum(np.eye(self.n)[:, order // kl.shape[1]], axis=1)  # [N, positions]

    def __call__(self, idx: np.ndarray, qs: Sequence[float]) -> np.ndarray:
        """idx [B, m] sequence indices -> [B, len(qs)] quantiles."""
        b = idx.shape[0]
        counts = np.bincount((idx + self.n * np.arange(b)[:, None]).ravel(), minlength=b * self.n).reshape(b, self.n)
        cum = counts.astype(float) @ self.running  # [B, positions], exact small integers
        total = cum[:, -1]
        out = np.empty((b, len(qs)))
        for j, q in enumerate(qs):
            h = q * (total - 1)
            k = np.floor(h)
            k1 = np.minimum(k + 1, total - 1)
            for r in range(b):  # rank k is at the first sorted position whose running count exceeds k
                lo, hi = self.values[np.searchsorted(cum[r], [k[r], k1[r]], side="right")]
                out[r, j] = lo + (h[r] - k[r]) * (hi - lo)
        return out


def _bootstrap(data: tuple[np.ndarray, ...], statistic, method: str, confidence: float, n_resamples: int,
               seed: int, values: np.ndarray, paired: bool = False, batch: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """scipy.stats.bootstrap's interval; a statistic every resample agrees on gets a zero-width one."""
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        # degenerate statistics (every resample equal: BCa's acceleration is 0/0) are handled below
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.bootstrap(data, statistic, vectorized=True, paired=paired, n_resamples=n_resamples,
                              batch=batch, confidence_level=confidence, method=method,
                              rng=np.random.default_rng(seed))
    lo, hi = np.atleast_1d(res.confidence_interval.low), np.atleast_1d(res.confidence_interval.high)
    dist = np.atleast_2d(res.bootstrap_distribution)
    same = np.all(dist == dist[:, :1], axis=1)
    v = np.atleast_1d(values)
    return np.where(same, v, lo), np.where(same, v, hi)


def estimates_frame(label: str, estimates: Sequence[Estimate]):
    """One tidy DataFrame row per statistic (pandas imported lazily)."""
    import pandas as pd

    return pd.DataFrame([{"config": label, **asdict(e)} for e in estimates])


# ---------------------------------------------------------------------- two configurations, same positions
@dataclass(frozen=True)
class PairedComparison:
    metric: str
    delta: float
    """b - a: the mean over sequences of per-sequence differences, or the difference of pooled means."""
    ci_low: float
    ci_high: float
    p_value: float
    n_sequences: int
    n_positions: int
    test: str = "sign-flip permutation (scipy.stats.permutation_test)"

    def to_dict(self) -> dict:
        return asdict(self)


def paired_comparison(a: np.ndarray, b: np.ndarray, *, metric: str = "kl_mean", n_positions: int = 0,
                      confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
                      ) -> PairedComparison:
    """b - a over paired per-sequence values: difference, its interval, sign-flip permutation p-value.

    `a`, `b`: [n] per-sequence values (delta = mean of the n differences, paired t interval), or
    [n, 2] per-sequence (sum, positions) pairs (delta = difference of the pooled means sum/positions,
    jackknife t interval; equals the former when every sequence has as many positions).
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    pooled = a.ndim == 2 and a.shape[1:] == (2,)
    if a.shape != b.shape or not (a.ndim == 1 or pooled):
        raise ValueError(f"paired per-sequence values must be equal-shape [n] values or [n, 2] (sum, positions) "
                         f"pairs, got {a.shape} and {b.shape}")
    if pooled and not np.array_equal(a[:, 1], b[:, 1]):
        raise ValueError("paired sequences must have the same positions: the (sum, positions) pairs' counts differ")
    agg = "pooled_mean" if pooled else "mean"
    n = a.shape[0]
    npos = int(a[:, 1].sum()) if pooled and not n_positions else n_positions
    if n == 0:
        return PairedComparison(metric, math.nan, math.nan, math.nan, 1.0, 0, npos)
    delta = float(b[:, 0].sum() / b[:, 1].sum() - a[:, 0].sum() / a[:, 1].sum()) if pooled else float((b - a).mean())
    if n < 2:
        return PairedComparison(metric, delta, math.nan, math.nan, 1.0, n, npos)
    if np.all(a == b):
        return PairedComparison(metric, 0.0, 0.0, 0.0, 1.0, n, npos)
    p = float(permutation_pvalues(a, b, agg, n_resamples=n_resamples, seed=seed))
    iv = jackknife_t_interval(a, b, agg, confidence)
    return PairedComparison(metric, delta, float(iv.low), float(iv.high), p, n, npos)


@dataclass(frozen=True)
class RatioEstimate:
    metric: str
    ratio: float
    """sum(b) / sum(a) over the same positions (= ratio of the pooled means)."""
    ci_low: float
    ci_high: float
    n_sequences: int
    n_positions: int
    method: str = f"paired cluster bootstrap over sequences, {RATIO_METHOD}"

    def to_dict(self) -> dict:
        return asdict(self)


def paired_ratio(a_sums: np.ndarray, b_sums: np.ndarray, *, metric: str = "kl_mean", n_positions: int = 0,
                 confidence: float = 0.95, n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                 method: str = RATIO_METHOD) -> RatioEstimate:
    """sum(b) / sum(a) of per-sequence sums on the same positions, with a paired cluster-bootstrap interval.

    Percentile by default: on simulated clustered KL (log-normal per-sequence levels, 8-32
    sequences) it covered as well as or better than BCa in every setting, by up to 6 points
    (BCa's jackknife acceleration is itself noisy when a few sequences carry most of the sum);
    docs/statistics.md has the figures. nan when sum(a) is 0 (a ratio to nothing), with no interval.
    """
    a = np.asarray(a_sums, dtype=float)
    b = np.asarray(b_sums, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"per-sequence sums must be equal-length 1-D arrays, got {a.shape} and {b.shape}")
    n = a.size
    words = f"paired cluster bootstrap over sequences, {method}"
    if n == 0 or a.sum() <= 0:
        return RatioEstimate(metric, math.nan, math.nan, math.nan, n, n_positions, words)
    r = float(b.sum() / a.sum())
    if n < 2:
        return RatioEstimate(metric, r, math.nan, math.nan, n, n_positions, words)

    def statistic(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):  # a resample of all-zero denominators
            return y.sum(axis) / x.sum(axis)

    lo, hi = _bootstrap((a, b), statistic, method, confidence, n_resamples, seed, np.array([r]), paired=True)
    return RatioEstimate(metric, r, float(lo[0]), float(hi[0]), n, n_positions, words)


@dataclass(frozen=True)
class FidelityComparison:
    """variant vs base on the same positions: what the fidelity comparison table shows."""

    kl: PairedComparison
    kl_ratio: RatioEstimate
    flip: PairedComparison
    n_sequences: int
    n_positions: int

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"n_sequences": self.n_sequences, "n_positions": self.n_positions}
        for name, c in (("kl_delta", self.kl), ("flip_delta", self.flip)):
            d.update({name: c.delta, f"{name}_ci_low": c.ci_low, f"{name}_ci_high": c.ci_high,
                      f"{name}_p": c.p_value})
        d.update(kl_ratio=self.kl_ratio.ratio, kl_ratio_ci_low=self.kl_ratio.ci_low,
                 kl_ratio_ci_high=self.kl_ratio.ci_high, kl_ratio_method=self.kl_ratio.method)
        return d


def compare_fidelity(base: Mapping[str, Sequence[float]], variant: Mapping[str, Sequence[float]], *,
                     confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES,
                     bootstrap_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> FidelityComparison:
    """KL mean difference, KL ratio and flip-rate difference of two `sequence_aggregates` on the same positions.

    The two differences carry the sign-flip p-value over sequences (for the ratio, H0 "ratio 1" is
    H0 "difference 0": the KL difference's p-value tests it).
    """
    n_b = np.asarray(base["n_positions"], dtype=float)
    n_v = np.asarray(variant["n_positions"], dtype=float)
    if n_b.shape != n_v.shape or not np.array_equal(n_b, n_v):
        raise ValueError(f"not the same positions: per-sequence position counts differ ({n_b.shape[0]} vs "
                         f"{n_v.shape[0]} sequences, {int(n_b.sum())} vs {int(n_v.sum())} positions)")
    npos = int(n_b.sum())

    def pairs(d: Mapping[str, Sequence[float]], key: str) -> np.ndarray:
        return np.stack([np.asarray(d[key], dtype=float), n_b], axis=1)

    kw = {"n_positions": npos, "confidence": confidence, "n_resamples": n_resamples, "seed": seed}
    kl = paired_comparison(pairs(base, "kl_sum"), pairs(variant, "kl_sum"), metric="kl_mean", **kw)
    flip = paired_comparison(pairs(base, "flip_count"), pairs(variant, "flip_count"), metric="flip_rate", **kw)
    ratio = paired_ratio(np.asarray(base["kl_sum"], dtype=float), np.asarray(variant["kl_sum"], dtype=float),
                         n_positions=npos, confidence=confidence, n_resamples=bootstrap_resamples, seed=seed)
    return FidelityComparison(kl, ratio, flip, int(n_b.size), npos)


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
                 n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list[BinEstimate]:
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
