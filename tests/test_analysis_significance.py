"""The benchmark tables' paired tests and minimum detectable effects on synthetic data with known answers.

The null simulations draw many independent comparisons at once and test them in one batched call
(every batch element gets a valid p-value of its own), so 2000 draws per test and n stay fast.
"""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from snapquant.analysis.significance import (
    _VECTOR_AGGREGATES,
    DeltaInterval,
    aggregation_fn,
    bonett_price_interval,
    bootstrap_interval,
    jackknife_t_interval,
    mcnemar_exact,
    mcnemar_pvalues,
    mde_paired_binary,
    mde_paired_continuous,
    paired_interval,
    paired_permutation,
    paired_test,
    permutation_pvalues,
    sign_flip_is_exact,
)

ALPHA = 0.05
DRAWS = 2000
# Randomized sign-flip p-values keep their level for any number of patterns, so the simulations use
# few; at n = 8 the test enumerates all 256 patterns (exact), as the tables do up to n = 13.
NULL_RESAMPLES = 199


def _resamples(n: int) -> int:
    return 2 ** n if n <= 8 else NULL_RESAMPLES


def _null_binary(rng, n):
    """Two runs with the same per-document success probability: exchangeable pairs."""
    p = rng.beta(2, 2, size=(DRAWS, n))
    return (rng.random((DRAWS, n)) < p).astype(float), (rng.random((DRAWS, n)) < p).astype(float)


def _null_continuous(rng, n):
    """Skewed per-document scores (like per-sequence KL) plus exchangeable run noise."""
    doc = rng.lognormal(-4, 1.5, size=(DRAWS, n))
    return doc + rng.normal(0, 0.01, (DRAWS, n)), doc + rng.normal(0, 0.01, (DRAWS, n))


def _null_loglik_words(rng, n):
    """lm-eval (loglik, n_words) pairs of documents of very different lengths."""
    words = rng.integers(20, 2000, size=(DRAWS, n)).astype(float)
    nats = words * rng.uniform(1.0, 3.0, size=(DRAWS, n))
    a = np.stack([-nats * rng.normal(1, 0.02, (DRAWS, n)), words], -1)
    b = np.stack([-nats * rng.normal(1, 0.02, (DRAWS, n)), words], -1)
    return a, b


@pytest.mark.parametrize("n", [8, 16, 64])
def test_type_one_rate_of_every_table_test_is_at_most_six_percent(n):
    rng = np.random.default_rng(20 + n)
    rates = {}
    a, b = _null_binary(rng, n)
    p = mcnemar_pvalues(a, b)
    rates["mcnemar_exact"] = float((p < ALPHA).mean())
    a, b = _null_continuous(rng, n)
    p = permutation_pvalues(a, b, "mean", n_resamples=_resamples(n), seed=n)
    rates["sign_flip mean"] = float((p < ALPHA).mean())
    for agg in ("weighted_perplexity", "bits_per_byte"):
        a, b = _null_loglik_words(rng, n)
        p = permutation_pvalues(a, b, agg, n_resamples=_resamples(n), seed=n + 1)
        rates[f"sign_flip {agg}"] = float((p < ALPHA).mean())
    assert all(r <= 0.06 for r in rates.values()), rates
    assert rates["sign_flip mean"] > 0.02  # calibrated, not a test that never rejects


def test_batched_mcnemar_equals_the_single_test():
    rng = np.random.default_rng(5)
    a, b = _null_binary(rng, 16)
    p = mcnemar_pvalues(a[:50], b[:50])
    for i in range(50):
        assert p[i] == pytest.approx(mcnemar_exact(a[i], b[i]).p_value, rel=1e-12)


