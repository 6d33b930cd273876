"""The kernel probes' shared pieces: raw-code probe caches (`snapquant.bench.probe_inputs`) and the
in-kernel trace's analysis (`scripts/trace_native8.py`), on synthetic stamps with known phases."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from snapquant.bench.probe_inputs import random_bf16_cache, random_snapmla_cache

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_native8.py"


@pytest.fixture(scope="module")
def trace():
    spec = importlib.util.spec_from_file_location("trace_native8", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_caches_hold_finite_codes_of_both_signs_and_full_requests():
    torch.manual_seed(3)
    c = random_snapmla_cache(2, 130, device="cpu")
    codes = c.latent.view(torch.uint8)[c.block_table[:, :3].flatten()]
    assert not ((codes & 0x7F) == 0x7F).any()  # 0x7f / 0xff: NaN
    assert (codes >= 0x80).any() and (codes < 0x80).any()
    assert c.lengths.tolist() == [130, 130]
    assert 0.001 <= c.scale.min().item() and c.scale.max().item() <= 0.01
    bf = random_bf16_cache(2, 130, device="cpu", rope=c.rope)
    assert torch.equal(bf.rope, c.rope) and bf.lengths.tolist() == [130, 130]
    torch.manual_seed(3)
    assert torch.equal(random_snapmla_cache(2, 130, device="cpu").latent.view(torch.uint8), c.latent.view(torch.uint8))


def _program(smid, start, offset, pages=4, period=1000, cuts=(0, 100, 200, 300, 600, 700)):
    """Six stamps per page: phases wait 100, qk 100, softmax 100, pv 300, refill 100 cycles."""
    stamps = []
    for p in range(pages):
        stamps += [offset + period * p + c for c in cuts]
    return {"smid": smid, "start": start, "stamps": stamps}


def test_trace_analysis_phase_lengths_and_coresident_overlap(trace):
    a = _program(0, 0, 50)
    b = _program(0, 10, 150)  # 100 cycles behind a: in its qk while a is in its softmax, and vice versa
    lone = _program(1, 0, 50, period=1200, cuts=(0, 100, 200, 500, 800, 900))
    res = trace.analyse([a, b, lone])
    assert res["median_cycles"] == {"wait": 100, "qk": 100, "softmax_p": 100, "pv": 300, "refill": 100,
                                    "page": 1000}
    assert res["mean_cycles"]["softmax_p"] == round((6 * 100 + 3 * 300) / 9)
    assert res["p90_cycles"]["page"] == 1200
    assert res["programs"] == 3 and res["sms"] == 2 and res["coresident_pairs"] == 2
    assert res["other_program_during_softmax"] == {"pv": 0.5, "qk": 0.5}
    assert res["prologue_cycles_median"] == 50
