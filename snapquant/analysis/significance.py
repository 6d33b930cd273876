"""Paired tests, intervals and minimum detectable effects for two runs scored on the SAME samples.

Both runs score identical documents, so everything here pairs them (sample i of the baseline with
sample i of the variant); pairing removes the between-document variance that dominates unpaired
stderr, which is why a 0.5-point delta can be real while both stderrs are 2 points.

Tests (each keeps its level at any n; `tests/test_analysis_significance.py` simulates the null at
n = 8, 16 and 64 and checks a type-I rate of at most 6% at alpha 0.05):

- 0/1 per-sample metrics averaged (acc, exact_match) -> **exact McNemar test**: only discordant
  pairs carry information; under H0 a discordant pair favours either run with probability 1/2, so
  the count favouring the variant is Binomial(n_discordant, 1/2). Exact and conservative.
- Anything else (continuous per-sample scores, perplexity's (loglik, n_words) pairs) -> **paired
  sign-flip permutation test** (`scipy.stats.permutation_test`, `permutation_type='samples'`):
  under H0 the two runs are exchangeable on each document, so swapping the two runs' items of any
  subset of documents leaves the distribution of `aggregate(variant) - aggregate(base)` unchanged.
  The task's own aggregate (mean, weighted perplexity, bits per byte, ...) is recomputed for every
  swap pattern. Exact (all 2^n patterns) when 2^n <= n_resamples, i.e. n <= 13 at the default;
  otherwise randomized with the (b + 1) / (R + 1) p-value, which keeps its level for any R.

A percentile-bootstrap p-value (the share of resampled deltas beyond zero) is not used: its
distribution is centred on the observed delta, narrower than the sampling distribution by
sqrt((n - 1) / n) and without t tails, so under H0 it rejected 12% of the time at n = 8 and 7.3%
at n = 16 (nominal 5%).

Intervals (95%) of the same delta, chosen by their simulated coverage at small n
(docs/statistics.md, "Intervals"): Bonett-Price adjusted Wald for 0/1 metrics (closed form,
conservative at small n); jackknife t (delta +- t_{n-1} SE_jackknife, the paired t interval for
means) for the smooth aggregates (mean, perplexity, weighted perplexity, bits per byte); BCa
bootstrap (`scipy.stats.bootstrap`) for any other aggregate. BCa itself covered only 81-88% at
n = 8 and 84-92% at n = 16. The p-value comes from the test above, so near alpha an interval
and the test can disagree.

Minimum detectable effect (MDE) at level alpha and power 0.8, in the metric's units:
- 0/1 metrics, exact McNemar (`mde_paired_binary`): each pair is discordant with probability
  psi = max(psi_obs, delta) and a discordant pair favours the change with probability
  q = (psi + delta) / (2 psi); power(delta) = sum_m Binom(m; n, psi) * P_reject(m, q) with
  P_reject(m, q) = P(K <= c_m) + P(K >= m - c_m), K ~ Binom(m, q), c_m the largest k with
  2 P(Binom(m, 1/2) <= k) <= alpha. The MDE is the delta where power reaches 0.8. psi_obs is the
  observed discordance rate (the nuisance parameter); a change of delta needs at least delta
  discordance, hence the max. For large n this agrees with Connor's (1987) normal approximation
  n = (z_{1-alpha/2} sqrt(psi) + z_power sqrt(psi - delta^2))^2 / delta^2.
- Everything else (`mde_paired_continuous`): (t_{1-alpha/2, n-1} + t_{power, n-1}) * SE(delta)
  (Bloom 1995), SE of the interval above (sd / sqrt(n) for means, jackknife for ratios). At this
  effect the paired t-test's exact (noncentral t) power is 0.80 for n >= 8; the sign-flip test's
  is about the same (simulated 0.79-0.80 at n = 16 and 64).
Both are inf when no outcome can reach alpha (exact McNemar needs 6 one-sided discordant pairs and
the sign-flip test needs n >= 6 at alpha 0.05).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

DEFAULT_RESAMPLES = 9999
"""Permutation / bootstrap resamples: the sign-flip test is exact up to n = 13 (2^13 = 8192)."""
POWER = 0.8


@dataclass(frozen=True)
class PairedTest:
    test: str
    """'mcnemar_exact' or 'sign_flip_permutation' (or 'none' when nothing could be paired)."""
    n: int
    """Number of paired samples."""
    delta: float
    """variant aggregate - baseline aggregate."""
    p_value: float
    ci_low: float = math.nan
    ci_high: float = math.nan
    discordant: tuple[int, int] | None = None
    """McNemar: (baseline right & variant wrong, baseline wrong & variant right)."""
    exact: bool = True
    """False when the permutation p-value comes from random sign patterns rather than all 2^n."""
    se: float = math.nan
    """Standard error of delta (continuous metrics), the MDE's nuisance parameter."""
    mde: float = math.nan
    """Minimum detectable |delta| at alpha 0.05 and power 0.8 for this n and nuisance parameter."""
    interval: str = ""
    """How ci_low / ci_high were computed (a key of INTERVAL_WORDS)."""

    def significant(self, alpha: float = 0.05) -> bool:
        return self.n > 0 and self.p_value < alpha

    def to_dict(self) -> dict[str, Any]:
        return {"test": self.test, "n": self.n, "delta": self.delta, "p_value": self.p_value,
                "ci_low": self.ci_low, "ci_high": self.ci_high,
                "discordant": list(self.discordant) if self.discordant else None, "exact": self.exact,
                "se": self.se, "mde": self.mde, "interval": self.interval}


