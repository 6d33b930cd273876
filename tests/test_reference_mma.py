"""The reference's model of Hopper's native FP8 MMA (`mma="hopper_fp8"`, snapquant/reference/mma.py).

What the model must satisfy whatever the hardware turns out to retain (the retained bits and the group
size are fitted on the H200 by scripts/check_mma_numerics_gpu.py): no truncation is the exact reference,
a truncated group is off by no more than its arithmetic bound, more bits never move it further on
average, and a hand-computed group comes out as computed by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

import snapquant as sq
from snapquant.errors import ConfigError
from snapquant.quant.dtypes import get_element_format
from snapquant.quant.synthetic import synthetic_latent_rope, synthetic_queries
from snapquant.reference.mma import MMANumerics, as_mma, group_sum, mma_dot

E4M3 = get_element_format("fp8_e4m3")
LENGTHS = [130, 1, 64, 65, 100]


def _case(seed: int, r: int = 128, d: int = 32, H: int = 8, T: int = 130, S: int = 1):
    latent, rope = synthetic_latent_rope(T, r, d, batch=len(LENGTHS), seed=seed, rope_outlier_amplitude=30.0)
    q = synthetic_queries(latent, rope, H, seed=seed + 100)
    if S > 1:
        q = torch.stack([q] + [synthetic_queries(latent, rope, H, seed=seed + 100 + i) for i in range(1, S)], 1)
    cfg = sq.PRESETS["snapmla"]
    return q, sq.quantize_kv(latent, rope, cfg), torch.tensor(LENGTHS), cfg


def _e4m3(shape, gen: torch.Generator, spread: float = 3.0) -> torch.Tensor:
    """Random e4m3 values whose magnitudes spread over a few binades (as codes of a scaled tensor do)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.empty(shape, dtype=torch.float64).uniform_(-spread, spread, generator=gen))
    return E4M3.round_trip((x * 40).float()).double()


# ------------------------------------------------------------------------------------------ the limit
@pytest.mark.parametrize("products", ["qk", "pv", "both"])
@pytest.mark.parametrize("S", [1, 2])
def test_no_truncation_is_the_exact_reference_bit_for_bit(products, S):
    q, kv, lengths, cfg = _case(1, S=S)
    exact = sq.mla_decode_reference(q, kv, lengths, 0.1, cfg)
    model = sq.mla_decode_reference(q, kv, lengths, 0.1, cfg,
                                    mma=MMANumerics(mode="hopper_fp8", bits=None, products=products))
    assert torch.equal(exact[0], model[0]) and torch.equal(exact[1], model[1])
    assert torch.equal(exact[0], sq.mla_decode_reference(q, kv, lengths, 0.1, cfg, mma="exact")[0])


@pytest.mark.parametrize("K", [32, 512, 4096])
def test_forty_bits_in_one_group_is_the_correctly_rounded_dot(K):
    """Products of e4m3 values are multiples of 2^-18 below 2^18: 40 bits below the largest keep every one
    of them, so one group sums them exactly and rounds once to fp32."""
    gen = torch.Generator().manual_seed(K)
    a, b = _e4m3((64, K), gen), _e4m3((64, K), gen)
    prods = a * b
    numerics = MMANumerics(mode="hopper_fp8", bits=40, k_group=K, qk_promote=None)
    got = mma_dot(torch.zeros(64), prods, numerics, None)
    exact = prods.sum(-1).float()  # float64 holds this sum exactly (46 bits at most)
    assert torch.equal(got, exact)


# ------------------------------------------------------------------------------------------ the bound
@pytest.mark.parametrize("bits, G", [(8, 4), (12, 32), (14, 32), (14, 128), (16, 64)])
@pytest.mark.parametrize("truncation", ["toward_zero", "down"])
def test_one_group_is_within_its_arithmetic_bound(bits, G, truncation):
    """The bound, for one group of G exact products p_i added to a zero accumulator.

    The largest |p_i| lies in [2^(e-1), 2^e); every term is cut to a multiple of q = 2^(e - bits), so it
    loses less than q (toward zero or down alike) and q <= 2^(1 - bits) max|p|. The G losses add to
    less than G q <= G 2^(1 - bits) max|p|. The kept sum is a multiple of q below G 2^bits q, so it has
    at most bits + log2(G) <= 24 significant bits here and its rounding to fp32 is exact: nothing else
    moves it. (In the usual wording: k_group x 2^-fraction_bits x the largest product, with
    fraction_bits = bits - 1 the bits kept after the leading one.)"""
    assert bits + math.log2(G) <= 24
    gen = torch.Generator().manual_seed(bits * 1000 + G)
    prods = _e4m3((4096, G), gen) * _e4m3((4096, G), gen)
    numerics = MMANumerics(mode="hopper_fp8", bits=bits, k_group=G, truncation=truncation, qk_promote=None)
    got = group_sum(torch.zeros(4096, dtype=torch.float64), prods, numerics)
    err = (got - prods.sum(-1)).abs()
    bound = G * 2.0 ** (1 - bits) * prods.abs().amax(-1)
    assert bool((err < bound).all())
    assert float((err / bound).max()) > 0.05  # the bound is not vacuous: truncation does cost something
    if truncation == "down":  # every cut is downward: the sum can only drop
        assert bool((got <= prods.sum(-1)).all())


