"""Quantizers: bit-exactness of the SnapMLA path against an independent NumPy implementation,
edge cases, scale formats, and hypothesis round-trip error bounds per dtype and granularity."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import snapquant as sq
from snapquant import KVQuantConfig, NonFiniteInputError
from snapquant.quant.dtypes import _pack_int4, _unpack_int4

# ---------------------------------------------------------------- independent NumPy reference


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """All finite non-negative e4m3fn values and their codes, decoded from bits by hand (not by torch)."""
    vals, codes = [], []
    for code in range(0x7F):  # 0x7F is NaN in e4m3fn; sign bit handled separately
        e, m = code >> 3, code & 7
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.append(v)
        codes.append(code)
    return np.array(vals), np.array(codes)


E4M3_VALS, E4M3_CODES = _e4m3_table()


def np_round_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to nearest e4m3 value, ties to even code, saturating at 448."""
    a = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    d = np.abs(a[..., None] - E4M3_VALS)
    best = d.min(axis=-1, keepdims=True)
    cand = d == best
    # among tied candidates choose the even code
    even = cand & (E4M3_CODES % 2 == 0)
    idx = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1))
    return np.sign(x) * E4M3_VALS[idx]


def np_round_bf16(x32: np.ndarray) -> np.ndarray:
    u = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def np_snapmla(latent: np.ndarray, rope: np.ndarray):
    """docs/numerics.md ("Scales", "Pre-scaled RoPE"), literally: s = amax/448 (fp32; 1 if amax = 0;
    floored at 2^-86 so that tokens of subnormals give finite quotients and pre-scaled RoPE stays in bf16
    range), code = e4m3(x/s),
    rope~ = bf16(r/s)."""
    latent = latent.astype(np.float32)
    amax = np.abs(latent).max(axis=-1, keepdims=True) if latent.shape[-2] else np.zeros((*latent.shape[:-1], 1))
    s = (amax.astype(np.float32) / np.float32(448.0)).astype(np.float32)
    s = np.where(amax == 0, np.float32(1.0), np.maximum(s, np.float32(2.0**-86))).astype(np.float32)
    codes = np_round_e4m3((latent / s).astype(np.float32))
    rope_t = np_round_bf16((rope.astype(np.float32) / s).astype(np.float32))
    return codes, s, rope_t


def _snapmla_inputs(seed: int, T: int = 97):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(3, T, 64, generator=g) * torch.logspace(-3, 3, 64)[torch.randperm(64, generator=g)]
    latent[0, 0] = 0.0  # a zero token
    latent[1, 1] = torch.randn(64, generator=g) * 1e-40  # subnormal token
    latent[2, 2, 5] = 3e4  # an outlier far beyond the fp8 range before scaling
    rope = torch.randn(3, T, 16, generator=g) * 100
    return latent, rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_snapmla_quantizer_is_bit_exact(seed, dtype):
    latent, rope = _snapmla_inputs(seed)
    latent, rope = latent.to(dtype), rope.to(dtype)
    kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])
    codes, s, rope_t = np_snapmla(latent.float().numpy(), rope.float().numpy())
    assert kv.latent.data.dtype == torch.float8_e4m3fn
    assert kv.latent.scale.dtype == torch.float32 and kv.latent.scale.shape == (3, 97, 1)
    assert kv.rope.data.dtype == torch.bfloat16
    np.testing.assert_array_equal(kv.latent.codes_f32().numpy(), codes)
    np.testing.assert_array_equal(kv.latent.scale.numpy(), s)
    np.testing.assert_array_equal(kv.rope.data.float().numpy(), rope_t)