# ---------------------------------------------------------------------- McNemar
def mcnemar_exact(base: Sequence[float], variant: Sequence[float], *, alpha: float = 0.05) -> PairedTest:
    """Two-sided exact McNemar test on paired 0/1 outcomes (no interval; `paired_test` adds one)."""
    a = np.asarray(base, dtype=float)
    b = np.asarray(variant, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired samples must have equal length, got {a.shape} and {b.shape}")
    n01 = int(((a == 1) & (b == 0)).sum())  # baseline right, variant wrong
    n10 = int(((a == 0) & (b == 1)).sum())
    p = binom_two_sided(min(n01, n10), n01 + n10)
    delta = float(b.mean() - a.mean()) if a.size else math.nan
    mde = mde_paired_binary(a.size, (n01 + n10) / a.size, alpha=alpha) if a.size else math.nan
    return PairedTest("mcnemar_exact", int(a.size), delta, p, discordant=(n01, n10), mde=mde)


def mcnemar_pvalues(base: np.ndarray, variant: np.ndarray) -> np.ndarray:
    """Exact McNemar p-values of paired 0/1 arrays [..., n], batched over the leading axes."""
    a, b = np.asarray(base, dtype=float), np.asarray(variant, dtype=float)
    n01 = ((a == 1) & (b == 0)).sum(-1)
    n10 = ((a == 0) & (b == 1)).sum(-1)
    # Binomial(m, 1/2) is symmetric, so twice the lower tail of the smaller count is the two-sided p.
    return np.minimum(1.0, 2.0 * stats.binom.cdf(np.minimum(n01, n10), n01 + n10, 0.5))


def binom_two_sided(k: int, n: int) -> float:
    """P(X <= k or X >= n - k) for X ~ Binomial(n, 1/2), k <= n/2: the exact two-sided sign test."""
    if n == 0:
        return 1.0
    # Sum in log space: exact enough for any n a benchmark has, no overflow of 2^n.
    log_terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2)
                 for i in range(k + 1)]
    m = max(log_terms)
    tail = math.exp(m) * sum(math.exp(t - m) for t in log_terms)
    return min(1.0, 2.0 * tail)


# ---------------------------------------------------------------------- aggregates
# lm-eval's smooth aggregations as functions of the column sums s [..., cols] of n items: vectorised
# over any leading axes, and leave-one-out is f(s - x_i, n - 1) (the jackknife in O(n)).
# `tests/test_analysis_significance.py` checks each against lm-eval's own function.
_SUM_AGGREGATES: dict[str, tuple[int, Callable[[np.ndarray, int], np.ndarray]]] = {
    "mean": (1, lambda s, n: s[..., 0] / n),
    "perplexity": (1, lambda s, n: np.exp(-s[..., 0] / n)),
    "weighted_perplexity": (2, lambda s, n: np.exp(-s[..., 0] / s[..., 1])),
    "bits_per_byte": (2, lambda s, n: -s[..., 0] / s[..., 1] / math.log(2)),
    # (sum, count) pairs -> sum / count over all items: a mean over positions of per-sequence sums
    "pooled_mean": (2, lambda s, n: s[..., 0] / s[..., 1]),
}


def _columns(v: np.ndarray, cols: int) -> np.ndarray:
    """[..., n] numbers or [..., n, 2] pairs -> [..., n, cols]."""
    return v[..., None] if cols == 1 else v


