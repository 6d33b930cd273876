"""Interval and paired-test statistics on synthetic per-position data with known answers."""

import numpy as np
import pytest
import torch

from snapquant.analysis.uncertainty import cluster_summary, paired_comparison, per_sequence, position_metrics


def test_position_metrics_known_kl():
    # Two-token vocab: KL(p || q) in closed form.
    p = torch.tensor([0.7, 0.3], dtype=torch.float64).log()
    q = torch.tensor([0.4, 0.6], dtype=torch.float64).log()
    ref = p.expand(2, 3, 2).clone()
    quant = q.expand(2, 3, 2).clone()
    m = position_metrics(ref, quant, torch.zeros(2, 3, dtype=torch.long))
    want = 0.7 * np.log(0.7 / 0.4) + 0.3 * np.log(0.3 / 0.6)
    np.testing.assert_allclose(m["kl"], want, rtol=1e-12)
    assert m["flip"].sum() == 6  # argmax moves from token 0 to token 1
    np.testing.assert_allclose(m["nll_ref"], -np.log(0.7), rtol=1e-12)


def test_cluster_summary_covers_the_truth():
    # KL per position = sequence effect + noise; the mean over many sequences is ~known.
    rng = np.random.default_rng(0)
    seq_mean = rng.exponential(0.01, size=(40, 1))
    kl = seq_mean * rng.exponential(1.0, size=(40, 50))
    m = {"kl": kl, "flip": (kl > 0.02).astype(float), "nll_ref": np.ones_like(kl), "nll_quant": np.ones_like(kl) + kl}
    est = {e.statistic: e for e in cluster_summary(m, n_resamples=500)}
    e = est["kl_mean"]
    assert e.ci_low <= e.value <= e.ci_high and e.n_sequences == 40 and e.n_positions == 2000
    assert e.ci_low < 0.01 < e.ci_high  # population mean 0.01
    assert est["ppl_delta"].value > 0


def test_paired_comparison_detects_a_real_difference():
    rng = np.random.default_rng(1)
    a = rng.exponential(0.01, 32)
    b = a + 0.005 + rng.normal(0, 0.002, 32)
    c = paired_comparison(a, b, n_resamples=999)
    assert c.p_value < 0.01 and c.ci_low < 0.005 < c.ci_high and c.n_sequences == 32


def test_paired_comparison_exact_at_small_n():
    # n = 4, all differences positive: the exact sign-flip p-value is 2 / 2^4.
    c = paired_comparison(np.zeros(4), np.array([1.0, 2.0, 3.0, 4.0]), n_resamples=9999)
    assert c.p_value == pytest.approx(2 / 16)


def test_paired_comparison_uses_the_tables_sign_flip_test():
    """Same p-value as the tables' test (whose null calibration tests/test_analysis_significance.py checks)."""
    from snapquant.analysis.significance import permutation_pvalues

    rng = np.random.default_rng(3)
    a, b = rng.lognormal(-4, 1, 20), rng.lognormal(-4, 1, 20)
    c = paired_comparison(a, b, n_resamples=999, seed=5)
    assert c.p_value == float(permutation_pvalues(a, b, n_resamples=999, seed=5))
    assert c.ci_low <= c.delta <= c.ci_high


def test_per_sequence_means():
    m = {"kl": np.array([[1.0, 3.0], [2.0, 2.0]])}
    np.testing.assert_allclose(per_sequence(m), [2.0, 2.0])


# ---------------------------------------------------------------------- the cluster bootstrap
def _clustered(rng, n_seq: int, n_pos: int, mean: float = 0.01, sigma: float = 0.5) -> dict[str, np.ndarray]:
    """KL = per-sequence level (log-normal, mean 1) x per-position Exp(1) noise: population mean `mean`."""
    level = rng.lognormal(-sigma**2 / 2, sigma, size=(n_seq, 1))
    kl = mean * level * rng.exponential(1.0, size=(n_seq, n_pos))
    flip = (rng.random((n_seq, n_pos)) < 0.2 * level / (1 + level)).astype(float)
    return {"kl": kl, "flip": flip, "nll_ref": np.ones_like(kl), "nll_quant": 1 + kl}


def test_resampled_quantiles_equal_numpy_on_the_concatenated_positions():
    from snapquant.analysis.uncertainty import _ResampledQuantiles

    rng = np.random.default_rng(4)
    kl = rng.exponential(0.01, size=(7, 13))
    kl[2, 3] = kl[1, 1]  # a tie across sequences
    idx = rng.integers(0, 7, size=(40, 7))
    qs = [0.0, 0.5, 0.9, 0.99, 1.0]
    want = np.stack([np.quantile(kl[row].ravel(), qs) for row in idx])
    # the same order statistics, interpolated by the same formula: equal to rounding
    np.testing.assert_allclose(_ResampledQuantiles(kl)(idx, qs), want, rtol=1e-14, atol=0)


