"""Triton MLA decode (snapquant.kernels.decode, triton/) against the reference decode, in the interpreter.

The oracle is `snapquant.mla_decode_reference` over the same quantized cache (gathered back from the
pages). Tolerances, and why:
- one KV split: the kernel performs the reference's arithmetic step by step; only fp32 summation
  order differs, which can flip the rounding of an isolated bf16 / e4m3 element of P (a row-local
  effect). So >= 90% of rows must agree to 1e-5 relative, every row to 1e-2, the whole output
  to rel-L2 1e-3, and LSE to 1e-4 absolute. Observed: ~2e-7 typical, 1.2e-4 worst (one flip).
- several splits: each split has its own running max, so every bf16 P element is rounded from a
  differently scaled value (fp8 P is scale-invariant). Output rel-L2 <= 1e-3 (observed <= 3.3e-4),
  LSE <= 1e-4 (observed 4e-6); public FP8 kernel ports test with 5e-2 and 2e-2 (docs/numerics.md).
- against the float64 oracle the kernel's error must stay within 5% of the reference's own
  (observed <= 1.2%): split-KV must not add error of its own.
Unused page slots are filled with NaN, so a read outside the valid tokens fails the test.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from snapquant import PRESETS, KVQuantConfig, mla_decode_oracle, mla_decode_reference, quantize_kv
from snapquant.kernels import PagedMLACache, mla_decode
from snapquant.kernels.triton.decode import _page_weights

SNAPMLA = PRESETS["snapmla"]
DS = PRESETS["ds_v32"]
CONFIGS: dict[str, KVQuantConfig] = {
    "snapmla": SNAPMLA,  # fp8 q, fp8 scale-fused P
    "snapmla_kv_only": PRESETS["snapmla_kv_only"],  # bf16 q, bf16 P
    "snapmla_q_fp8": PRESETS["snapmla_q_fp8"],  # fp8 q, bf16 P
    "snapmla_q_bf16_pv_fp8": SNAPMLA.replace(query="bf16"),
    "ds_v32": DS.replace(block_size=32),  # bf16 q, bf16 P (the preset), 2 blocks at r = 64
    "ds_v32_q_fp8": DS.replace(block_size=32, query="fp8_e4m3"),
    "ds_v32_pv_fp8": DS.replace(block_size=32, pv="fp8_scale_fused"),
    "ds_v32_fp8": DS.replace(block_size=32, query="fp8_e4m3", pv="fp8_scale_fused"),
    "bf16": PRESETS["bf16"],
}
LENGTHS = [1, 63, 64, 65, 130]


def poison_unused(cache: PagedMLACache) -> None:
    """NaN into every slot that no request's valid tokens occupy (latent, scale and rope)."""
    used = torch.zeros(cache.num_pages, 64, dtype=torch.bool)
    for b, n in enumerate(cache.lengths.tolist()):
        for i in range(math.ceil(n / 64)):
            used[cache.block_table[b, i], : min(64, n - 64 * i)] = True
    free = ~used
    if cache.latent.dtype == torch.bfloat16:
        cache.latent.view(torch.int16)[free] = 0x7FC0
    else:
        cache.latent.view(torch.uint8)[free] = 0x7F  # e4m3fn NaN
    if cache.scale is not None:
        cache.scale[free] = float("nan")
    cache.rope.view(torch.int16)[free] = 0x7FC0