@pytest.mark.parametrize("T", [0, 1])
def test_lengths_zero_and_one(T):
    latent, rope = torch.randn(2, T, 64), torch.randn(2, T, 16)
    for cfg in sq.PRESETS.values():
        if cfg.nope_granularity == "per_token_block":
            cfg = cfg.replace(block_size=32)  # DeepSeek's 128-channel blocks do not divide width 64
        kv = sq.quantize_kv(latent, rope, cfg)
        assert kv.num_tokens == T
        lat, rp = kv.dequantize()
        assert lat.shape == (2, T, 64) and rp.shape == (2, T, 16)
        assert torch.isfinite(lat).all() and torch.isfinite(rp).all()
    if T == 1:
        kv = sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])
        codes, s, rope_t = np_snapmla(latent.numpy(), rope.numpy())
        np.testing.assert_array_equal(kv.latent.codes_f32().numpy(), codes)
        np.testing.assert_array_equal(kv.latent.scale.numpy(), s)
        np.testing.assert_array_equal(kv.rope.data.float().numpy(), rope_t)


def test_zero_token_gets_unit_scale_and_exact_zero():
    latent = torch.zeros(1, 2, 64)
    latent[0, 1] = 1.0
    kv = sq.quantize_kv(latent, torch.randn(1, 2, 16), sq.PRESETS["snapmla"])
    assert kv.latent.scale[0, 0, 0] == 1.0
    assert (kv.dequantize()[0][0, 0] == 0).all()


@pytest.mark.parametrize("name", sorted(sq.PRESETS))
def test_extreme_finite_input_never_gives_nan_or_inf(name):
    cfg = sq.PRESETS[name]
    if cfg.nope_granularity == "per_token_block":
        cfg = cfg.replace(block_size=32)
    latent = torch.tensor([3e38, -3e38, 1e-45, 0.0] * 16).reshape(1, 1, 64).repeat(1, 4, 1)
    latent[0, 1] = 1e-44  # a token of subnormals only
    rope = torch.tensor([3e38, -1e-45, 7.0, 0.0] * 4).reshape(1, 1, 16).repeat(1, 4, 1)
    kv = sq.quantize_kv(latent, rope, cfg)
    lat, rp = kv.dequantize()
    assert torch.isfinite(lat).all() and torch.isfinite(rp).all(), name
    assert torch.isfinite(kv.latent.codes_f32()).all() and torch.isfinite(kv.rope.codes_f32()).all()


def test_static_scale_saturates_instead_of_overflowing():
    cfg = sq.PRESETS["per_tensor_fp8"]  # uncalibrated scale 1.0
    latent = torch.full((1, 2, 64), 1000.0)
    kv = sq.quantize_kv(latent, torch.full((1, 2, 16), -5000.0), cfg)
    lat, rp = kv.dequantize()
    assert (lat == 448).all() and (rp == -448).all()


def test_non_finite_input_raises_clearly():
    latent = torch.randn(2, 4, 64)
    latent[1, 2, 3] = float("nan")
    with pytest.raises(NonFiniteInputError, match="latent contains NaN or Inf"):
        sq.quantize_kv(latent, torch.randn(2, 4, 16), sq.PRESETS["snapmla"])
    rope = torch.randn(2, 4, 16)
    rope[0, 0, 0] = float("inf")
    with pytest.raises(NonFiniteInputError, match="rope"):
        sq.quantize_kv(torch.randn(2, 4, 64), rope, sq.PRESETS["snapmla"])


@pytest.mark.parametrize(
    "latent, rope, match",
    [
        (torch.randn(4, 64), torch.randn(5, 16), "must agree"),
        (torch.randn(64), torch.randn(16), r"\[\.\.\., T, width\]"),
        (torch.randint(0, 5, (4, 64)), torch.randn(4, 16), "floating"),
    ],
)
def test_bad_shapes_are_named(latent, rope, match):
    with pytest.raises(sq.ShapeError, match=match):
        sq.quantize_kv(latent, rope, sq.PRESETS["snapmla"])


# ---------------------------------------------------------------- scale formats