def test_cluster_summary_values_are_the_plain_statistics_with_n():
    rng = np.random.default_rng(5)
    m = _clustered(rng, 6, 30)
    est = {e.statistic: e for e in cluster_summary(m, n_resamples=300)}
    kl = m["kl"].ravel()
    for name, want in (("kl_mean", kl.mean()), ("kl_median", np.median(kl)), ("kl_p90", np.quantile(kl, 0.9)),
                       ("kl_p99", np.quantile(kl, 0.99)), ("kl_max", kl.max()), ("share_kl_gt_0.01", (kl > 0.01).mean()),
                       ("flip_rate", m["flip"].mean()), ("ppl_delta", np.exp(1 + kl.mean()) - np.e)):
        e = est[name]
        assert e.value == pytest.approx(want, rel=1e-12), name
        assert e.ci_low <= e.value <= e.ci_high and (e.n_sequences, e.n_positions) == (6, 180), name
    assert est["kl_max"].ci_high == est["kl_max"].value  # no resample exceeds the observed maximum
    assert est["share_kl_gt_1"].value == est["share_kl_gt_1"].ci_high == 0.0
    one = cluster_summary({k: v[:1] for k, v in m.items()}, n_resamples=100)
    assert all(np.isnan(e.ci_low) for e in one)
    with pytest.raises(ValueError, match="unknown statistics"):
        cluster_summary(m, statistics=("kl_mean", "kl_p95"))


def test_cluster_bootstrap_covers_the_known_mean_where_a_per_position_bootstrap_does_not():
    """16 sequences x 50 positions, KL levels shared within a sequence (log-normal sigma 0.5).

    The cluster interval covered 0.90-0.91 of 1000 simulated data sets at this n (the percentile
    interval's small-n shortfall); over these 200 the binomial sd is 2.1 points, so >= 0.82 (4 sd
    below) fails only if it undercovers for real. Treating positions as independent (each its
    own cluster) ignores the between-sequence variance, which dominates here: its intervals are
    about 3x too narrow and cover well under half the time.
    """
    rng = np.random.default_rng(6)
    reps, hit, hit_iid = 200, 0, 0
    for r in range(reps):
        m = _clustered(rng, 16, 50)
        e = cluster_summary(m, n_resamples=500, seed=r, statistics=("kl_mean",))[0]
        hit += e.ci_low <= 0.01 <= e.ci_high
        flat = {k: v.reshape(-1, 1) for k, v in m.items()}
        i = cluster_summary(flat, n_resamples=500, seed=r, statistics=("kl_mean",))[0]
        hit_iid += i.ci_low <= 0.01 <= i.ci_high
    assert hit / reps >= 0.82
    assert hit_iid / reps <= 0.6


# ---------------------------------------------------------------------- paired comparisons
def test_sign_flip_p_values_are_calibrated_under_the_null():
    """8 sequences whose two configurations are exchangeable (same per-sequence level, independent noise).

    At n = 8 the sign-flip test enumerates all 2^8 patterns, so P(p <= alpha) <= alpha exactly and,
    with continuous data, is close to the largest grid point below alpha (p-values are multiples
    of 1/128). 400 null data sets: binomial sd 1.1 points at 0.05, 2.0 at 0.2; the bounds are
    alpha + 3 sd above and -3 sd below (uniform-ish, not merely conservative).
    """
    rng = np.random.default_rng(7)
    reps = 400
    ps = []
    for r in range(reps):
        level = rng.lognormal(0, 1, size=8)
        a = np.stack([level * rng.exponential(1, 8) * 50, np.full(8, 50.0)], 1)  # (KL sum, positions)
        b = np.stack([level * rng.exponential(1, 8) * 50, np.full(8, 50.0)], 1)
        ps.append(paired_comparison(a, b, seed=r).p_value)
    ps = np.array(ps)
    for alpha, sd in ((0.05, 0.011), (0.2, 0.02)):
        rate = (ps <= alpha).mean()
        assert alpha - 3 * sd - 0.01 <= rate <= alpha + 3 * sd, (alpha, rate)