def _vector_aggregate(name: str) -> tuple[int, Callable[[np.ndarray], np.ndarray]]:
    cols, f = _SUM_AGGREGATES[name]
    return cols, lambda v: f(_columns(v, cols).sum(-2), _columns(v, cols).shape[-2])


_VECTOR_AGGREGATES = {name: _vector_aggregate(name) for name in _SUM_AGGREGATES}


def aggregation_fn(name: str) -> Callable[[list[Any]], float]:
    """lm-eval's aggregation of that name (so our deltas equal lm-eval's reported scores)."""
    if name == "mean":
        return _mean
    try:
        import lm_eval.api.metrics  # noqa: F401  (registers the aggregations)
        from lm_eval.api.registry import get_aggregation

        fn = get_aggregation(name)
    except Exception:  # lm-eval missing or name unknown: fall back to the common cases
        fn = None
    if fn is not None:
        return fn
    if name == "perplexity":
        return lambda items: math.exp(-_mean(items))
    if name == "weighted_perplexity":
        return lambda items: math.exp(-sum(a for a, _ in items) / sum(b for _, b in items))
    if name == "bits_per_byte":
        return lambda items: -sum(a for a, _ in items) / sum(b for _, b in items) / math.log(2)
    if name == "pooled_mean":
        return lambda items: sum(a for a, _ in items) / sum(b for _, b in items)
    return _mean


def _mean(items: list[Any]) -> float:
    return float(np.mean(np.asarray(items, dtype=float)))


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, np.integer, np.floating))


def _numeric(items: Sequence[Any], columns: int) -> np.ndarray | None:
    """Items as a float array [n] (columns 1) or [n, 2] (columns 2), or None when they are not."""
    if columns == 1 and all(_is_number(x) for x in items):
        return np.asarray(items, dtype=float)
    if columns == 2 and all(isinstance(x, (tuple, list)) and len(x) == 2 and all(map(_is_number, x)) for x in items):
        return np.asarray(items, dtype=float).reshape(-1, 2)
    return None


