"""The presets named after other implementations, bit for bit against independent NumPy re-implementations
of the arithmetic of the code they name (float64 NumPy, every fp32 rounding made explicit):

- ds_v32: FlashMLA's reference quantizer for the DeepSeek-V3.2 fp8 sparse cache (`quantize_k_cache` in
  deepseek-ai/FlashMLA tests/quant.py): per 128-channel tile s = amax / 448 in fp32, clamped at fp32(1e-4),
  rounded up to 2^ceil(log2 s) with an fp32 logarithm; codes e4m3(x / s); RoPE kept as given.
- ds_v32_vllm: vLLM's fp8_ds_mla cache writer (`concat_and_cache_ds_mla_kernel`, csrc/cache_kernels.cu):
  per 128-channel tile s = max(amax / 448.f, FLT_MIN), stored as a plain fp32; codes
  __nv_cvt_float_to_fp8(x / s, __NV_SATFINITE, E4M3); 512 + 16 + 128 = 656 bytes per token.
- per_tensor_fp8_vllm: vLLM's MLA kv scale with calculate_kv_scales (`MLAAttention.calc_kv_scales`): one
  scale amax(kv_c_normed) / K_SCALE_CONSTANT (200) from the first forward, shared by the latent and the
  RoPE key (`concat_and_cache_mla` converts both with it), then frozen.
- fp8_kivi: per-channel scales over each completed group of 64 tokens, which later tokens never saturate,
  unlike a per-channel scale frozen at the prefill.

Inputs include zero, tiny (below the 1e-4 clamp), subnormal and huge tiles, and tiles whose scale lies a
few fp32 steps above a power of two, where FlashMLA's fp32 logarithm rounds to the integer below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from snapquant import PRESETS, bytes_per_token, quantize_kv
from snapquant.attention.storage import DenseLatentStore
from snapquant.errors import ConfigError
from snapquant.kernels import supports, unsupported_reason
from snapquant.quant.scales import pow2_ceil, pow2_ceil_log2f

F64 = np.float64
FLT_MIN = np.float32(2.0**-126)


def f32(x) -> np.ndarray:
    """Round float64 values to fp32 (one rounding: exact for the quotients of fp32 numbers used here);
    beyond fp32's range: inf, as an fp32 operation gives."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=F64).astype(np.float32)


def np_e4m3(v: np.ndarray) -> np.ndarray:
    """Round to e4m3fn, nearest even, saturating at +-448 (SATFINITE; FlashMLA's values never exceed 448
    by more than the log2 rounding, which also saturates), from the format's definition: 3 mantissa bits,
    normal exponents down to -6, subnormal step 2^-9."""
    a = np.abs(v.astype(F64))
    _, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    step = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    q = np.minimum(np.round(a / step) * step, 448.0)  # np.round: half to even
    return np.sign(v) * q


def np_flashmla_v32(latent: np.ndarray, tile: int = 128):
    """FlashMLA's quantize_k_cache (V32_FP8Sparse) for the NoPE part, following its arithmetic:
    `abs(x).max(-1).float() / 448.0` (an fp32 division), `clamp_min(., 1e-4)` (the bound taken as fp32),
    `.log2()` (an fp32 result, here the correctly rounded one), `.ceil()`, `pow(2, .)`, and
    `(x.float() / scale).to(float8_e4m3fn)`. -> (codes as values, scales [..., n_tiles])."""
    x = latent.astype(np.float32)
    tiles = x.reshape(*x.shape[:-1], -1, tile)
    amax = np.abs(tiles).max(-1)
    s = f32(amax.astype(F64) / 448.0)
    s = np.maximum(s, np.float32(1e-4))
    log2 = f32(np.log2(s.astype(F64)))
    scale = f32(np.ldexp(1.0, np.ceil(log2).astype(int)))
    codes = np_e4m3(f32(tiles.astype(F64) / scale[..., None].astype(F64)))
    return codes.reshape(x.shape), scale


def np_vllm_ds_mla(latent: np.ndarray, tile: int = 128):
    """vLLM's concat_and_cache_ds_mla_kernel for the NoPE part: tile_scale = fmaxf(max_abs / 448.f, FLT_MIN),
    codes = cvt_float_to_fp8(x / tile_scale, SATFINITE). -> (codes as values, scales [..., n_tiles])."""
    x = latent.astype(np.float32)
    tiles = x.reshape(*x.shape[:-1], -1, tile)
    amax = np.abs(tiles).max(-1)
    scale = np.maximum(f32(amax.astype(F64) / 448.0), FLT_MIN)
    codes = np_e4m3(f32(tiles.astype(F64) / scale[..., None].astype(F64)))
    return codes.reshape(x.shape), scale