def make_case(config, lengths, H, S=1, r=64, d=16, q_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(max(lengths), 1)
    # Per-token magnitudes spread over 2 decades, RoPE with a wider range (docs/numerics.md, "Test and
    # benchmark inputs");
    # logits span ~20 (see test_extreme_score_range for the far end).
    mag = torch.logspace(-1, 1, T)[torch.randperm(T, generator=g)][:, None]
    latent = torch.randn(B, T, r, generator=g) * mag
    rope = torch.randn(B, T, d, generator=g) * 4
    kv = quantize_kv(latent.to(torch.bfloat16), rope.to(torch.bfloat16), config)
    lens = torch.tensor(lengths, dtype=torch.int32)
    cache = PagedMLACache.from_quantized_kv(kv, lens, shuffle=True, extra_pages=2, generator=g)
    poison_unused(cache)
    q = (torch.randn(B, S, H, r + d, generator=g) * 2).to(q_dtype)
    return q, kv, cache, lens


def row_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


def check_against_reference(q, kv, cache, lens, config, num_splits, tau=None, causal=True, **knobs):
    """`num_splits == 1` gets the one-run tolerances (one split, or one balanced part: either way each
    request is one run of pages); anything else the several-runs ones. `knobs` go to mla_decode."""
    r = cache.kv_lora_rank
    tau = 1 / math.sqrt(q.shape[-1]) if tau is None else tau
    out, lse = mla_decode(q, cache, tau, config, num_splits=num_splits, causal=causal, **knobs)
    ref, ref_lse = mla_decode_reference(q, cache.to_quantized_kv(), lens, tau, config, causal=causal)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    assert (out[empty] == 0).all()
    assert (lse[~empty] - ref_lse[~empty]).abs().max() <= 1e-4
    live = ~empty
    rel = row_rel(out[live], ref[live])
    total = ((out - ref).norm() / ref.norm()).item()
    assert total <= 1e-3, f"rel-L2 {total:.2e}"
    if num_splits == 1:
        assert rel.max() <= 1e-2, f"worst row {rel.max():.2e}"
        assert (rel <= 1e-5).float().mean() >= 0.9, f"rows within 1e-5: {(rel <= 1e-5).float().mean():.2f}"
    # No worse than the reference itself against exact float64 attention over the same cache.
    oracle, _ = mla_decode_oracle(q, kv, lens, tau, config, causal=causal)
    err_k = ((out.double() - oracle).norm() / oracle.norm()).item()
    err_r = ((ref.double() - oracle).norm() / oracle.norm()).item()
    assert err_k <= 1.05 * err_r + 1e-6, (err_k, err_r)
    assert r == out.shape[-1]
    return out, lse


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("S", [1, 2])
def test_decode_matrix(name, S):
    """Every supported combination: query bf16/fp8 x PV bf16/fp8-fused x both fp8 layouts, the bf16
    baseline; s_q 1 and 2; lengths 1, 63, 64, 65, 130; one split and several."""
    config = CONFIGS[name]
    q, kv, cache, lens = make_case(config, LENGTHS, H=4, S=S, seed=S)
    for splits in (1, 3):
        check_against_reference(q, kv, cache, lens, config, splits)


@pytest.mark.parametrize("H", [1, 2, 16])
@pytest.mark.parametrize("name", ["snapmla", "snapmla_kv_only", "ds_v32_fp8", "bf16"])
def test_head_counts(name, H):
    q, kv, cache, lens = make_case(CONFIGS[name], [1, 65, 100], H=H, S=2 if H == 16 else 1, seed=H)
    check_against_reference(q, kv, cache, lens, CONFIGS[name], num_splits=2)


def test_four_scale_blocks_and_wider_rope():
    """ds_v32 with 4 blocks per token (as DeepSeek's 512 / 128), r = 128, d = 32."""
    config = DS.replace(block_size=32, query="fp8_e4m3", pv="fp8_scale_fused")
    q, kv, cache, lens = make_case(config, [70, 3], H=2, r=128, d=32)
    check_against_reference(q, kv, cache, lens, config, num_splits=2)


@pytest.mark.parametrize("r,d", [(16, 16), (32, 64), (256, 16)])
def test_widths(r, d):
    q, kv, cache, lens = make_case(SNAPMLA, [40, 64], H=2, r=r, d=d)
    check_against_reference(q, kv, cache, lens, SNAPMLA, num_splits=1)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["snapmla", "snapmla_kv_only"])
def test_query_dtypes(name, q_dtype):
    q, kv, cache, lens = make_case(CONFIGS[name], [5, 70], H=2, q_dtype=q_dtype)
    check_against_reference(q, kv, cache, lens, CONFIGS[name], num_splits=1)


def test_single_token_query_shape_and_default_splits():
    q, kv, cache, lens = make_case(SNAPMLA, [3, 129], H=4, S=1)
    q3 = q[:, 0]
    out, lse = mla_decode(q3, cache, 0.1)  # config from the cache, heuristic num_splits
    ref, ref_lse = mla_decode_reference(q3, kv, lens, 0.1, SNAPMLA)
    assert out.shape == (2, 4, 64) and lse.shape == (2, 4)
    assert ((out - ref).norm() / ref.norm()) <= 1e-3
    assert (lse - ref_lse).abs().max() <= 1e-4


