"""Paired significance tests: is a variant's score on the SAME samples really different from the baseline?

Both runs score identical documents, so the tests pair them (sample i of the baseline with sample
i of the variant); pairing removes the between-document variance that dominates unpaired stderr,
which is why a 0.5-point delta can be real while both stderrs are 2 points.

- Binary per-sample metrics (acc, exact_match: every value 0 or 1) -> **exact McNemar test**: only
  the discordant pairs carry information; under H0 a discordant pair is equally likely to favour
  either run, so the count favouring the variant is Binomial(n_discordant, 1/2). Exact, no
  large-sample approximation, which matters at the small limits of CI sweeps.
- Anything else (continuous per-sample scores, perplexity's (loglik, n_words) pairs, F1-style
  corpus metrics) -> **paired bootstrap** (Koehn 2004; Berg-Kirkpatrick et al. 2012): resample
  documents with replacement, the same indices for both runs, recompute the task's own aggregate
  (mean, weighted perplexity, bits per byte, ...) for each, and read the p-value and a 95% CI off the
  distribution of the delta. It makes no normality assumption and handles corpus-level
  aggregates, which a paired t-test cannot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PairedTest:
    test: str
    """'mcnemar_exact' or 'paired_bootstrap' (or 'none' when nothing could be paired)."""
    n: int
    """Number of paired samples."""
    delta: float
    """variant aggregate - baseline aggregate."""
    p_value: float
    ci_low: float = math.nan
    ci_high: float = math.nan
    discordant: tuple[int, int] | None = None
    """McNemar: (baseline right & variant wrong, baseline wrong & variant right)."""

    def significant(self, alpha: float = 0.05) -> bool:
        return self.n > 0 and self.p_value < alpha

    def to_dict(self) -> dict[str, Any]:
        return {"test": self.test, "n": self.n, "delta": self.delta, "p_value": self.p_value,
                "ci_low": self.ci_low, "ci_high": self.ci_high,
                "discordant": list(self.discordant) if self.discordant else None}


def mcnemar_exact(base: Sequence[float], variant: Sequence[float]) -> PairedTest:
    """Two-sided exact McNemar test on paired 0/1 outcomes."""
    a = np.asarray(base, dtype=float)
    b = np.asarray(variant, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired samples must have equal length, got {a.shape} and {b.shape}")
    n01 = int(((a == 1) & (b == 0)).sum())  # baseline right, variant wrong
    n10 = int(((a == 0) & (b == 1)).sum())
    p = binom_two_sided(min(n01, n10), n01 + n10)
    delta = float(b.mean() - a.mean()) if a.size else math.nan
    return PairedTest("mcnemar_exact", int(a.size), delta, p, discordant=(n01, n10))


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


def paired_bootstrap(
    base: Sequence[Any],
    variant: Sequence[Any],
    aggregate: Callable[[list[Any]], float] | None = None,
    *,
    iters: int = 10_000,
    seed: int = 0,
) -> PairedTest:
    """Paired bootstrap of `aggregate(variant) - aggregate(base)` over resampled documents.

    The two-sided p-value is twice the smaller tail mass of the bootstrap deltas on either side of
    zero (the percentile-interval inversion), floored at 1/iters since a finite bootstrap cannot
    resolve smaller values.
    """
    if len(base) != len(variant):
        raise ValueError(f"paired samples must have equal length, got {len(base)} and {len(variant)}")
    n = len(base)
    agg = aggregate or _mean
    if n == 0:
        return PairedTest("paired_bootstrap", 0, math.nan, 1.0)
    delta = float(agg(list(variant)) - agg(list(base)))
    rng = np.random.default_rng(seed)
    fast = aggregate is None and all(_is_number(x) for x in base) and all(_is_number(x) for x in variant)
    if fast:  # vectorised mean difference
        d = np.asarray(variant, dtype=float) - np.asarray(base, dtype=float)
        idx = rng.integers(0, n, size=(iters, n))
        deltas = d[idx].mean(axis=1)
    else:
        base_l, var_l = list(base), list(variant)
        deltas = np.empty(iters)
        for i in range(iters):
            idx = rng.integers(0, n, size=n)
            deltas[i] = agg([var_l[j] for j in idx]) - agg([base_l[j] for j in idx])
    deltas = deltas[np.isfinite(deltas)]
    if deltas.size == 0:
        return PairedTest("paired_bootstrap", n, delta, math.nan)
    if np.all(deltas == 0):
        p = 1.0
    else:
        lo_tail = float((deltas <= 0).mean())
        hi_tail = float((deltas >= 0).mean())
        p = min(1.0, max(2 * min(lo_tail, hi_tail), 1.0 / deltas.size))
    lo, hi = np.quantile(deltas, [0.025, 0.975])
    return PairedTest("paired_bootstrap", n, delta, p, float(lo), float(hi))


def paired_test(
    base: Sequence[Any],
    variant: Sequence[Any],
    aggregation: str | None = None,
    *,
    iters: int = 10_000,
    seed: int = 0,
) -> PairedTest:
    """Pick the test for the data: exact McNemar for 0/1 means, paired bootstrap otherwise."""
    binary = all(_is_number(x) and float(x) in (0.0, 1.0) for x in (*base, *variant))
    if binary and aggregation in (None, "mean"):
        exact = mcnemar_exact(base, variant)
        # The p-value is McNemar's; the CI (for plots) comes from the same paired bootstrap.
        boot = paired_bootstrap(base, variant, iters=iters, seed=seed)
        return PairedTest(exact.test, exact.n, exact.delta, exact.p_value, boot.ci_low, boot.ci_high,
                          exact.discordant)
    agg = None if aggregation in (None, "mean") else aggregation_fn(aggregation)
    return paired_bootstrap(base, variant, agg, iters=iters, seed=seed)


def aggregation_fn(name: str) -> Callable[[list[Any]], float]:
    """lm-eval's aggregation of that name (so our deltas equal lm-eval's reported scores)."""
    if name == "mean":
        return _mean
    try:
        from lm_eval.api.registry import get_aggregation

        fn = get_aggregation(name)
    except Exception:  # lm-eval missing or name unknown: fall back to the common cases
        fn = None
    if fn is not None:
        return fn
    if name in ("weighted_perplexity", "perplexity"):
        return lambda items: math.exp(-sum(a for a, _ in items) / sum(b for _, b in items))
    if name == "bits_per_byte":
        return lambda items: -sum(a for a, _ in items) / sum(b for _, b in items) / math.log(2)
    return _mean


def _mean(items: list[Any]) -> float:
    return float(np.mean(np.asarray(items, dtype=float)))


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, np.integer, np.floating))


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
