"""The benchmark's FlashMLA anchor and read-bandwidth ceiling on CPU: FlashMLA rows through a pure-PyTorch fake
`flash_mla` (tests/support/fake_flash_mla.py) over the same pages as our BF16 kernel (interpreted), their
cross-check, the vs_flashmla ratio and its interval, the "not installed" rows, and the read probe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from snapquant.bench import accounting as acc
from snapquant.bench import results
from snapquant.bench.harness import RunSpec, _describe, measure_read, run
from snapquant.bench.shapes import DecodeShape, uniform_shape
from snapquant.bench.timing import Timing
from snapquant.bench.variants import BY_NAME
from tests.support import fake_flash_mla

R, D = 64, 16  # toy widths: our kernel runs in the Triton interpreter; the fake takes any widths


class SampledTimer:
    """Calls every set once; reports samples around a fixed time per call order (first call: bf16)."""

    name = "fake"

    def __init__(self, us: list[float]) -> None:
        self.us, self.i = us, 0

    def __call__(self, fns, est_us=None) -> Timing:
        for f in fns:
            f()
        us = self.us[self.i % len(self.us)]
        self.i += 1
        samples = tuple(us * (1 + 0.01 * k) for k in (-2, -1, 0, 1, 2))
        return Timing(us, us * 0.99, us * 1.01, len(samples), len(fns), self.name, samples)


def spec(shapes=None) -> RunSpec:
    variants = [BY_NAME["bf16"], BY_NAME["flashmla"]]
    shapes = shapes or [uniform_shape(2, 4, 70), DecodeShape("mixedtiny", 3, 2, (5, 130, 64))]
    return RunSpec(shapes=shapes, variants=variants, device=torch.device("cpu"), budget_s=600, reserve_s=0,
                   append=False, copy=False, read=False, r=R, d=D)


def test_flashmla_rows_match_our_bf16_kernel_and_anchor_the_ratios(monkeypatch):
    fake = fake_flash_mla.install(monkeypatch)
    rows = run(spec([DecodeShape("mixedtiny", 3, 2, (5, 130, 64))]), SampledTimer([150.0, 100.0]),
               log=lambda m: None)
    results.add_ratios(rows)
    by = {(r["shape"], r["variant"]): r for r in rows}
    for shape in ("mixedtiny",):
        a, b = by[(shape, "flashmla")], by[(shape, "bf16")]
        assert a["status"] == "ok" and a["check_vs"] == "bf16", a.get("error")
        assert a["check_rel_l2"] < BY_NAME["flashmla"].tol  # bf16 output and P rounding only (variants.py)
        assert a["family"] == "anchor" and a["bytes"] == acc.cache_bytes(BY_NAME["bf16"].config(), a["tokens"], R, D)
        assert b["vs_flashmla"] == pytest.approx(1.5) and a["vs_flashmla"] == 1.0
        assert b["vs_flashmla_lo"] <= 1.5 <= b["vs_flashmla_hi"]
        assert a["gbps"] > 0 and a["tflops"] > 0  # GB/s and TFLOP/s beside every time
    # the schedule metadata was filled once, by the priming call outside the timed region; every later call
    # (check, estimate, timed) reused it
    assert fake.RECORDER.fills == 1 and fake.RECORDER.calls > 3
    md = results.to_markdown(rows, {"device": "cpu"}, results.evaluate_targets(rows))
    assert "vs_flashmla" in md and "not installed" not in md


def test_a_wrong_anchor_layout_is_a_mismatch(monkeypatch):
    """The cross-check can fail: RoPE and latent swapped in FlashMLA's rows is caught."""
    from snapquant.attention import flashmla

    fake_flash_mla.install(monkeypatch)
    monkeypatch.setattr(flashmla, "pages_from_paged", lambda lat, rp: torch.cat([rp, lat], -1).unsqueeze(2))
    rows = run(spec([uniform_shape(2, 4, 70)]), SampledTimer([100.0]), log=lambda m: None)
    bad = next(r for r in rows if r["variant"] == "flashmla")
    assert bad["status"] == "mismatch" and bad["check_rel_l2"] > 0.3