def test_non_causal_multi_token_and_empty_rows():
    """s_q = 3 non-causal; a request of length 0 and one shorter than s_q (empty causal rows)."""
    config = CONFIGS["snapmla_kv_only"]
    q, kv, cache, lens = make_case(config, [0, 2, 66], H=2, S=3)
    check_against_reference(q, kv, cache, lens, config, num_splits=2, causal=False)
    out, lse = check_against_reference(q, kv, cache, lens, config, num_splits=2, causal=True)
    assert torch.isinf(lse[0]).all() and (out[0] == 0).all()  # length 0: nothing visible
    assert torch.isinf(lse[1, 0]).all()  # length 2, s_q 3: the first query row sees nothing


def test_many_splits_exceeding_pages():
    """More splits than pages: empty splits must contribute nothing."""
    q, kv, cache, lens = make_case(SNAPMLA, [1, 130], H=2)
    check_against_reference(q, kv, cache, lens, SNAPMLA, num_splits=7)


def test_block_m_tiles_rows():
    """S * H = 32 rows in two tiles of 16."""
    config = CONFIGS["snapmla_q_fp8"]
    q, _, cache, _ = make_case(config, [64, 90], H=16, S=2)
    tau = 1 / math.sqrt(q.shape[-1])
    a, la = mla_decode(q, cache, tau, config, num_splits=1, block_m=16)
    b, lb = mla_decode(q, cache, tau, config, num_splits=1, block_m=32)
    assert (row_rel(a, b) <= 1e-5).float().mean() >= 0.9 and (la - lb).abs().max() <= 1e-5


def test_decode_knob_differs_from_cache_config():
    """A snapmla cache decoded with kv_only knobs (bf16 q and P) matches the reference with those knobs."""
    q, kv, cache, lens = make_case(SNAPMLA, [50, 64], H=2)
    check_against_reference(q, kv, cache, lens, CONFIGS["snapmla_kv_only"], num_splits=1)


def test_extreme_score_range_stays_finite():
    """Logit ranges of ~100 nat: fp8 scale-fused P keeps acc in units of the current block's pi, which
    overflows fp32 without the pi floor. The reference now floors pi as the kernel does (commit
    "pi floor in scale-fused PV"), so both stay finite; the kernel must match the reference and stay
    close to float64, in every schedule."""
    config = SNAPMLA
    q, kv, cache, lens = make_case(config, [200, 130], H=4, S=2)
    q = q * 8
    tau = 1 / math.sqrt(q.shape[-1])
    oracle, oracle_lse = mla_decode_oracle(q, kv, lens, tau, config)
    ref, ref_lse = mla_decode_reference(q, kv, lens, tau, config)
    assert torch.isfinite(ref_lse).all() and torch.isfinite(ref).all()
    assert float(oracle_lse.amax() - oracle_lse.amin()) > 50  # the wide-range regime
    for knobs in ({"num_splits": 1}, {"num_splits": 3}, {"num_splits": 2, "schedule": "balanced"}):
        out, lse = mla_decode(q, cache, tau, config, **knobs)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert ((out - ref).norm() / ref.norm()) <= 1e-3
        assert ((out.double() - oracle).norm() / oracle.norm()) <= 5e-2
        assert (lse.double() - oracle_lse).abs().max() <= 2e-2


# ---------------------------------------------------------------------------------------------------
# Kernel variants: the balanced schedule, reciprocal P scaling, the swapped tile. Each must
# meet the same contract against the reference as the default path.
VARIANT_CASES = [
    ("snapmla", {"schedule": "balanced", "num_splits": 3}),
    ("snapmla", {"p_div": "rcp", "num_splits": 1}),
    ("snapmla", {"tile": "tokens", "num_splits": 1}),
    ("snapmla", {"tile": "tokens", "schedule": "balanced", "p_div": "rcp", "num_splits": 4}),
    ("snapmla_q_fp8", {"tile": "tokens", "num_splits": 2}),
    ("snapmla", {"tile": "pairs", "num_splits": 1}),
    ("snapmla", {"tile": "pairs", "num_splits": 3}),
    ("snapmla", {"tile": "pairs", "schedule": "balanced", "p_div": "rcp", "num_splits": 4}),
    ("snapmla_kv_only", {"schedule": "balanced", "num_splits": 5}),
    ("snapmla_q_bf16_pv_fp8", {"tile": "tokens", "num_splits": 1}),
    ("bf16", {"schedule": "balanced", "num_splits": 2}),
    ("bf16", {"tile": "tokens", "num_splits": 3}),
    ("ds_v32_fp8", {"schedule": "balanced", "num_splits": 3}),
]


