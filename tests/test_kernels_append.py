"""Fused quantize-and-append (snapquant.kernels.quantize_append), in the Triton interpreter.

Contract: the stored codes, scales and RoPE are bit-identical to `snapquant.quantize_kv` for the
snapmla, ds_v32 and bf16 layouts (any input dtype), at the slots given, and nothing else is written.
"""

from __future__ import annotations

import pytest
import torch

from snapquant import PRESETS, quantize_kv
from snapquant.errors import ConfigError, ShapeError
from snapquant.kernels import PagedMLACache, quantize_append

# rope / a floored scale overflows fp32 before the clamp to the bf16 range, in the reference too.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")

CONFIGS = {
    "snapmla": PRESETS["snapmla"],
    "snapmla_pow2": PRESETS["snapmla"].replace(scale_format="pow2"),
    "ds_v32": PRESETS["ds_v32"].replace(block_size=32),  # 4 power-of-two scales per token at r = 128 (FlashMLA's)
    "ds_v32_one_block": PRESETS["ds_v32"],  # block 128 = r: one scale
    "ds_v32_exact_pow2": PRESETS["ds_v32"].replace(block_size=32, scale_rule="snapquant"),
    "ds_v32_vllm": PRESETS["ds_v32_vllm"].replace(block_size=32),  # vLLM's fp32 tile scales
    "ds_v32_vllm_amax200": PRESETS["ds_v32_vllm"].replace(block_size=32, scale_divisor=200.0),
    "bf16": PRESETS["bf16"],
}


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so comparisons are exact (NaN == NaN, -0 != +0)."""
    if t.dtype in (torch.float8_e4m3fn,):
        return t.view(torch.uint8)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def inputs(n: int, r: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)][:, None]
    latent = torch.randn(n, r, generator=g) * mag
    rope = torch.randn(n, d, generator=g) * 30
    latent[0] = 0.0  # amax 0 -> scale 1
    latent[1] = 1e-30  # below the scale floor
    rope[1] = 1e13  # rope / floored scale overflows bf16 -> saturates (snapmla)
    latent[2, :5] = torch.tensor([448.0, -1e4, 3.0, 0.5, 2.0**-20])
    latent[3] = 2.0 ** torch.arange(r, dtype=torch.float32).remainder(40).sub(20)  # exact powers of two
    return latent.to(dtype), rope.to(dtype)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_bit_exact_against_quantize_kv(name, dtype):
    config = CONFIGS[name]
    r, d, n = 128, 32, 96
    latent, rope = inputs(n, r, d, dtype)
    if dtype == torch.float16:  # keep the float16 inputs finite
        latent, rope = latent.float().clamp(-6e4, 6e4).half(), rope.float().clamp(-6e4, 6e4).half()
    ref = quantize_kv(latent, rope, config)
    cache = PagedMLACache.empty(1, 300, r, d, config)
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(cache.num_pages * 64, generator=g)[:n]  # scattered over pages and rows
    before = {k: raw(v).clone() for k, v in _parts(cache).items()}
    quantize_append(latent, rope, cache, slots)
    page, row = slots // 64, slots % 64
    assert torch.equal(raw(cache.latent[page, row]), raw(ref.latent.data))
    assert torch.equal(raw(cache.rope[page, row]), raw(ref.rope.data))
    if cache.scale is not None:
        got = cache.scale[page, row].reshape(n, -1)
        assert torch.equal(raw(got), raw(ref.latent.scale.reshape(n, -1)))
    # Nothing outside the given slots changed.
    untouched = torch.ones(cache.num_pages, 64, dtype=torch.bool)
    untouched[page, row] = False
    for k, v in _parts(cache).items():
        assert torch.equal(raw(v)[untouched], before[k][untouched]), k


def _parts(cache: PagedMLACache) -> dict[str, torch.Tensor]:
    parts = {"latent": cache.latent, "rope": cache.rope}
    if cache.scale is not None:
        parts["scale"] = cache.scale
    return parts


def test_negative_slots_are_skipped_and_leading_dims_flatten():
    config = CONFIGS["snapmla"]
    latent, rope = inputs(12, 64, 16, torch.bfloat16)
    cache = PagedMLACache.empty(1, 64, 64, 16, config)
    slots = torch.arange(12).view(3, 4)
    slots[1] = -1  # padding tokens
    quantize_append(latent.view(3, 4, 64), rope.view(3, 4, 16), cache, slots)
    ref = quantize_kv(latent, rope, config)
    keep = (slots.flatten() >= 0)
    assert torch.equal(raw(cache.latent[0, slots.flatten()[keep]]), raw(ref.latent.data[keep]))
    assert (raw(cache.latent[0, 4:8]) == 0).all() and (cache.scale[0, 4:8] == 1).all()


@pytest.mark.parametrize("name", ["snapmla", "ds_v32", "bf16"])
def test_incremental_append_equals_bulk_quantization(name):
    """Token-by-token decode appends == quantizing the whole sequence (per-token scales are causal)."""
    config = CONFIGS[name]
    B, r, d = 2, 128, 16
    latent, rope = inputs(B * 70, r, d, torch.bfloat16)
    latent, rope = latent.view(B, 70, r), rope.view(B, 70, d)
    cache = PagedMLACache.empty(B, 140, r, d, config, num_pages=7)  # one spare page
    cache.append(latent[:, :40], rope[:, :40])  # a prefill that ends mid-page
    for t in range(40, 70):
        cache.append(latent[:, t:t + 1], rope[:, t:t + 1])
    assert cache.lengths.tolist() == [70, 70]
    got, ref = cache.to_quantized_kv(70), quantize_kv(latent, rope, config)
    assert torch.equal(raw(got.latent.data), raw(ref.latent.data))
    assert torch.equal(raw(got.rope.data), raw(ref.rope.data))
    if ref.latent.scale is not None:
        assert torch.equal(got.latent.scale, ref.latent.scale)


def test_append_validation():
    config = CONFIGS["snapmla"]
    cache = PagedMLACache.empty(2, 64, 64, 16, config)
    lat, rope = torch.randn(3, 64), torch.randn(3, 16)
    ok_slots = torch.tensor([0, 1, 2])
    with pytest.raises(ShapeError, match="slot_mapping has a slot beyond the page pool"):
        quantize_append(lat, rope, cache, torch.tensor([0, 1, 128]))
    with pytest.raises(ShapeError, match="latent must have shape"):
        quantize_append(torch.randn(3, 32), rope, cache, ok_slots)
    with pytest.raises(ShapeError, match="rope must have shape"):
        quantize_append(lat, torch.randn(2, 16), cache, ok_slots)
    with pytest.raises(ShapeError, match=r"latent has dtype torch\.int32"):
        quantize_append(lat.int(), rope, cache, ok_slots)
    with pytest.raises(ShapeError, match=r"slot_mapping has dtype torch\.float32"):
        quantize_append(lat, rope, cache, ok_slots.float())
    with pytest.raises(ShapeError, match="latent must be contiguous in its last dim"):
        quantize_append(torch.randn(64, 3).t(), rope, cache, ok_slots)
    with pytest.raises(ShapeError, match="latent is on meta"):
        quantize_append(lat.to("meta"), rope, cache, ok_slots)
    with pytest.raises(ConfigError, match="ds_v32 layout but the cache holds the snapmla layout"):
        quantize_append(lat, rope, cache, ok_slots, PRESETS["ds_v32"])
    with pytest.raises(ShapeError, match="overflows a request's pages"):
        cache.append(torch.randn(2, 65, 64), torch.randn(2, 65, 16))
    with pytest.raises(ShapeError, match=r"latent must be \[B=2, n, r\]"):
        cache.append(torch.randn(3, 1, 64), torch.randn(3, 1, 16))


@pytest.mark.parametrize("name", ["snapmla", "snapmla_pow2", "ds_v32", "ds_v32_vllm", "bf16"])
@pytest.mark.parametrize("tpp", [2, 8])
def test_tokens_per_program_is_bit_exact(name, tpp):
    """The block-of-tokens kernel (the benchmark's append variant) stores exactly what quantize_kv computes,
    at scattered slots, skipping negative slots, with a token count that is not a multiple of the
    block; nothing else in the pool changes."""
    config = CONFIGS[name]
    r, d, n = 128, 32, 45
    latent, rope = inputs(n, r, d, torch.float32, seed=tpp)
    ref = quantize_kv(latent, rope, config)
    cache = PagedMLACache.empty(1, 300, r, d, config)
    slots = torch.randperm(cache.num_pages * 64, generator=torch.Generator().manual_seed(tpp))[:n]
    slots[[3, 17]] = -1
    before = {k: raw(v).clone() for k, v in _parts(cache).items()}
    quantize_append(latent, rope, cache, slots, tokens_per_program=tpp)
    keep = slots >= 0
    page, row = slots[keep] // 64, slots[keep] % 64
    assert torch.equal(raw(cache.latent[page, row]), raw(ref.latent.data[keep]))
    assert torch.equal(raw(cache.rope[page, row]), raw(ref.rope.data[keep]))
    if cache.scale is not None:
        assert torch.equal(raw(cache.scale[page, row].reshape(int(keep.sum()), -1)),
                           raw(ref.latent.scale[keep].reshape(int(keep.sum()), -1)))
    untouched = torch.ones(cache.num_pages, 64, dtype=torch.bool)
    untouched[page, row] = False
    for k, v in _parts(cache).items():
        assert torch.equal(raw(v)[untouched], before[k][untouched]), k


def test_tokens_per_program_validation():
    cache = PagedMLACache.empty(1, 64, 64, 16, CONFIGS["snapmla"])
    lat, rope, slots = torch.randn(3, 64), torch.randn(3, 16), torch.tensor([0, 1, 2])
    for bad in (0, 3, True, 2.0):
        with pytest.raises(ShapeError, match="tokens_per_program"):
            quantize_append(lat, rope, cache, slots, tokens_per_program=bad)
    with pytest.raises(ShapeError, match="num_warps"):
        quantize_append(lat, rope, cache, slots, num_warps=0)


@pytest.mark.parametrize("tpp", [1, 8])
def test_flashmla_scales_just_above_a_power_of_two(tpp):
    """FlashMLA's scale 2^ceil(fl32(log2 s)) is 2^k, not 2^(k+1), for s a few fp32 steps above 2^k (the
    rounded logarithm is the integer k). The kernel's integer rule gives the quantizer's bits there, for
    scales from 2^-13 (the 1e-4 clamp) to 2^24, one tile per (k, mantissa step)."""
    config = PRESETS["ds_v32"].replace(block_size=32)
    ks, steps = torch.arange(-13, 25), torch.arange(0, 26)
    mant = (1 + steps.float() * 2.0**-23).expand(len(ks), -1)
    s = torch.ldexp(mant, ks[:, None].expand_as(mant)).flatten()  # exact in fp32
    tiles = s.numel()
    latent = torch.randn(tiles, 32, generator=torch.Generator().manual_seed(0)).clamp(-1, 1) * s[:, None]
    latent[:, 0] = s * 448  # the tile's amax: amax / 448 == s exactly
    latent = latent.reshape(-1, 128)  # four tiles per token
    rope = torch.zeros(latent.shape[0], 16)
    ref = quantize_kv(latent, rope, config)
    assert (ref.latent.scale_f32().flatten() < s).any()  # some tiles do round down
    cache = PagedMLACache.empty(1, latent.shape[0], 128, 16, config)
    slots = torch.arange(latent.shape[0])
    quantize_append(latent, rope, cache, slots, tokens_per_program=tpp)
    page, row = slots // 64, slots % 64
    assert torch.equal(raw(cache.scale[page, row]), raw(ref.latent.scale))
    assert torch.equal(raw(cache.latent[page, row]), raw(ref.latent.data))