@pytest.mark.parametrize("fmt", ["pow2", "e8m0"])
def test_power_of_two_scales_round_up_and_never_saturate(fmt):
    # snapquant's rule: the exact power-of-two ceiling (ds_v32 itself clamps tiny tiles: test_scale_rules.py)
    cfg = sq.PRESETS["ds_v32"].replace(scale_format=fmt, scale_rule="snapquant")
    latent = torch.randn(2, 50, 256) * torch.logspace(-20, 20, 50)[:, None]
    kv = sq.quantize_kv(latent, torch.randn(2, 50, 64), cfg)
    s = kv.latent.scale_f32()
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all()  # exact powers of two
    raw = latent.abs().reshape(2, 50, 2, 128).amax(-1) / 448
    assert (s >= raw).all() and (s < 2 * raw).all()
    assert kv.latent.codes_f32().abs().max() <= 448
    if fmt == "e8m0":
        assert kv.latent.scale.dtype == torch.uint8
        ref = sq.quantize_kv(latent, torch.randn(2, 50, 64), cfg.replace(scale_format="pow2"))
        assert torch.equal(ref.latent.scale_f32(), s)
        assert torch.equal(ref.latent.data.view(torch.uint8), kv.latent.data.view(torch.uint8))


# ---------------------------------------------------------------- int4 packing


def test_int4_pack_unpack_exhaustive():
    vals = torch.arange(-8, 8, dtype=torch.int8)
    pairs = torch.cartesian_prod(vals, vals)  # every (even, odd) pair
    packed = _pack_int4(pairs)
    assert packed.dtype == torch.uint8 and packed.shape == (256, 1)
    assert torch.equal(_unpack_int4(packed), pairs)


# ---------------------------------------------------------------- causal consistency


@pytest.mark.parametrize("name", ["snapmla", "ds_v32", "int8_per_token", "rope_fp8_per_token", "per_tensor_fp8"])
def test_per_token_formats_quantize_each_token_independently(name):
    """Quantizing T tokens at once equals quantizing them one by one (what step-by-step decode stores)."""
    cfg = sq.PRESETS[name]
    latent, rope = torch.randn(2, 9, 256) * 5, torch.randn(2, 9, 32) * 40
    whole = sq.quantize_kv(latent, rope, cfg)
    for t in range(9):
        one = sq.quantize_kv(latent[:, t:t + 1], rope[:, t:t + 1], cfg)
        assert torch.equal(one.dequantize()[0], whole.dequantize()[0][:, t:t + 1])
        assert torch.equal(one.dequantize()[1], whole.dequantize()[1][:, t:t + 1])
    assert cfg.causal_consistent


def test_dynamic_formats_are_not_causal_and_say_so():
    cfg = sq.PRESETS["per_tensor_fp8_dynamic"]
    latent, rope = torch.randn(1, 9, 64), torch.randn(1, 9, 16)
    latent[0, -1] *= 1000  # a late outlier changes the scale of every earlier token
    whole = sq.quantize_kv(latent, rope, cfg).dequantize()[0][:, :1]
    first = sq.quantize_kv(latent[:, :1], rope[:, :1], cfg).dequantize()[0]
    assert not torch.equal(whole, first)
    assert not cfg.causal_consistent


def test_per_channel_token_groups_layout():
    cfg = sq.PRESETS["int4_kivi"]  # token_group 32
    latent, rope = torch.randn(2, 70, 64), torch.randn(2, 70, 16)
    kv = sq.quantize_kv(latent, rope, cfg)
    assert kv.latent.scale.shape == (2, 3, 64)  # ceil(70 / 32) groups x channels
    assert kv.latent.token_scales().shape == (2, 70, 64)
    # each group's scale is its own per-channel amax / 7
    g1 = latent[:, 32:64].abs().amax(dim=1) / 7
    assert torch.equal(kv.latent.scale_f32()[:, 1], g1)


# ---------------------------------------------------------------- hypothesis: round-trip bounds