@pytest.mark.parametrize("name,knobs", VARIANT_CASES, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                                                            for n, kw in VARIANT_CASES])
def test_variants_match_reference(name, knobs):
    """Lengths 0 (nothing visible), 1, 63, 64, 65, 130 and s_q 2 (causal rows), page pool shuffled and
    NaN-poisoned: the variant meets the default path's contract against the reference."""
    config = CONFIGS[name]
    knobs = dict(knobs)
    q, kv, cache, lens = make_case(config, [1, 63, 0, 64, 65, 130], H=4, S=2, seed=len(knobs))
    check_against_reference(q, kv, cache, lens, config, knobs.pop("num_splits"), **knobs)


def test_balanced_one_part_equals_one_split_bitwise():
    """One part covers the batch in order: every request is one run, as with one uniform split, so the
    outputs are bit-identical (the schedule changes who computes, not what)."""
    for name in ("snapmla", "bf16"):
        config = CONFIGS[name]
        q, _, cache, _ = make_case(config, [3, 0, 129, 64], H=2, S=2, seed=5)
        a = mla_decode(q, cache, 0.1, config, num_splits=1)
        b = mla_decode(q, cache, 0.1, config, num_splits=1, schedule="balanced")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_balanced_parts_beyond_pages_and_empty_batch_rows():
    """More parts than pages (empty parts), requests cut at arbitrary page boundaries across parts."""
    config = CONFIGS["snapmla_kv_only"]
    q, kv, cache, lens = make_case(config, [130, 0, 1, 200], H=2, seed=9)
    for parts in (2, 7, 50):
        check_against_reference(q, kv, cache, lens, config, parts, schedule="balanced")
    lens0 = torch.zeros_like(cache.lengths)  # nothing cached at all: out 0, lse -inf everywhere
    empty = PagedMLACache(cache.latent, cache.scale, cache.rope, cache.block_table, lens0, cache.config)
    out, lse = mla_decode(q, empty, 0.1, config, num_splits=3, schedule="balanced")
    assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all()