def tiles_of_every_kind(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [3, 40, 512] (four 128-channel tiles per token) and rope [3, 40, 64] in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 40
    mag = torch.logspace(-9, 30, B * T * 4, dtype=torch.float64)[torch.randperm(B * T * 4, generator=g)]
    latent = (torch.randn(B * T * 4, 128, generator=g, dtype=torch.float64) * mag[:, None]).view(B, T, 512)
    latent[0, 0] = 0.0  # a zero token: every tile's scale is the clamp (FlashMLA 2^-13, vLLM FLT_MIN)
    latent[0, 1, 128:256] = 0.0  # one zero tile among non-zero ones
    latent[0, 2] = torch.randn(512, generator=g, dtype=torch.float64) * 1e-39  # subnormal tiles
    latent[0, 3, :128] = 1e-3 * torch.rand(128, generator=g, dtype=torch.float64)  # tiny: below the clamp
    latent[0, 4, :4] = torch.tensor([3.3e38, -3.3e38, 1.0, 1e-30])  # huge tile next to small values
    latent[0, 5] = 448.0 * 2.0 ** torch.arange(-20, 12).repeat(16)[:512].double()  # scales exactly 2^k
    # scales a few fp32 steps above a power of two: amax = 448 * 2^k * (1 + m 2^-23)
    k = torch.arange(-13, 27).repeat_interleave(4)[: 4 * 40]
    m = torch.arange(1, 5).repeat(40)[: 4 * 40]
    amax = 448.0 * torch.ldexp(1 + m.double() * 2.0**-23, k)
    grid = torch.rand(4 * 40, 128, generator=g, dtype=torch.float64) * 2 - 1
    grid[:, 7] = 1.0
    latent[1] = (grid * amax[:, None]).view(40, 512)
    rope = torch.randn(B, T, 64, generator=g, dtype=torch.float64) * 50
    return latent.to(dtype), rope.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ds_v32_is_flashmla_reference_quantizer_bit_for_bit(dtype):
    latent, rope = tiles_of_every_kind(dtype)
    kv = quantize_kv(latent, rope, PRESETS["ds_v32"])
    codes, scale = np_flashmla_v32(latent.float().numpy())
    np.testing.assert_array_equal(kv.latent.scale.numpy().view(np.uint32), scale.view(np.uint32))
    np.testing.assert_array_equal(kv.latent.codes_f32().numpy(), codes)
    assert kv.latent.scale.shape == (3, 40, 4) and kv.latent.scale.dtype == torch.float32
    assert (kv.latent.scale >= 2.0**-13).all()  # the 1e-4 clamp: no tile scale below 2^-13
    # FlashMLA's dequantize_k_cache: code * scale in fp32, then bf16 (exact: 4 significant bits times 2^k;
    # a huge tile's 448 * 2^k may overflow to inf, in FlashMLA's reference too)
    deq = f32((codes.reshape(3, 40, 4, 128) * scale[..., None].astype(F64)).reshape(3, 40, 512))
    lat_deq, _ = kv.dequantize()
    np.testing.assert_array_equal(lat_deq.numpy(), deq)
    if dtype == torch.bfloat16:  # FlashMLA keeps the RoPE part in the input dtype
        assert torch.equal(kv.rope.data.view(torch.int16), rope.view(torch.int16))
    if dtype == torch.float32:  # the fp32-only tiles just above a power of two: some round down
        s_exact = latent[1].abs().view(40, 4, 128).amax(-1) / 448
        assert (kv.latent.scale[1] < s_exact).any() and kv.latent.codes_f32()[1].abs().max() == 448


def test_flashmla_fp32_log2_is_what_torch_computes_on_this_cpu():
    """FlashMLA's reference calls torch.log2 on fp32 scales and takes the ceiling. Just above a power of two
    (where the rounding of the logarithm decides the tile scale) PyTorch's CPU log2 is the correctly rounded
    one that `pow2_ceil_log2f` models, bit for bit; just below one it may be 1 ulp off on some CPUs (seen:
    1 of 10160 values near 1 - 2^-22, on one AVX512 machine), which never moves the ceiling, the only thing
    the scale rule uses."""
    k = torch.arange(-126, 128)[:, None].expand(-1, 40)
    m = torch.arange(0, 40, dtype=torch.float64)[None, :].expand(254, -1)
    above = torch.ldexp(1 + m * 2.0**-23, k).flatten().float()
    below = torch.ldexp(1 - m * 2.0**-24, k).flatten().float()
    below = below[below > 0]
    for s, exact in ((above, True), (below, False)):
        want = f32(np.log2(s.numpy().astype(F64)))
        got = torch.log2(s).numpy()
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
            assert ulps.max() <= 1, ulps.max()
        np.testing.assert_array_equal(np.ceil(got), np.ceil(want))
    assert torch.equal(pow2_ceil_log2f(above), torch.exp2(torch.ceil(torch.log2(above))).clamp(2.0**-127, 2.0**127))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashmla_log2_rounding_never_matters_for_16_bit_activations(dtype):
    """Over every positive finite bf16 / fp16 amax, amax / 448 is never within a few fp32 steps above a power
    of two, so FlashMLA's power of two is the exact ceiling of max(amax / 448, 1e-4) on every tile of a
    16-bit model (the log2 rounding matters only for fp32 inputs)."""
    bits = torch.arange(1, 0x7F80 if dtype == torch.bfloat16 else 0x7C00, dtype=torch.int32).to(torch.int16)
    amax = bits.view(dtype).float()
    s = amax / torch.tensor(448.0)
    got = quantize_kv(amax.view(-1, 1, 1).expand(-1, 1, 128), torch.zeros(amax.numel(), 1, 64),
                      PRESETS["ds_v32"].replace(block_size=128)).latent.scale.flatten()
    assert torch.equal(got, torch.clamp_min(pow2_ceil(s.clamp_min(1e-4)), 2.0**-13))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ds_v32_vllm_is_vllm_fp8_ds_mla_writer_bit_for_bit(dtype):
    latent, rope = tiles_of_every_kind(dtype, seed=1)
    cfg = PRESETS["ds_v32_vllm"]
    kv = quantize_kv(latent, rope, cfg)
    codes, scale = np_vllm_ds_mla(latent.float().numpy())
    np.testing.assert_array_equal(kv.latent.scale.numpy().view(np.uint32), scale.view(np.uint32))
    np.testing.assert_array_equal(kv.latent.codes_f32().numpy(), codes)
    assert kv.latent.scale[0, 0].tolist() == [2.0**-126] * 4  # a zero tile: FLT_MIN
    assert kv.latent.data.dtype == torch.float8_e4m3fn and kv.rope.data.dtype == torch.bfloat16
    lat_deq, _ = kv.dequantize(torch.float64)
    deq = (codes.reshape(3, 40, 4, 128) * scale[..., None].astype(F64)).reshape(3, 40, 512)
    np.testing.assert_array_equal(lat_deq.numpy(), f32(deq))  # code * s, one fp32 rounding
    # the 656-byte entry: 512 e4m3 codes, 4 fp32 tile scales, 64 bf16 RoPE values
    assert bytes_per_token(cfg) == 512 + 4 * 4 + 64 * 2 == 656
    assert kv.nbytes == 3 * 40 * 656


def test_ds_v32_and_ds_v32_vllm_differ_only_in_the_tile_scales():
    g = torch.Generator().manual_seed(2)
    latent = (torch.randn(2, 30, 512, generator=g) * torch.logspace(-3, 3, 30)[:, None]).bfloat16()
    rope = torch.randn(2, 30, 64, generator=g).bfloat16()
    x = latent.float()
    for name in ("ds_v32", "ds_v32_vllm"):
        kv = quantize_kv(latent, rope, PRESETS[name])
        s = kv.latent.token_scales().repeat_interleave(128, dim=-1)
        # e4m3 of the same tiles: within half a step (2^-4 relative, or half the subnormal step s 2^-10)
        err = (kv.dequantize()[0] - x).abs()
        assert (err <= torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)).all(), name
        assert torch.equal(kv.rope.data.view(torch.int16), rope.view(torch.int16))
    pow2 = quantize_kv(latent, rope, PRESETS["ds_v32"]).latent.scale
    plain = quantize_kv(latent, rope, PRESETS["ds_v32_vllm"]).latent.scale
    # bf16 input: FlashMLA's scale is vLLM's rounded up to a power of two exactly (a bf16 amax / 448 is never
    # a few fp32 steps above a power of two), and at least 2^-13 (the 1e-4 clamp)
    assert torch.equal(pow2, torch.clamp_min(pow2_ceil(plain), 2.0**-13))
    assert (pow2 > plain).any() and (pow2 == 2.0**-13).any()