# ---------------------------------------------------------------------- sign-flip permutation test
def permutation_pvalues(base: np.ndarray, variant: np.ndarray, aggregation: str = "mean", *,
                        n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> np.ndarray:
    """Two-sided paired permutation p-values of agg(variant) - agg(base), batched over leading axes.

    `base`, `variant`: [..., n] numbers, or [..., n, 2] (value, weight) pairs for the ratio
    aggregates (weighted_perplexity, bits_per_byte). Every batch element is tested on the same
    sign patterns (each p-value is valid on its own). Exact when 2^n <= n_resamples.
    """
    if aggregation not in _SUM_AGGREGATES:
        raise ValueError(f"aggregation {aggregation!r} has no vectorised form; known: {', '.join(_SUM_AGGREGATES)}")
    cols, f = _SUM_AGGREGATES[aggregation]
    a, b = np.asarray(base, dtype=float), np.asarray(variant, dtype=float)
    if a.shape != b.shape or a.ndim < cols:
        raise ValueError(f"paired samples must have equal shapes with the sample axis last"
                         f"{' but one' if cols == 2 else ''}, got {a.shape} and {b.shape}")
    if cols == 2 and a.shape[-1] != 2:
        raise ValueError(f"{aggregation} takes (value, weight) pairs [..., n, 2], got shape {a.shape}")
    sample_shape = a.shape[a.ndim - cols:]
    batch_shape = a.shape[:a.ndim - cols]
    n = sample_shape[0]
    if n < 2:  # one pair: its two sign patterns give +-delta, equally extreme, so p = 1 exactly
        return np.ones(batch_shape)
    nb = int(np.prod(batch_shape, dtype=np.int64))
    ca = _columns(a, cols).reshape(nb, n, cols)
    cb = _columns(b, cols).reshape(nb, n, cols)
    total, s_var = ca.sum(1) + cb.sum(1), cb.sum(1)  # [nb, cols]
    gain = ca - cb  # what swapping pair i adds to the variant's column sums
    # Index trick: pair i of batch element j is base at j*2n + i and variant at j*2n + n + i; scipy
    # swaps the two indices of a pair, and a "variant" index in the base half marks a swapped pair.
    # The aggregates depend on column sums only, so each pattern costs one masked sum per column.
    base_idx = (np.arange(nb)[:, None] * 2 * n + np.arange(n)[None, :])
    var_idx = base_idx + n

    def statistic(x, y, axis):
        swapped = (x.astype(np.int64) % (2 * n) < n).astype(float)  # [..., nb, n]
        sv = s_var + np.stack([(swapped * gain[..., k]).sum(-1) for k in range(cols)], -1)
        return f(sv, n) - f(total - sv, n)

    # Bound memory: each call sees `batch` sign patterns for all nb comparisons.
    batch = max(1, int(4_000_000 // max(1, nb * n * cols)))
    res = stats.permutation_test((var_idx, base_idx), statistic, permutation_type="samples", vectorized=True,
                                 n_resamples=n_resamples, alternative="two-sided", axis=-1, batch=batch,
                                 rng=np.random.default_rng(seed))
    p = np.asarray(res.pvalue, dtype=float)
    return np.where(np.isfinite(p), p, 1.0).reshape(batch_shape)


def _generic_permutation_pvalue(base: list[Any], variant: list[Any], agg: Callable[[list[Any]], float],
                                n_resamples: int, seed: int) -> float:
    """The same test for an aggregate with no vectorised form (one Python call per sign pattern)."""
    n = len(base)
    if n < 2:  # see permutation_pvalues: p = 1 exactly, and scipy refuses one observation
        return 1.0
    items = list(base) + list(variant)

    def statistic(x, y):
        return agg([items[int(i)] for i in x]) - agg([items[int(i)] for i in y])

    res = stats.permutation_test((np.arange(n) + n, np.arange(n)), statistic, permutation_type="samples",
                                 vectorized=False, n_resamples=n_resamples, alternative="two-sided",
                                 rng=np.random.default_rng(seed))
    p = float(res.pvalue)
    return p if math.isfinite(p) else 1.0


def sign_flip_is_exact(n: int, n_resamples: int = DEFAULT_RESAMPLES) -> bool:
    """Whether `permutation_pvalues` enumerates all 2^n sign patterns (scipy's rule)."""
    return n < 63 and 2 ** n <= n_resamples


# ---------------------------------------------------------------------- intervals
@dataclass(frozen=True)
class DeltaInterval:
    low: Any
    high: Any
    se: Any
    """Standard error of the delta (nan for Bonett-Price, whose width is not a multiple of one)."""
    method: str


INTERVAL_WORDS = {"bonett_price": "Bonett-Price adjusted Wald", "t": "paired t",
                  "jackknife_t": "jackknife t", "bca_bootstrap": "BCa bootstrap"}


def bonett_price_interval(base: np.ndarray, variant: np.ndarray, confidence: float = 0.95) -> DeltaInterval:
    """Interval for p_variant - p_base of paired 0/1 outcomes [..., n] (Bonett & Price 2012).

    Adds one pseudo-observation to each discordant cell: p12 = (n_lost + 1) / (n + 2),
    p21 = (n_gained + 1) / (n + 2), d = p21 - p12, d +- z sqrt((p12 + p21 - d^2) / (n + 2)), clipped
    to [-1, 1]. Closed form; coverage >= nominal at small n (unlike BCa on {-1, 0, 1} data, which
    degenerates when few pairs are discordant).
    """
    a, b = np.asarray(base, dtype=float), np.asarray(variant, dtype=float)
    n = a.shape[-1]
    lost = ((a == 1) & (b == 0)).sum(-1)
    gained = ((a == 0) & (b == 1)).sum(-1)
    p12, p21 = (lost + 1) / (n + 2), (gained + 1) / (n + 2)
    d = p21 - p12
    half = stats.norm.ppf(0.5 + confidence / 2) * np.sqrt(np.maximum(p12 + p21 - d * d, 0.0) / (n + 2))
    return DeltaInterval(np.maximum(d - half, -1.0), np.minimum(d + half, 1.0), np.full(np.shape(d), math.nan),
                    "bonett_price")


def jackknife_t_interval(base: np.ndarray, variant: np.ndarray, aggregation: str = "mean",
                         confidence: float = 0.95) -> DeltaInterval:
    """delta +- t_{n-1} * SE_jackknife for a smooth aggregate, batched over leading axes.

    `base`, `variant`: [..., n] numbers or [..., n, 2] pairs, as `permutation_pvalues` takes them.
    For the mean the jackknife SE is sd / sqrt(n) exactly, so this is the paired t interval. At
    n = 8-16 it covers better than BCa (which, like the percentile bootstrap, uses normal
    quantiles and a sqrt((n-1)/n)-narrow spread): docs/statistics.md ("Intervals") has the
    simulated coverages.
    """
    cols, f = _SUM_AGGREGATES[aggregation]
    a = _columns(np.asarray(base, dtype=float), cols)
    b = _columns(np.asarray(variant, dtype=float), cols)
    n = a.shape[-2]
    sa, sb = a.sum(-2), b.sum(-2)
    delta = f(sb, n) - f(sa, n)
    if n < 2:
        nan = np.full(np.shape(delta), math.nan)
        return DeltaInterval(nan, nan, nan, "t" if aggregation == "mean" else "jackknife_t")
    if aggregation == "mean":
        se = np.std(b[..., 0] - a[..., 0], axis=-1, ddof=1) / math.sqrt(n)
    else:
        loo = f(sb[..., None, :] - b, n - 1) - f(sa[..., None, :] - a, n - 1)  # [..., n]
        se = np.sqrt((n - 1) / n * ((loo - loo.mean(-1, keepdims=True)) ** 2).sum(-1))
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * se
    return DeltaInterval(delta - half, delta + half, se, "t" if aggregation == "mean" else "jackknife_t")


def bootstrap_interval(base: Sequence[Any], variant: Sequence[Any], aggregation: str | None = None, *,
                       confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                       method: str = "BCa") -> DeltaInterval:
    """BCa bootstrap (`scipy.stats.bootstrap`) of agg(variant) - agg(base), documents resampled in pairs.

    For aggregates with no smooth vectorised form (F1, BLEU, median, ...). Falls back to the
    percentile interval when BCa degenerates, and to zero width when every resample agrees.
    """
    if len(base) != len(variant):
        raise ValueError(f"paired samples must have equal length, got {len(base)} and {len(variant)}")
    n = len(base)
    if n < 2:
        return DeltaInterval(math.nan, math.nan, math.nan, "bca_bootstrap")
    agg = aggregation_fn(aggregation or "mean")
    bl, vl = list(base), list(variant)

    def statistic(idx):
        return agg([vl[int(i)] for i in idx]) - agg([bl[int(i)] for i in idx])

    for meth in dict.fromkeys((method, "percentile")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DegenerateDataWarning: handled by the fallback
            res = stats.bootstrap((np.arange(n),), statistic, vectorized=False, n_resamples=n_resamples,
                                  confidence_level=confidence, method=meth, rng=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return DeltaInterval(lo, hi, float(res.standard_error), "bca_bootstrap")
    d = float(statistic(np.arange(n)))
    return DeltaInterval(d, d, 0.0, "bca_bootstrap")


def paired_interval(base: Sequence[Any], variant: Sequence[Any], aggregation: str | None = None, *,
                    confidence: float = 0.95, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> DeltaInterval:
    """The interval the tables use: Bonett-Price for 0/1 means, jackknife t for smooth aggregates, else BCa."""
    if len(base) != len(variant):
        raise ValueError(f"paired samples must have equal length, got {len(base)} and {len(variant)}")
    name = aggregation or "mean"
    binary = all(_is_number(x) and float(x) in (0.0, 1.0) for x in (*base, *variant))
    if binary and name == "mean" and len(base):
        iv = bonett_price_interval(np.asarray(base, dtype=float), np.asarray(variant, dtype=float), confidence)
        return DeltaInterval(float(iv.low), float(iv.high), math.nan, iv.method)
    cols = _VECTOR_AGGREGATES.get(name, (0, None))[0]
    a, b = (_numeric(base, cols), _numeric(variant, cols)) if cols else (None, None)
    if a is not None and b is not None:
        iv = jackknife_t_interval(a, b, name, confidence)
        return DeltaInterval(float(iv.low), float(iv.high), float(iv.se), iv.method)
    return bootstrap_interval(base, variant, name, confidence=confidence, n_resamples=n_resamples, seed=seed)


# ---------------------------------------------------------------------- minimum detectable effect
def mde_paired_binary(n: int, discordance: float, *, alpha: float = 0.05, power: float = POWER) -> float:
    """Smallest |delta| in proportion that the exact McNemar test detects with `power` (module docstring)."""
    if n <= 0 or not math.isfinite(discordance):
        return math.nan
    psi_obs = min(max(float(discordance), 0.0), 1.0)
    m = np.arange(n + 1)
    # c_m: largest lower-tail count with two-sided p <= alpha (-1 when none, e.g. m < 6 at 0.05).
    k = stats.binom.ppf(alpha / 2, m, 0.5)
    c = np.where(2 * stats.binom.cdf(k, m, 0.5) <= alpha * (1 + 1e-12), k, k - 1)

    def power_at(delta: float) -> float:
        psi = max(psi_obs, delta)
        q = min(1.0, (psi + delta) / (2 * psi))
        reject = np.where(c >= 0, stats.binom.cdf(c, m, q) + stats.binom.sf(m - c - 1, m, q), 0.0)
        return float((stats.binom.pmf(m, n, psi) * reject).sum())

    if power_at(1.0) < power:
        return math.inf
    lo, hi = 0.0, 1.0
    for _ in range(40):  # power increases with delta: bisection to 1e-12
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if power_at(mid) >= power else (mid, hi)
    return hi


def mde_paired_continuous(se: float, n: int, *, alpha: float = 0.05, power: float = POWER) -> float:
    """(t_{1-alpha/2, n-1} + t_{power, n-1}) * se; inf when the sign-flip test cannot reach alpha."""
    if n < 2 or not math.isfinite(se):
        return math.nan
    if 2.0 ** (1 - n) > alpha:  # the most extreme of 2^n sign patterns still has p > alpha
        return math.inf
    return float((stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * se)


# ---------------------------------------------------------------------- one comparison
def paired_permutation(base: Sequence[Any], variant: Sequence[Any], aggregation: str | None = None, *,
                       n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0, alpha: float = 0.05,
                       confidence: float = 0.95) -> PairedTest:
    """Sign-flip permutation test of agg(variant) - agg(base), with its interval and MDE."""
    if len(base) != len(variant):
        raise ValueError(f"paired samples must have equal length, got {len(base)} and {len(variant)}")
    n = len(base)
    name = aggregation or "mean"
    agg = aggregation_fn(name)
    if n == 0:
        return PairedTest("sign_flip_permutation", 0, math.nan, 1.0)
    delta = float(agg(list(variant)) - agg(list(base)))
    cols = _VECTOR_AGGREGATES.get(name, (0, None))[0]
    a, b = (_numeric(base, cols), _numeric(variant, cols)) if cols else (None, None)
    if a is not None and b is not None:
        p = float(permutation_pvalues(a, b, name, n_resamples=n_resamples, seed=seed))
    else:
        p = _generic_permutation_pvalue(list(base), list(variant), agg, n_resamples, seed)
    iv = paired_interval(base, variant, name, confidence=confidence, n_resamples=n_resamples, seed=seed)
    return PairedTest("sign_flip_permutation", n, delta, p, iv.low, iv.high, exact=sign_flip_is_exact(n, n_resamples),
                      se=iv.se, mde=mde_paired_continuous(iv.se, n, alpha=alpha), interval=iv.method)


def paired_test(
    base: Sequence[Any],
    variant: Sequence[Any],
    aggregation: str | None = None,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    alpha: float = 0.05,
) -> PairedTest:
    """Pick the test for the data: exact McNemar for 0/1 means, sign-flip permutation otherwise."""
    binary = all(_is_number(x) and float(x) in (0.0, 1.0) for x in (*base, *variant))
    if binary and aggregation in (None, "mean"):
        exact = mcnemar_exact(base, variant, alpha=alpha)
        iv = paired_interval(base, variant, "mean")
        return PairedTest(exact.test, exact.n, exact.delta, exact.p_value, iv.low, iv.high, exact.discordant,
                          mde=exact.mde, interval=iv.method)
    return paired_permutation(base, variant, aggregation, n_resamples=n_resamples, seed=seed, alpha=alpha)


# ---------------------------------------------------------------------- pairing
def pair_samples(base: Sequence[dict[str, Any]], variant: Sequence[dict[str, Any]], metric: str) -> tuple[list, list]:
    """Align two runs' per-sample records on doc_id (and the doc hash when both have it)."""
    def key(s: dict[str, Any]):
        return (s.get("doc_id"), s.get("doc_hash"))

    vmap = {key(s): s for s in variant if metric in s.get("metrics", {})}
    a, b = [], []
    for s in base:
        k = key(s)
        if metric in s.get("metrics", {}) and k in vmap:
            a.append(_unjson(s["metrics"][metric]))
            b.append(_unjson(vmap[k]["metrics"][metric]))
    return a, b


def _unjson(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_unjson(x) for x in v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def proportion_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion (`scipy.stats.binomtest`)."""
    from scipy import stats

    ci = stats.binomtest(correct, n).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)