def test_more_bits_move_the_output_less_on_average():
    """Decode deviation from the exact reference (output rel-L2 and LSE), averaged over fresh inputs,
    falls as the retained bits grow."""
    bits_grid = [6, 8, 10, 12, 14, 18]
    dev = torch.zeros(len(bits_grid))
    lse_dev = torch.zeros(len(bits_grid))
    for seed in range(3):
        q, kv, lengths, cfg = _case(10 + seed, H=4, T=130)
        out0, lse0 = sq.mla_decode_reference(q, kv, lengths, 0.1, cfg)
        for i, bits in enumerate(bits_grid):
            out, lse = sq.mla_decode_reference(q, kv, lengths, 0.1, cfg, mma=MMANumerics(mode="hopper_fp8", bits=bits))
            dev[i] += float((out - out0).norm() / out0.norm())
            lse_dev[i] += float((lse - lse0).abs().mean())
    assert bool((dev[1:] < dev[:-1]).all()), dev.tolist()
    assert bool((lse_dev[1:] < lse_dev[:-1]).all()), lse_dev.tolist()
    assert float(dev[-1]) > 0  # 18 bits still truncate the accumulator of long chains


# ------------------------------------------------------------------------------------------ by hand
def _group(prods, acc=0.0, **knobs):
    numerics = MMANumerics(mode="hopper_fp8", qk_promote=None, **knobs)
    return float(group_sum(torch.tensor([acc], dtype=torch.float64), torch.tensor([prods], dtype=torch.float64),
                           numerics)[0])


def test_hand_computed_group():
    """Four products, exact sum 1.5 + 0.09375 + 0.0390625 - 0.01171875 = 1.62109375 (all e4m3 values).

    The largest, 1.5, lies in [2^0, 2^1): with 4 bits the quantum is 2^(1-4) = 0.125 and the three small
    products vanish (1.5); with 6 bits it is 2^-5 = 0.03125: 0.09375 is three quanta and stays,
    0.0390625 is cut to 0.03125, -0.01171875 to 0 toward zero (1.625, above the exact sum) or to
    -0.03125 downward (1.59375)."""
    p = [1.5, 0.09375, 0.0390625, -0.01171875]
    assert sum(p) == 1.62109375
    assert _group(p, bits=4, k_group=4) == 1.5
    assert _group(p, bits=6, k_group=4) == 1.625
    assert _group(p, bits=6, k_group=4, truncation="down") == 1.59375
    # an accumulator of 8 joins the alignment: quantum 2^(4-6) = 0.25, only 1.5 survives -> 9.5; kept out
    # of it, the group's own 1.625 is added in fp32 -> 9.625
    assert _group(p, acc=8.0, bits=6, k_group=4) == 9.5
    assert _group(p, acc=8.0, bits=6, k_group=4, align_accumulator=False) == 9.625
    # two groups of two, each chain promoted: the second chain aligns to its own largest term, 0.0390625 in
    # [2^-5, 2^-4), quantum 2^-10, of which both small products are multiples: promotion keeps them whole
    numerics = MMANumerics(mode="hopper_fp8", bits=6, k_group=2, qk_promote=2)
    got = mma_dot(torch.zeros(1), torch.tensor([p], dtype=torch.float64), numerics, 2)
    assert float(got[0]) == 1.59375 + 0.02734375 == sum(p)
    # one unpromoted chain: the second group aligns to the accumulator 1.59375 (quantum 2^-5): 0.03125 + 0
    got = mma_dot(torch.zeros(1), torch.tensor([p], dtype=torch.float64), numerics.replace(qk_promote=None), None)
    assert float(got[0]) == 1.59375 + 0.03125