def _brute_force_pvalue(base, variant, agg):
    """Two-sided sign-flip p-value by enumerating all 2^n swaps: twice the smaller tail, capped at 1."""
    n = len(base)
    obs = agg(list(variant)) - agg(list(base))
    null = []
    for swap in itertools.product((False, True), repeat=n):
        v = [base[i] if s else variant[i] for i, s in enumerate(swap)]
        w = [variant[i] if s else base[i] for i, s in enumerate(swap)]
        null.append(agg(v) - agg(w))
    null = np.array(null)
    tol = 1e-12 * abs(obs)
    return min(1.0, 2 * min((null <= obs + tol).mean(), (null >= obs - tol).mean()))


@pytest.mark.parametrize("aggregation", ["mean", "weighted_perplexity", "median"])
def test_exact_sign_flip_equals_enumeration(aggregation):
    rng = np.random.default_rng(7)
    n = 7
    if aggregation == "weighted_perplexity":
        words = rng.integers(10, 200, n)
        base = [(-w * rng.uniform(1, 2), int(w)) for w in words]
        variant = [(ll * rng.normal(1.03, 0.02), w) for ll, w in base]
    else:
        base = list(rng.normal(0, 1, n))
        variant = [x + 0.8 + rng.normal(0, 0.5) for x in base]
    t = paired_permutation(base, variant, aggregation, n_resamples=9999)
    assert t.exact and sign_flip_is_exact(n, 9999) and not sign_flip_is_exact(14, 9999)
    assert t.p_value == pytest.approx(_brute_force_pvalue(base, variant, aggregation_fn(aggregation)), rel=1e-12)
    assert t.p_value < 0.1  # the shift is there; 2/2^7 is the smallest p-value possible


@pytest.mark.parametrize("name", sorted(_VECTOR_AGGREGATES))
def test_vectorised_aggregates_are_lm_evals(name):
    rng = np.random.default_rng(3)
    cols, vec = _VECTOR_AGGREGATES[name]
    if cols == 1:
        items = list(rng.normal(-1, 0.3, 40))
    else:
        items = [(-float(w) * rng.uniform(0.5, 2), int(w)) for w in rng.integers(5, 500, 40)]
    assert float(vec(np.asarray(items, dtype=float))) == pytest.approx(aggregation_fn(name)(items), rel=1e-12)


# ---------------------------------------------------------------------- power and MDE
def test_mcnemar_power_at_its_mde_is_eighty_percent():
    """A true effect of exactly the MDE, with the assumed discordance, is detected 80% of the time."""
    rng = np.random.default_rng(11)
    n, psi = 64, 0.25
    delta = mde_paired_binary(n, psi)
    # Per pair: variant gains (prob (psi + delta)/2), loses (psi - delta)/2, else both agree.
    u = rng.random((4 * DRAWS, n))
    gain, lose = u < (psi + delta) / 2, (u >= (psi + delta) / 2) & (u < psi)
    base = np.where(gain, 0.0, np.where(lose, 1.0, (rng.random((4 * DRAWS, n)) < 0.5)))
    variant = np.where(gain, 1.0, np.where(lose, 0.0, base))
    power = float((mcnemar_pvalues(base, variant) < ALPHA).mean())
    assert abs(power - 0.8) < 0.03, (delta, power)  # 8000 draws: standard error 0.0045


def test_sign_flip_power_at_its_mde():
    """At the MDE the paired t-test has power 0.80 (noncentral t); the sign-flip test nearly so.

    999 patterns here: with few patterns a randomized test gives away power (0.74 at 199).
    """
    rng = np.random.default_rng(12)
    draws = 1000
    for n in (16, 64):
        sd = 0.3
        mde = mde_paired_continuous(sd / math.sqrt(n), n)
        df, ncp = n - 1, mde / (sd / math.sqrt(n))
        t_power = stats.nct.sf(stats.t.ppf(0.975, df), df, ncp) + stats.nct.cdf(-stats.t.ppf(0.975, df), df, ncp)
        assert t_power == pytest.approx(0.8, abs=0.002)
        base = rng.normal(0, 1, (draws, n))
        variant = base + rng.normal(mde, sd, (draws, n))
        power = float((permutation_pvalues(base, variant, n_resamples=999, seed=n) < ALPHA).mean())
        assert 0.74 < power < 0.86, (n, power)  # 1000 draws: standard error 0.013
        double = base + rng.normal(2 * mde, sd, (draws, n))
        assert (permutation_pvalues(base, double, n_resamples=999, seed=n) < ALPHA).mean() > 0.99