def test_pooled_pairs_equal_the_per_sequence_mean_test_when_sequences_are_equally_long():
    rng = np.random.default_rng(8)
    a, b = rng.exponential(1, 12), rng.exponential(1.5, 12)
    plain = paired_comparison(a, b, n_resamples=999, seed=1)
    pooled = paired_comparison(np.stack([a * 40, np.full(12, 40.0)], 1), np.stack([b * 40, np.full(12, 40.0)], 1),
                               n_resamples=999, seed=1)
    assert pooled.delta == pytest.approx(plain.delta, rel=1e-12) and pooled.p_value == plain.p_value
    assert (pooled.ci_low, pooled.ci_high) == pytest.approx((plain.ci_low, plain.ci_high), rel=1e-9)
    assert pooled.n_positions == 480
    # unequal lengths: the pooled mean weighs long sequences more
    n = np.arange(1.0, 13.0)
    c = paired_comparison(np.stack([a * n, n], 1), np.stack([b * n, n], 1))
    assert c.delta == pytest.approx((b * n).sum() / n.sum() - (a * n).sum() / n.sum(), rel=1e-12)
    with pytest.raises(ValueError, match="same positions"):
        paired_comparison(np.stack([a, n], 1), np.stack([b, n + 1], 1))


def test_ratio_interval_covers_a_known_doubling():
    """KL_B = 2 x KL_A x per-sequence factor (log-normal, mean 1) on the same positions: true ratio 2.

    16 sequences, 200 data sets: the percentile interval covered 0.91-0.92 in simulation at this n
    (docs/statistics.md); >= 0.85 is 3 binomial sd (2.0 points) below.
    """
    from snapquant.analysis.uncertainty import paired_ratio

    rng = np.random.default_rng(9)
    reps, hit = 200, 0
    for r in range(reps):
        level = rng.lognormal(0, 0.5, size=(16, 1))
        factor = rng.lognormal(-0.125, 0.5, size=(16, 1))
        a = (level * rng.exponential(1, (16, 50))).sum(1)
        b = (2 * level * factor * rng.exponential(1, (16, 50))).sum(1)
        e = paired_ratio(a, b, n_resamples=500, seed=r)
        assert e.ratio == pytest.approx(b.sum() / a.sum(), rel=1e-14) and e.ci_low <= e.ratio <= e.ci_high
        hit += e.ci_low <= 2.0 <= e.ci_high
    assert hit / reps >= 0.85
    zero = paired_ratio(np.zeros(4), np.ones(4))
    assert np.isnan(zero.ratio) and np.isnan(zero.ci_low)
    same = paired_ratio(a, a)
    assert (same.ratio, same.ci_low, same.ci_high) == (1.0, 1.0, 1.0)


def test_compare_fidelity_pairs_per_sequence_aggregates():
    from snapquant.analysis.significance import permutation_pvalues
    from snapquant.analysis.uncertainty import compare_fidelity, sequence_aggregates

    rng = np.random.default_rng(10)
    base = _clustered(rng, 10, 40)
    variant = {**base, "kl": base["kl"] * rng.uniform(1.5, 2.5, size=(10, 1)),
               "flip": np.maximum(base["flip"], rng.random((10, 40)) < 0.1)}
    A, B = sequence_aggregates(base), sequence_aggregates(variant)
    assert A["kl_sum"] == pytest.approx(base["kl"].sum(1)) and (A["n_positions"] == 40).all()
    c = compare_fidelity(A, B, n_resamples=999, bootstrap_resamples=500)
    assert (c.n_sequences, c.n_positions) == (10, 400)
    assert c.kl.delta == pytest.approx(variant["kl"].mean() - base["kl"].mean(), rel=1e-12)
    assert c.kl_ratio.ratio == pytest.approx(variant["kl"].sum() / base["kl"].sum(), rel=1e-12)
    assert c.flip.delta == pytest.approx(variant["flip"].mean() - base["flip"].mean(), abs=1e-15)
    assert c.kl.p_value == float(permutation_pvalues(np.stack([A["kl_sum"], A["n_positions"]], 1),
                                                     np.stack([B["kl_sum"], B["n_positions"]], 1), "pooled_mean",
                                                     n_resamples=999, seed=0))
    assert c.kl.p_value < 0.01 and c.kl_ratio.ci_low > 1.3 and c.flip.ci_low > 0
    d = c.to_dict()
    assert {"kl_delta", "kl_delta_p", "kl_ratio_ci_high", "flip_delta_ci_low", "n_positions"} <= set(d)
    with pytest.raises(ValueError, match="not the same positions"):
        compare_fidelity(A, {**B, "n_positions": B["n_positions"][:9]})