def test_balanced_metadata_is_the_page_prefix_sum():
    from snapquant.kernels.decode import plan_decode
    from snapquant.kernels.operands import KernelOperands

    config = CONFIGS["bf16"]
    q, _, cache, _ = make_case(config, [1, 64, 65, 0, 130], H=2, seed=2)
    plan = plan_decode(q, KernelOperands.from_paged(cache), 0.1, config, 4, schedule="balanced")
    assert [ln.name for ln in plan.launches] == ["balanced_metadata", "decode_balanced", "combine_balanced"]
    plan.run()
    cum = plan.launches[0].args[1]
    want = torch.cat([torch.zeros(1), torch.cumsum((cache.lengths + 63) // 64, 0)]).to(torch.int32)
    assert torch.equal(cum, want)


def test_knob_validation_names_the_knob():
    from snapquant.errors import ConfigError

    q, _, cache, _ = make_case(SNAPMLA, [10], H=2)
    for knobs, word in (({"schedule": "balance"}, "schedule"), ({"p_div": "fast"}, "p_div"),
                        ({"tile": "cols"}, "tile"), ({"fp8_mma": "kq"}, "fp8_mma")):
        with pytest.raises(ConfigError, match=word):
            mla_decode(q, cache, 0.1, **knobs)
    for knobs, word in (({"num_warps": 0}, "num_warps"), ({"num_warps": 6}, "num_warps"), ({"block_m": 8}, "block_m"),
                        ({"num_splits": 0}, "num_splits"), ({"maxnreg": True}, "maxnreg")):
        with pytest.raises(ConfigError, match=word):
            mla_decode(q, cache, 0.1, **knobs)
    with pytest.raises(ConfigError, match=r"unknown decode option.*'numwarps'"):
        mla_decode(q, cache, 0.1, numwarps=4)
    ds = CONFIGS["ds_v32"]
    qd, _, cached, _ = make_case(ds, [10], H=2)
    with pytest.raises(ConfigError, match="tokens"):
        mla_decode(qd, cached, 0.1, tile="tokens")
    with pytest.raises(ConfigError, match="pairs"):  # pairs: snapmla layout, fp8 query and P only
        mla_decode(qd, cached, 0.1, tile="pairs")
    with pytest.raises(ConfigError, match="pairs"):
        mla_decode(q, cache, 0.1, CONFIGS["snapmla_kv_only"], tile="pairs")
    with pytest.raises(ConfigError, match="pairs"):
        mla_decode(q, cache, 0.1, tile="pairs", fp8_mma="qk")


@pytest.mark.parametrize("fp8_mma,kinds", [(False, (3, 3)), ("qk", (2, 3)), ("pv", (3, 2)), (True, (2, 2))])
def test_fp8_mma_knob_picks_mma_kinds_on_gpu_plans(fp8_mma, kinds):
    """Plans for a GPU (built on meta tensors: nothing runs) use exact fp16 MMAs of e4m3 values unless
    fp8_mma asks for Hopper's FP8 MMA on QK and/or PV; the interpreter always computes in fp32."""
    from snapquant.kernels.decode import plan_decode
    from snapquant.kernels.operands import KernelOperands
    from snapquant.kernels.triton.common import OP_F32

    cache = PagedMLACache.empty(2, 128, 512, 64, SNAPMLA, device="meta")
    q = torch.empty(2, 1, 16, 576, dtype=torch.bfloat16, device="meta")
    plan = plan_decode(q, KernelOperands.from_paged(cache), 0.1, SNAPMLA, 2, fp8_mma=fp8_mma, native=True, num_sms=132)
    kw = plan.launches[0].kwargs
    assert (kw["QK_KIND"], kw["PV_KIND"]) == kinds and kw["NATIVE"] and kw["num_warps"] == 8
    cpu = plan_decode(*make_case(SNAPMLA, [10], H=2)[:1], KernelOperands.from_paged(make_case(SNAPMLA, [10], H=2)[2]),
                      0.1, SNAPMLA, 1, fp8_mma=fp8_mma)
    assert cpu.launches[0].kwargs["QK_KIND"] == OP_F32 and "num_warps" not in cpu.launches[0].kwargs


@pytest.mark.parametrize("tile", ["rows", "pairs", "tokens"])
def test_p_div_fma_is_the_exact_division_bitwise(tile):
    """p_div='fma' (a reciprocal per row, one fma correction per element) computes the correctly rounded
    f / pi, so with one split it reproduces p_div='exact' bit for bit; 'rcp' alone is only within ~1 ulp.
    Wide-range logits make many distinct pi and quotients near e4m3 rounding midpoints."""
    config = CONFIGS["snapmla"]
    q, _, cache, _ = make_case(config, [1, 63, 64, 65, 130, 200], H=4, S=2, seed=21)
    q = q * 6
    exact = mla_decode(q, cache, 0.1, config, num_splits=1, tile=tile)
    fma = mla_decode(q, cache, 0.1, config, num_splits=1, tile=tile, p_div="fma")
    assert torch.equal(exact[0], fma[0]) and torch.equal(exact[1], fma[1])


@triton.jit
def _page_weights_probe(F, P_OUT, PI_OUT, P_DIV: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    f = tl.load(F + offs)
    one = tl.full([M], 1.0, tl.float32)
    zero = tl.full([M], 0.0, tl.float32)
    p, _, _, pi, _ = _page_weights(f, f, one, zero, one, zero, 1, True, P_DIV, False)
    tl.store(P_OUT + offs, p)
    tl.store(PI_OUT + tl.arange(0, M), pi)


def _midpoint_rows(M: int = 64, N: int = 64, seed: int = 0) -> torch.Tensor:
    """Rows of f whose quotients f / pi (pi = rn(max f / 448)) fall within a few fp32 ulps of e4m3
    rounding midpoints, where a quotient that is off by one ulp can round to the other neighbour."""
    g = torch.Generator().manual_seed(seed)
    fmax = torch.exp(torch.empty(M, 1).uniform_(-30, 30, generator=g)).float()
    pi = fmax / 448
    exp = torch.randint(-6, 8, (M, N - 1), generator=g).float()
    mant = torch.randint(8, 16, (M, N - 1), generator=g).float()
    mid = (mant + 0.5) * torch.exp2(exp - 3)  # halfway between two e4m3 neighbours
    f = (mid * pi).float()
    ulps = torch.randint(-3, 4, (M, N - 1), generator=g).to(torch.int32)
    f = (f.view(torch.int32) + ulps).view(torch.float32)
    return torch.cat([fmax, f.clamp(max=fmax)], dim=1).contiguous()


def test_p_division_modes_on_rounding_midpoints():
    """P^ = e4m3(f / pi): 'exact' and 'fma' equal torch's correctly rounded division on quotients placed
    at e4m3 midpoints; 'rcp' (f * rn(1 / pi)) does not always (why it is not the default)."""
    from snapquant.kernels._launch import for_device

    f = _midpoint_rows()
    pi_ref = f[:, :1] / 448
    want = (f / pi_ref).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    got = {}
    for mode, pdiv in (("exact", 0), ("rcp", 1), ("fma", 2)):
        p_out, pi_out = torch.empty_like(f), torch.empty(f.shape[0])
        for_device(_page_weights_probe, f.device)[(1,)](f, p_out, pi_out, P_DIV=pdiv, M=f.shape[0], N=f.shape[1])
        assert torch.equal(pi_out, pi_ref[:, 0])
        got[mode] = p_out
    assert torch.equal(got["exact"], want)
    assert torch.equal(got["fma"], want)
    assert not torch.equal(got["rcp"], want)  # the probe does reach the cases that matter


def test_default_splits_fill_the_last_wave():
    """About 2 programs per SM, but never a last wave that is mostly empty (one program per SM runs at a
    time): 32 requests on 132 SMs take 12 splits (384 programs, 3 full waves), not 9 (288: 2.2 of 3)."""
    from snapquant.kernels.dispatch import default_splits as _default_splits

    assert _default_splits(32, 256, 132) == 12  # 384 programs: 3 full waves (9 splits: 288, 2.2 of 3)
    assert _default_splits(64, 512, 132) == 6  # 384, not 320 programs
    assert _default_splits(32, 10, 132) == 8  # at most 10 pages: fewer splits then
    for programs, pages, want in ((128, 64, 3), (8, 512, 33), (4, 128, 64), (2, 512, 64), (256, 64, 2)):
        assert _default_splits(programs, pages, 132) == want  # already-full waves keep the old count
    for programs in range(1, 300):
        s = _default_splits(programs, 512, 132)
        total = programs * s
        assert 1 <= s <= 64 and (total / (-(-total // 132) * 132) >= 0.9 or s in (1, 64))


def test_maxnreg_reaches_gpu_launches_and_is_validated():
    """maxnreg (a register cap, e.g. two resident programs per SM) is a launch option of GPU plans only."""
    from snapquant.errors import ConfigError
    from snapquant.kernels.decode import plan_decode
    from snapquant.kernels.operands import KernelOperands

    cache = PagedMLACache.empty(2, 128, 512, 64, SNAPMLA, device="meta")
    q = torch.empty(2, 1, 16, 576, dtype=torch.bfloat16, device="meta")
    ops = KernelOperands.from_paged(cache)
    plan = plan_decode(q, ops, 0.1, SNAPMLA, 2, maxnreg=128, num_stages=1, native=True, num_sms=132)
    assert plan.launches[0].kwargs["maxnreg"] == 128 and plan.launches[0].kwargs["num_stages"] == 1
    assert "maxnreg" not in plan_decode(q, ops, 0.1, SNAPMLA, 2, native=True, num_sms=132).launches[0].kwargs
    with pytest.raises(ConfigError, match="maxnreg"):
        plan_decode(q, ops, 0.1, SNAPMLA, 2, maxnreg=0, native=True, num_sms=132)