def test_mde_binary_known_values():
    # Fewer than 6 pairs: two-sided exact McNemar can never reach 0.05 (2 * 0.5^5 = 0.0625).
    assert mde_paired_binary(5, 0.3) == math.inf
    # No observed discordance: the change itself is all the discordance, one-directional,
    # so power = P(Binomial(n, delta) >= 6).
    for n in (16, 64, 400):
        d = mde_paired_binary(n, 0.0)
        assert stats.binom.sf(5, n, d) == pytest.approx(0.8, abs=1e-6)
    # Large n: Connor's normal approximation n = (z_a sqrt(psi) + z_b sqrt(psi - d^2))^2 / d^2.
    n, psi = 5000, 0.2
    za, zb = stats.norm.ppf(0.975), stats.norm.ppf(0.8)
    connor = next(d for d in np.linspace(1e-4, psi, 200_000)
                  if n * d * d >= (za * math.sqrt(psi) + zb * math.sqrt(psi - d * d)) ** 2)
    assert mde_paired_binary(n, psi) == pytest.approx(connor, rel=0.02)
    assert mde_paired_binary(400, 0.3) > mde_paired_binary(400, 0.05)  # more discordance, larger MDE


def test_mde_continuous_formula():
    assert mde_paired_continuous(1.0, 30) == pytest.approx(stats.t.ppf(0.975, 29) + stats.t.ppf(0.8, 29))
    assert mde_paired_continuous(2.0, 30, alpha=0.01) == pytest.approx(
        2 * (stats.t.ppf(0.995, 29) + stats.t.ppf(0.8, 29)))
    assert mde_paired_continuous(1.0, 5) == math.inf  # 2^(1-5) = 0.0625 > 0.05
    assert math.isnan(mde_paired_continuous(1.0, 1))


def test_paired_test_picks_the_test_and_carries_interval_and_mde():
    rng = np.random.default_rng(4)
    base = (rng.random(200) < 0.6).astype(int).tolist()
    lose = rng.random(200) < 0.15
    variant = [0 if (b_ and l_) else b_ for b_, l_ in zip(base, lose, strict=True)]
    t = paired_test(base, variant)
    assert t.test == "mcnemar_exact" and t.discordant[1] == 0  # answers lost, none gained
    assert t.p_value == pytest.approx(2 * 0.5 ** t.discordant[0])
    assert t.ci_low <= t.delta <= t.ci_high < 0
    assert t.mde == pytest.approx(mde_paired_binary(200, sum(t.discordant) / 200))
    a, b = rng.normal(size=30), rng.normal(size=30)
    cont = paired_test(list(a), list(b), "mean")
    assert cont.test == "sign_flip_permutation" and not cont.exact  # 2^30 patterns: randomized
    assert cont.se == pytest.approx(np.std(b - a, ddof=1) / math.sqrt(30))
    assert cont.mde == pytest.approx(mde_paired_continuous(cont.se, 30))
    assert cont.ci_low <= cont.delta <= cont.ci_high


def test_bootstrap_interval_for_other_aggregates():
    assert bootstrap_interval([1.0, 2.0, 3.0], [2.0, 3.0, 4.0], "median") == DeltaInterval(1.0, 1.0, 0.0, "bca_bootstrap")
    rng = np.random.default_rng(8)
    base = list(rng.normal(0, 1, 40))
    variant = [x + 0.5 + rng.normal(0, 0.2) for x in base]
    iv = bootstrap_interval(base, variant, "median", n_resamples=2000)
    assert iv.method == "bca_bootstrap" and iv.low < 0.5 < iv.high and iv.se > 0
    assert paired_interval(base, variant, "median", n_resamples=2000) == iv


