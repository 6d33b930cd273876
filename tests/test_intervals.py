"""Block-bootstrap intervals of per-position fidelity means: exact estimates, calibration, pairing."""

from __future__ import annotations

import numpy as np
import pytest

from snapquant.analysis.intervals import block_mean_ci, blocks, paired_block_ci


def _ar1(rng: np.random.Generator, n_seq: int, n_pos: int, phi: float) -> np.ndarray:
    """Stationary AR(1) rows with unit marginal variance and mean 0: correlated like decode positions."""
    x = np.empty((n_seq, n_pos))
    x[:, 0] = rng.normal(size=n_seq)
    eps = rng.normal(scale=np.sqrt(1 - phi**2), size=(n_seq, n_pos))
    for t in range(1, n_pos):
        x[:, t] = phi * x[:, t - 1] + eps[:, t]
    return x


def test_blocks_keep_every_position_once_and_the_estimate_is_the_plain_mean():
    rng = np.random.default_rng(0)
    v = rng.exponential(size=(3, 37))  # 37 = 2 full blocks of 16 + a short one of 5
    sums, counts = blocks(v, 16)
    assert sums.shape == (9,) and sorted(set(counts)) == [5.0, 16.0]
    assert counts.sum() == v.size and sums.sum() == pytest.approx(v.sum(), rel=1e-14)
    iv = block_mean_ci(v, 16, n_resamples=500)
    assert iv.estimate == pytest.approx(v.mean(), rel=1e-14)
    assert iv.low < iv.estimate < iv.high and iv.n_positions == v.size and iv.n_blocks == 9
    with pytest.raises(ValueError, match="block"):
        blocks(v, 0)
    with pytest.raises(ValueError, match="positions"):
        blocks(np.zeros((2, 0)), 4)


def test_constant_values_give_an_exact_zero_width_interval():
    iv = block_mean_ci(np.full((2, 40), 0.25), 8)
    assert (iv.estimate, iv.low, iv.high, iv.method) == (0.25, 0.25, 0.25, "exact")


def test_iid_blocks_of_one_agree_with_the_t_interval():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    v = rng.normal(1.0, 2.0, size=(1, 400))
    iv = block_mean_ci(v, 1, n_resamples=4000)
    t = stats.t.interval(0.95, df=399, loc=v.mean(), scale=stats.sem(v.ravel()))
    # bootstrap and t half-widths agree to a few percent at n = 400 (sampling error of the bootstrap)
    assert (iv.high - iv.low) == pytest.approx(t[1] - t[0], rel=0.08)


def test_block_intervals_cover_correlated_positions_where_per_position_ones_do_not():
    """AR(1) positions, phi = 0.6: the long-run variance is (1 + phi) / (1 - phi) = 4x the marginal one,
    so a per-position interval is half as wide as it should be (~68% coverage); blocks of 16
    positions keep the dependence and come back near 95%."""
    rng = np.random.default_rng(2)
    reps, hit_block, hit_iid = 120, 0, 0
    for _ in range(reps):
        x = _ar1(rng, 4, 190, 0.6)
        b = block_mean_ci(x, 16, n_resamples=600, seed=int(rng.integers(1 << 30)))
        i = block_mean_ci(x, 1, n_resamples=600, seed=int(rng.integers(1 << 30)))
        hit_block += b.low <= 0.0 <= b.high
        hit_iid += i.low <= 0.0 <= i.high
    # binomial sd of a coverage estimate over 120 reps: ~2.3 points at 0.93, ~4.3 at 0.68
    assert 0.86 <= hit_block / reps <= 0.99
    assert hit_iid / reps <= 0.80


def test_paired_ratio_recovers_a_doubling():
    rng = np.random.default_rng(3)
    base = rng.exponential(1.0, size=(4, 190)) * rng.exponential(1.0, size=(4, 1))  # strong per-sequence level
    variant = 2.0 * base * rng.uniform(0.9, 1.1, size=base.shape)
    r = paired_block_ci(base, variant, "ratio", 16, n_resamples=2000)
    assert r.estimate == pytest.approx(variant.sum() / base.sum(), rel=1e-14)
    assert r.low < 2.0 < r.high and r.low > 1.8 and r.high < 2.2
    d = paired_block_ci(base, variant, "difference", 16, n_resamples=2000)
    assert d.estimate == pytest.approx(variant.mean() - base.mean(), rel=1e-12) and d.low > 0
    same = paired_block_ci(base, base, "ratio", 16, n_resamples=500)
    assert (same.estimate, same.low, same.high) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="same shape"):
        paired_block_ci(base, variant[:, :10])
    with pytest.raises(ValueError, match="kind"):
        paired_block_ci(base, variant, "quotient")