# ------------------------------------------------------------------------------------------ the knobs
def test_validation_and_serialisation():
    m = MMANumerics(mode="hopper_fp8", bits=13, k_group=64)
    assert MMANumerics.from_dict(m.to_dict()) == m
    assert as_mma(None) == MMANumerics() and as_mma("hopper_fp8") == MMANumerics(mode="hopper_fp8")
    assert as_mma({"mode": "hopper_fp8", "bits": 13, "k_group": 64}) == m
    assert m.replace(bits=None).native_qk is False
    for bad in ({"mode": "fp8"}, {"mode": "hopper_fp8", "bits": 0}, {"mode": "hopper_fp8", "bits": 41},
                {"mode": "hopper_fp8", "k_group": 32, "qk_promote": 48}, {"mode": "hopper_fp8", "products": "all"},
                {"mode": "hopper_fp8", "truncation": "nearest"}, {"mode": "exact", "bits": 12},
                {"mode": "hopper_fp8", "bitz": 12}, {"mode": "hopper_fp8", "align_accumulator": 1}):
        with pytest.raises(ConfigError):
            as_mma(bad)
    assert MMANumerics().describe() == "exact products, fp32 accumulation"


def test_kernel_numerics():
    assert MMANumerics.for_kernel("gluon.wide", False) == MMANumerics()
    native8 = MMANumerics.for_kernel("gluon.narrow8", True)
    assert native8 == MMANumerics.for_kernel("gluon.wide8", "both") == MMANumerics(mode="hopper_fp8")
    assert (native8.qk_promote, native8.pv_promote) == (256, None)
    rows = MMANumerics.for_kernel("triton.rows", "qk")
    assert (rows.products, rows.qk_promote, rows.pv_promote) == ("qk", 32, 32)
    narrow_qk = MMANumerics.for_kernel("gluon.narrow", "qk")  # narrow8's QK chains, exact PV
    assert (narrow_qk.mode, narrow_qk.products, narrow_qk.qk_promote) == ("hopper_fp8", "qk", 256)
    assert MMANumerics.for_kernel("gluon.narrow", False) == MMANumerics()
    with pytest.raises(ConfigError):
        MMANumerics.for_kernel("gluon.narrow_tile", "qk")


def test_native_products_need_e4m3_operands():
    q, kv, lengths, cfg = _case(2)
    with pytest.raises(ConfigError, match="pv"):
        sq.mla_decode_reference(q, kv, lengths, 0.1, cfg.replace(pv="bf16"), mma="hopper_fp8")
    out = sq.mla_decode_reference(q, kv, lengths, 0.1, cfg.replace(pv="bf16"),
                                  mma={"mode": "hopper_fp8", "products": "qk"})
    assert bool(torch.isfinite(out[0]).all())
    with pytest.raises(ConfigError, match="query"):
        sq.mla_decode_reference(q, kv, lengths, 0.1, cfg.replace(query="bf16"), mma="hopper_fp8")


def _numerics_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "check_mma_numerics_gpu.py"
    spec = importlib.util.spec_from_file_location("check_mma_numerics_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_numerics_fit_models_each_kernels_own_native_products():
    """The GPU fit compares gluon.narrow's fp8_mma="qk" (native QK, exact PV) with the model of native QK only,
    and the both-native kernels with both: a stand-in kernel whose outputs are the qk model's agrees bit for bit
    under the model the fit gives it, and the same model with native PV as well would not."""
    from snapquant import PRESETS, mla_decode_reference
    from snapquant.quant.quantizer import quantize_kv

    fit = _numerics_script()
    torch.manual_seed(7)
    cfg = PRESETS["snapmla"]
    kv = quantize_kv(torch.randn(1, 192, 512) * 3, torch.randn(1, 192, 64), cfg)
    q = torch.randn(1, 1, 16, 576).to(torch.bfloat16)
    lengths = torch.tensor([192])
    qk_model = MMANumerics(mode="hopper_fp8", bits=12, products="qk")
    qk_out = mla_decode_reference(q, kv, lengths, fit.TAU, cfg, mma=qk_model)
    both_out = mla_decode_reference(q, kv, lengths, fit.TAU, cfg, mma=qk_model.replace(products="both"))
    case = {"label": "cpu", "q": q, "kvs": [kv], "lengths": lengths, "config": cfg,
            "outs": {"gluon.narrow (fp8_mma=qk)": qk_out, "gluon.narrow8 (16 rows)": both_out}}
    rows: list[dict] = []
    fit.measure([case], [MMANumerics(mode="hopper_fp8", bits=12)], "cpu", rows)
    got = {r["kernel"]: r["bit_agree"] for r in rows}
    assert got == {"gluon.narrow (fp8_mma=qk)": 1.0, "gluon.narrow8 (16 rows)": 1.0}
    assert not torch.equal(qk_out[0], both_out[0])  # the two products' models differ: the routing is tested