# ---------------------------------------------------------------------- interval coverage
# 95% intervals at n = 8, 16, 64 against the known true delta, 4000 simulated comparisons each
# (standard error of a coverage near 0.95: 0.0035). The bounds are the simulated coverages minus a
# margin: they fail for BCa (0.81-0.88 at n = 8) or for normal quantiles (0.90 at n = 8).
COVERAGE_DRAWS = 4000


@pytest.mark.parametrize("n", [8, 16, 64])
def test_bonett_price_covers_paired_proportions(n):
    rng = np.random.default_rng(30 + n)
    for lost, gained in ((0.05, 0.05), (0.15, 0.05), (0.3, 0.1), (0.02, 0.0)):
        u = rng.random((COVERAGE_DRAWS, n))
        base = (rng.random((COVERAGE_DRAWS, n)) < 0.5).astype(float)
        base = np.where(u < lost, 1.0, np.where(u < lost + gained, 0.0, base))
        variant = np.where(u < lost, 0.0, np.where(u < lost + gained, 1.0, base))
        iv = bonett_price_interval(base, variant)
        cover = ((iv.low <= gained - lost) & (gained - lost <= iv.high)).mean()
        assert cover >= 0.94, (n, lost, gained, cover)
    # One comparison: the same numbers through the table's path.
    t = paired_test(list(base[0]), list(variant[0]))
    assert (t.ci_low, t.ci_high) == (float(iv.low[0]), float(iv.high[0])) and t.interval == "bonett_price"


@pytest.mark.parametrize("n", [8, 16, 64])
def test_t_and_jackknife_t_cover_means_and_ratios(n):
    rng = np.random.default_rng(40 + n)
    d = COVERAGE_DRAWS
    base = rng.normal(0, 1, (d, n))
    iv = jackknife_t_interval(base, base + rng.normal(0.3, 1, (d, n)), "mean")
    assert iv.method == "t" and ((iv.low <= 0.3) & (0.3 <= iv.high)).mean() >= 0.94
    # Per-document nats and words, the variant 2% worse per word on average: the truth is the
    # population weighted perplexity difference, from a large sample of the same model.
    def draw(shape):
        words = rng.integers(20, 2000, shape).astype(float)
        nats = -words * rng.uniform(1, 3, shape)
        return (np.stack([nats, words], -1), np.stack([nats * (1 + rng.normal(0.02, 0.03, shape)), words], -1))
    big_a, big_b = draw((500_000,))
    agg = _VECTOR_AGGREGATES["weighted_perplexity"][1]
    truth = float(agg(big_b) - agg(big_a))
    a, b = draw((d, n))
    iv = jackknife_t_interval(a, b, "weighted_perplexity")
    cover = float(((iv.low <= truth) & (truth <= iv.high)).mean())
    assert iv.method == "jackknife_t" and cover >= (0.88 if n == 8 else 0.91), cover  # BCa: 0.83 / 0.87 / 0.93
    # The batched interval is the one a single comparison gets.
    one = paired_test([tuple(x) for x in a[0]], [tuple(x) for x in b[0]], "weighted_perplexity", n_resamples=99)
    assert one.ci_low == pytest.approx(float(iv.low[0]), rel=1e-9) and one.se == pytest.approx(float(iv.se[0]))


def test_one_pair_gives_p_one_for_every_aggregate():
    """A single paired sample (a sweep run with limit=1): the sign flip has two patterns, +-delta, equally
    extreme, so p = 1 exactly; scipy's permutation_test refuses n = 1, which used to crash the sweep report."""
    from snapquant.analysis.significance import paired_test, permutation_pvalues

    for agg in (None, "median"):
        res = paired_test([1.5], [2.5], agg)
        assert res.n == 1 and res.delta == 1.0 and res.p_value == 1.0
    assert permutation_pvalues(np.zeros((3, 1)), np.ones((3, 1))).tolist() == [1.0, 1.0, 1.0]