def np_vllm_per_tensor(first_latent: np.ndarray, latent: np.ndarray, rope: np.ndarray, k_range: float = 200.0):
    """vLLM's MLA fp8 cache with calculate_kv_scales: k_scale = abs(kv_c_normed).max() / k_range over the first
    forward (the latent only, every token of the batch), then kv_c and k_pe both stored as
    cvt_float_to_fp8(x / k_scale, SATFINITE). (vLLM would divide by zero on an all-zero first batch;
    snapquant clamps the scale at FLT_MIN there.)"""
    s = np.maximum(f32(np.abs(first_latent.astype(np.float32)).max().astype(F64) / k_range), FLT_MIN)
    lat = np_e4m3(f32(latent.astype(np.float32).astype(F64) / F64(s)))
    rp = np_e4m3(f32(rope.astype(np.float32).astype(F64) / F64(s)))
    return s, lat, rp


def _chunks(B=3, sizes=(9, 1, 4, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, S in enumerate(sizes):
        lat = torch.randn(B, S, 64, generator=g) * (1 + 3 * torch.rand(B, S, 1, generator=g)) * (1 if i == 0 else 4)
        rope = torch.randn(B, S, 16, generator=g) * 30
        valid = torch.ones(B, S, dtype=torch.bool)
        if i == 0:
            valid[1, :3] = False  # left padding, never stored, never in the scale
            lat[1, :3] = 1e6
        out.append((lat, rope, valid))
    return out


def test_per_tensor_fp8_vllm_one_shared_scale_from_the_prefill_latent():
    cfg = PRESETS["per_tensor_fp8_vllm"]
    store = DenseLatentStore(cfg, 64, 16, torch.float32)
    chunks = _chunks()
    for c in chunks:
        store.append(*c)
    (seg,) = store.segments()
    lat0, _, valid0 = chunks[0]
    for b in range(3):
        lat = torch.cat([c[0][b][c[2][b]] for c in chunks]).numpy()
        rope = torch.cat([c[1][b][c[2][b]] for c in chunks]).numpy()
        s, want_l, want_r = np_vllm_per_tensor(lat0[valid0].numpy(), lat, rope)
        n = lat.shape[0]
        assert seg.kv.latent.scale_f32().flatten().tolist() == [float(s)]  # the prefill's, frozen
        np.testing.assert_array_equal(seg.kv.latent.codes_f32()[b, :n].numpy(), want_l)
        np.testing.assert_array_equal(seg.kv.rope.codes_f32()[b, :n].numpy(), want_r)
        assert seg.kv.rope.scale is None and seg.kv.rope_prescaled  # RoPE has no scale of its own
    # RoPE (|r| ~ 30-100) and the 4x larger later latents exceed 448 * s = 2.24 amax: they saturate
    assert float(seg.kv.rope.codes_f32().abs().max()) == 448.0
    assert float(seg.kv.latent.codes_f32().abs().max()) == 448.0
    assert store.nbytes() == int(store.lengths.sum()) * bytes_per_token(cfg, 64, 16) + 4  # one fp32 scale
    assert bytes_per_token(cfg) == 576


def test_per_tensor_fp8_vllm_quantize_kv_matches_numpy_and_dequantizes_with_the_shared_scale():
    g = torch.Generator().manual_seed(5)
    latent, rope = torch.randn(2, 33, 512, generator=g), torch.randn(2, 33, 64, generator=g) * 3
    kv = quantize_kv(latent, rope, PRESETS["per_tensor_fp8_vllm"])
    s, want_l, want_r = np_vllm_per_tensor(latent.numpy(), latent.numpy(), rope.numpy())
    np.testing.assert_array_equal(kv.latent.codes_f32().numpy(), want_l)
    np.testing.assert_array_equal(kv.rope.codes_f32().numpy(), want_r)
    lat, rp = kv.dequantize(torch.float64)
    np.testing.assert_array_equal(lat.numpy(), f32(want_l * F64(s)))
    np.testing.assert_array_equal(rp.numpy(), f32(want_r * F64(s)))


def test_per_tensor_fp8_dynamic_is_not_vllms_scale():
    """per_tensor_fp8_dynamic gives each part its own amax / 448; vLLM shares amax(latent) / 200."""
    g = torch.Generator().manual_seed(6)
    latent, rope = torch.randn(1, 20, 64, generator=g), torch.randn(1, 20, 16, generator=g) * 40
    dyn = quantize_kv(latent, rope, PRESETS["per_tensor_fp8_dynamic"])
    vllm = quantize_kv(latent, rope, PRESETS["per_tensor_fp8_vllm"])
    assert float(dyn.latent.scale_f32()) == pytest.approx(float(latent.abs().max()) / 448, rel=1e-6)
    assert float(dyn.rope.scale_f32()) == pytest.approx(float(rope.abs().max()) / 448, rel=1e-6)
    assert float(vllm.latent.scale_f32()) == pytest.approx(float(latent.abs().max()) / 200, rel=1e-6)
    assert vllm.rope.scale is None


# ---------------------------------------------------------------- per-channel: grouped vs frozen


def test_fp8_kivi_groups_rescale_while_a_frozen_per_channel_scale_clips():
    """Later tokens 8x larger than the prefill: per-channel scales recomputed per completed group of 64
    (fp8_kivi) keep every stored value within e4m3's half-step; the same per-channel granularity with the
    scale frozen at the prefill saturates them (the policy, not the granularity, causes the clipping)."""
    g = torch.Generator().manual_seed(7)
    kivi = PRESETS["fp8_kivi"]
    frozen = kivi.replace(token_group=None)
    prefill = torch.randn(2, 70, 64, generator=g)
    later = [torch.randn(2, 1, 64, generator=g) * 8 for _ in range(80)]
    rope = torch.zeros(2, 1, 16)
    stores = {}
    for name, cfg in (("kivi", kivi), ("frozen", frozen)):
        store = DenseLatentStore(cfg, 64, 16, torch.float32)
        store.append(prefill, torch.zeros(2, 70, 16))
        for t in later:
            store.append(t, rope)
        stores[name] = store
    x = torch.cat([prefill, *later], dim=1)  # 150 tokens: two complete groups of 64, 22 in the window
    kv_store = stores["kivi"]
    q_seg, r_seg = kv_store.segments()
    assert q_seg.lengths.tolist() == [128, 128] and r_seg.lengths.tolist() == [22, 22]
    for grp in range(2):  # each group's scale: its own per-channel amax / 448
        sl = slice(64 * grp, 64 * (grp + 1))
        want = np.maximum(f32(x[:, sl].abs().amax(1).numpy().astype(F64) / 448.0), 0)
        np.testing.assert_array_equal(q_seg.kv.latent.scale_f32()[:, grp].numpy(), want)
        codes = np_e4m3(f32(x[:, sl].numpy().astype(F64) / want[:, None, :].astype(F64)))
        np.testing.assert_array_equal(q_seg.kv.latent.codes_f32()[:, sl].numpy(), codes)
    assert torch.equal(r_seg.kv.latent.codes_f32()[:, :22], x[:, 128:])  # the window stays in 16 bits
    lat_kivi, _ = stores["kivi"].dequantize()
    lat_frozen, _ = stores["frozen"].dequantize()
    assert ((lat_kivi - x).abs() <= x.abs() * 2.0**-4 + 1e-30).all()
    clipped = (lat_frozen - x).abs() > x.abs() * 2.0**-4 + 1e-30
    assert clipped[:, 70:].float().mean() > 0.5 and not clipped[:, :70].any()
    assert bytes_per_token(kivi) == 512 + 512 * 4 / 64 + 128 == 672


# ---------------------------------------------------------------- kernels: which presets they run


def test_kernel_support_of_the_named_presets():
    assert supports(PRESETS["ds_v32"]) and supports(PRESETS["ds_v32_vllm"])  # the ds_v32 page layout
    assert "rope_dtype='fp8_e4m3' has no kernel layout" in unsupported_reason(PRESETS["per_tensor_fp8_vllm"])
    assert "nope_granularity='per_channel'" in unsupported_reason(PRESETS["fp8_kivi"])


@pytest.mark.parametrize("name", ["per_tensor_fp8_vllm", "fp8_kivi"])
def test_backends_fall_back_or_refuse_with_the_reason(name, monkeypatch):
    from snapquant.attention import backends
    from snapquant.attention.backends import resolve_backend

    monkeypatch.setattr(backends, "_FALLBACKS_NOTED", set())  # the note is given once per config
    cfg = PRESETS[name]
    why = unsupported_reason(cfg)
    with pytest.warns(UserWarning, match=f"backend='auto' does not run 'triton' for '{name}'") as caught:
        assert resolve_backend("auto", cfg, torch.device("cuda")).name == "reference"  # only the device type is read
    assert why in str(caught[0].message)
    with pytest.raises(ConfigError, match=f"does not implement config '{name}'") as err:
        resolve_backend("triton", cfg, torch.device("cuda"))
    assert why in str(err.value)
    assert resolve_backend("auto", cfg, torch.device("cpu")).name == "reference"  # no kernels off CUDA anyway
