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