# Worst-case |x - deq(x)| per element, as a function of the element and its scale s:
#   float formats: half an ulp of the code (relative 2^-(mantissa+1)) or half the subnormal step
#   int formats:   s / 2
BOUNDS = {
    "fp8_e4m3": lambda x, s: torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10),
    "fp8_e5m2": lambda x, s: torch.maximum(x.abs() * 2.0**-3, s * 2.0**-17),
    "int8": lambda x, s: s / 2,
    "int4": lambda x, s: s / 2,
    "bf16": lambda x, s: x.abs() * 2.0**-8,
    "fp16": lambda x, s: torch.maximum(x.abs() * 2.0**-11, torch.full_like(x, 2.0**-25)),
}


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(list(BOUNDS)),
    gran=st.sampled_from(["per_tensor_dynamic", "per_channel", "per_token", "per_token_block"]),
    scale_format=st.sampled_from(["fp32", "pow2", "e8m0"]),
    T=st.integers(1, 40),
    log_mag=st.floats(-6, 4),
    outliers=st.booleans(),
    token_group=st.sampled_from([None, 4, 16]),
    other_rule=st.booleans(),
    seed=st.integers(0, 2**16),
)
# a tie (x / s = 91.5) whose dequantized value rounds away in fp32: once past the bound without the ulp term
@example(dtype="int8", gran="per_token_block", scale_format="fp32", T=16, log_mag=0.0, outliers=False,
         token_group=None, other_rule=False, seed=5360)
def test_round_trip_error_bounds(dtype, gran, scale_format, T, log_mag, outliers, token_group, other_rule, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, 64, generator=g) * 10.0**log_mag
    if outliers:
        x[..., 3] *= 300.0
    if dtype == "fp16":
        x = x.clamp(-6e4, 6e4)
    knobs = {} if dtype in ("bf16", "fp16") else {"nope_granularity": gran, "scale_format": scale_format}
    if knobs and gran == "per_token_block":  # set only the knobs this format reads
        knobs["block_size"] = 16
    if knobs and gran == "per_channel":
        knobs["token_group"] = token_group
    if knobs and other_rule:  # FlashMLA's clamped powers of two, or vLLM's fp32 scales
        knobs["scale_rule"] = "vllm" if scale_format == "fp32" else "flashmla"
    cfg = KVQuantConfig(nope_dtype=dtype, rope_prescale=False, rope_dtype="bf16", **knobs)
    kv = sq.quantize_kv(x, torch.zeros(2, T, 8), cfg)
    deq = kv.latent.dequantize()
    if kv.latent.scale is None:
        s = torch.ones_like(x)
    else:
        s = kv.latent.token_scales().repeat_interleave(kv.latent.block_width, dim=-1)
    err = (x - deq).abs()
    # deq = fl32(code * s) carries its own rounding, half an fp32 ulp of |deq| <= |x| + s: on a tie (x / s exactly
    # k + 1/2, e.g. int8 at 91.5) that alone can push the error past s / 2 by ~1e-5 relative
    assert (err <= BOUNDS[dtype](x, s) * (1 + 1e-6) + (x.abs() + s) * 2.0**-24).all()
    # dynamic scales never saturate: the largest code reaches qmax but never exceeds it
    fmt = cfg.nope_format
    if fmt.is_quantized:
        assert kv.latent.codes_f32().abs().max() <= fmt.qmax


def test_quantized_kv_moves_between_devices_unchanged():
    kv = sq.quantize_kv(torch.randn(2, 5, 64), torch.randn(2, 5, 16), sq.PRESETS["ds_model1"].replace(block_size=32))
    moved = kv.to("cpu")
    assert moved.nbytes == kv.nbytes and moved.rope_prescaled == kv.rope_prescaled
    assert moved.latent.scale.dtype == torch.uint8  # e8m0 exponents stay bytes
    for a, b in zip(moved.dequantize(), kv.dequantize(), strict=True):
        assert torch.equal(a, b)