def test_without_flashmla_each_shape_says_so_in_one_line(monkeypatch):
    fake_flash_mla.uninstall(monkeypatch)
    logged: list[str] = []
    rows = run(spec(), SampledTimer([100.0]), log=logged.append)
    results.add_ratios(rows)
    anchor = [r for r in rows if r["variant"] == "flashmla"]
    assert len(anchor) == 2 and all(r["status"] == "skipped" and r["error"] == "FlashMLA not installed" for r in anchor)
    assert not any("Traceback" in m for m in logged)
    lines = [m for m in logged if "flashmla" in m]
    assert len(lines) == 2 and all(m.endswith("SKIPPED: FlashMLA not installed") for m in lines)
    assert all("vs_flashmla" not in r for r in rows)
    md = results.to_markdown(rows, {"device": "cpu"}, [])
    assert "FlashMLA rows: FlashMLA not installed" in md


def test_read_probe_on_cpu_and_the_efficiency_columns():
    row = measure_read(torch.device("cpu"), 8 << 20)
    assert row["op"] == "read" and row["status"] == "ok" and row["bytes"] == 8 << 20
    assert row["gbps"] == pytest.approx(row["bytes"] / (row["us"] * 1e-6) / 1e9) and row["gbps"] > 0
    read = {"op": "read", "status": "ok", "us": 1000.0, "gbps": 4000.0, "bytes": 4e6}
    dec = {"op": "decode", "shape": "s", "variant": "bf16", "status": "ok", "us": 100.0, "bytes": 3e8,
           "io_bytes": 1e6, "flops": 1e9}
    results.add_ratios([read, dec])
    assert dec["read_frac"] == pytest.approx((3e8 + 1e6) / 100e-6 / 1e9 / 4000.0)
    assert dec["roofline_us"] == pytest.approx(acc.roofline_us(3e8 + 1e6, 1e9, gbps=4000.0))
    assert dec["roofline_frac"] == pytest.approx(dec["roofline_us"] / 100.0)


def test_ratio_interval_covers_the_true_ratio_of_medians():
    """Coverage of the 95 % percentile bootstrap for a ratio of medians at the harness's sample count
    (25 replays per row): log-normal timing noise, 300 simulated pairs. The binomial sd of the observed
    coverage is 1.3 %, so [0.88, 0.99] fails only for a real miscalibration."""
    rng = np.random.default_rng(0)
    n, hits = 300, 0
    for _ in range(n):
        a = 150.0 * np.exp(rng.normal(0, 0.05, 25))
        b = 100.0 * np.exp(rng.normal(0, 0.05, 25))
        lo, hi = results.ratio_interval(a, b, n_resamples=1000, seed=int(rng.integers(1 << 30)))
        hits += lo <= 1.5 <= hi
    assert 0.88 <= hits / n <= 0.99
    assert results.ratio_interval([1.0, 2.0], [1.0, 2.0, 3.0]) is None  # too few samples
    assert results.ratio_interval([2.0] * 5, [1.0] * 5) == (2.0, 2.0)


def test_describe_prints_rates_beside_the_time():
    row = {"op": "decode", "shape": "s", "label": "s", "variant": "flashmla", "status": "ok", "us": 10.0,
           "gbps": 1000.0, "tflops": 5.0, "timer": "fake"}
    assert "GB/s" in _describe(row) and "TFLOP/s" in _describe(row)


def test_flashmla_targets_judge_the_ratio_and_stay_open_without_the_anchor():
    def row(variant, us, family, shape="32x64x8192"):
        return {"op": "decode", "shape": shape, "variant": variant, "family": family, "layout": "snapmla",
                "mode": results.SNAPMLA_MODE, "status": "ok", "us": us}

    rows = [row("flashmla", 100.0, "anchor"), row("bf16", 104.0, "bf16"), row("snapmla", 85.0, "fp8")]
    results.add_ratios(rows)
    got = {(t["key"], t["pick"]): t for t in results.evaluate_targets(rows)}
    bf = got[("bf16_vs_flashmla_32x64x8192", "default")]
    fp = got[("fp8_vs_flashmla_32x64x8192", "default")]
    assert bf["value"] == pytest.approx(1.04) and bf["passed"] is True  # <= 1.05
    assert fp["value"] == pytest.approx(0.85) and fp["passed"] is False  # > 0.80 at H=64
    # Without FlashMLA rows the targets are unmeasured, not passed or failed.
    alone = [row("bf16", 104.0, "bf16"), row("snapmla", 85.0, "fp8")]
    results.add_ratios(alone)
    got = {(t["key"], t["pick"]): t for t in results.evaluate_targets(alone)}
    assert got[("fp8_vs_flashmla_32x64x8192", "default")]["passed"] is None
