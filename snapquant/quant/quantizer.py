"""Pure-PyTorch quantizers: `quantize_kv(latent, rope, config) -> QuantizedKV`.

The arithmetic is the paper's, to the bit (docs/numerics.md, "Scales" and "Pre-scaled RoPE"):
    s = amax(|x|) / qmax in fp32  (s = 1 when amax = 0; floored at SCALE_FLOOR)
    s <- scale_format.round(s)    (fp32: unchanged; pow2 / e8m0: next power of two up)
    code = encode(x_fp32 / s)     (true fp32 quotient; fp8 round-to-nearest-even with saturation)
    pre-scaled RoPE: bf16(r_fp32 / s_token), saturated to the 16-bit range
                     (a quantized rope_dtype: encode(r_fp32 / s), vLLM's shared scale)
The `flashmla` and `vllm` scale rules replace the first two lines with those implementations' own
(`snapquant.quant.scales.rule_scale`), and `scale_divisor` replaces qmax.
Runs on any device; inputs of any float dtype are widened to fp32 first (exact for bf16/fp16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError, NonFiniteInputError, ShapeError
from .dtypes import SIXTEEN_BIT_MAX
from .scales import get_scale_format, rule_scale
from .tensor import QuantizedTensor

if TYPE_CHECKING:  # config imports the element formats from this package
    from ..config import KVQuantConfig


@dataclass
class QuantizedKV:
    """What a quantized MLA cache keeps for a run of tokens: the latent and RoPE parts."""

    latent: QuantizedTensor
    rope: QuantizedTensor
    config: KVQuantConfig
    rope_prescaled: bool = False
    """RoPE codes are bf16(r / s) with s = the latent's per-token scale (SnapMLA domain alignment)."""

    @property
    def num_tokens(self) -> int:
        return self.latent.num_tokens

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes + self.rope.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (latent [*lead, T, r], rope [*lead, T, d]) in `dtype` (fp32 by default, exact products)."""
        latent = self.latent.dequantize(torch.float32)
        rope = self.rope.dequantize(torch.float32)
        if self.rope_prescaled:
            rope = rope * self.latent.token_scales()
        return latent.to(dtype), rope.to(dtype)

    def to(self, device: torch.device | str) -> QuantizedKV:
        return QuantizedKV(self.latent.to(device), self.rope.to(device), self.config, self.rope_prescaled)


def quantize_kv(
    latent: torch.Tensor,
    rope: torch.Tensor,
    config: KVQuantConfig,
    *,
    check_finite: bool = True,
    nope_scale: torch.Tensor | None = None,
    rope_scale: torch.Tensor | None = None,
) -> QuantizedKV:
    """Quantize the MLA cache entries of a run of tokens.

    Args:
        latent: NoPE latent after kv_a_layernorm, `[..., T, kv_lora_rank]`.
        rope: rotated shared RoPE key, `[..., T, qk_rope_head_dim]` (same leading dims and T).
        config: the scheme (see `KVQuantConfig`, `PRESETS`).
        check_finite: raise `NonFiniteInputError` on NaN/Inf input instead of storing garbage.
        nope_scale / rope_scale: use these fp32 scales (canonical layout) instead of computing them,
            e.g. a per-tensor scale frozen at prefill by a cache.
    """
    _check_inputs(latent, rope)
    config.check_dims(latent.shape[-1], rope.shape[-1])
    if check_finite:
        for name, t in (("latent", latent), ("rope", rope)):
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise NonFiniteInputError(f"{name} contains NaN or Inf; pass check_finite=False to skip this check")

    q_latent = quantize_part(latent, config, "nope", scale=nope_scale)
    if config.rope_prescale:
        q_rope = _prescale_rope(rope, q_latent, config)
    else:
        q_rope = quantize_part(rope, config, "rope", scale=rope_scale)
    return QuantizedKV(q_latent, q_rope, config, rope_prescaled=config.rope_prescale)


def quantize_part(
    x: torch.Tensor, config: KVQuantConfig, part: str, scale: torch.Tensor | None = None
) -> QuantizedTensor:
    """Quantize one part ('nope' or 'rope') of the cache following `config`."""
    fmt = config.part_format(part)
    width = x.shape[-1]
    gran = config.part_granularity(part)
    x32 = x.to(torch.float32)
    if not fmt.is_quantized:
        return QuantizedTensor(fmt.encode(x32), None, fmt, None, gran, width, token_group=1)

    sfmt = get_scale_format(config.scale_format)
    T = x.shape[-2]
    token_group: int | None
    if scale is not None:
        s = scale.to(device=x.device, dtype=torch.float32)
        token_group = _token_group_for(gran, config, T)
    else:
        s, token_group = _compute_scales(x32, gran, config, part, fmt.qmax)
    expanded = _expand(s, x32.shape, token_group)
    codes = fmt.encode(x32 / expanded)
    return QuantizedTensor(codes, sfmt.encode(s), fmt, sfmt, gran, width, token_group)


def scale_for(amax: torch.Tensor, config: KVQuantConfig, qmax: float) -> torch.Tensor:
    """The stored-format fp32 scale for elements of max |x| `amax`, by the config's rule and divisor."""
    divisor = qmax if config.scale_divisor is None else config.scale_divisor
    return rule_scale(amax, divisor, config.scale_rule, get_scale_format(config.scale_format))


def _compute_scales(x32: torch.Tensor, gran: str, config: KVQuantConfig, part: str, qmax: float):
    """-> (scales in the canonical layout, exactly as stored (rounded by the scale format), token_group)."""
    T, width = x32.shape[-2], x32.shape[-1]
    a = x32.abs()
    if gran == "per_token":
        return scale_for(a.amax(dim=-1, keepdim=True), config, qmax), 1
    if gran == "per_token_block":
        nb = width // config.block_size
        amax = a.reshape(*a.shape[:-1], nb, config.block_size).amax(dim=-1)
        return scale_for(amax, config, qmax), 1
    if gran == "per_channel":
        G = config.token_group
        if G is None or G >= T:
            amax = a.amax(dim=-2, keepdim=True) if T else a.new_zeros(*a.shape[:-2], 1, width)
            return scale_for(amax, config, qmax), None
        n_groups = math.ceil(T / G)
        pad = n_groups * G - T
        if pad:
            a = torch.cat([a, a.new_zeros(*a.shape[:-2], pad, width)], dim=-2)
        amax = a.reshape(*a.shape[:-2], n_groups, G, width).amax(dim=-2)
        return scale_for(amax, config, qmax), G
    ones = (1,) * x32.dim()
    if gran == "per_tensor_dynamic":
        amax = a.amax() if a.numel() else a.new_zeros(())
        return scale_for(amax.reshape(ones), config, qmax), None
    if gran == "per_tensor_static":
        value = config.part_static_scale(part)
        if value is None:
            raise ConfigError(
                f"{part}_granularity='per_tensor_static' needs {part}_scale; set it in the config or fill it "
                f"with snapquant.calibrate(config, latent, rope)"
            )
        s = torch.full(ones, float(value), dtype=torch.float32, device=x32.device)
        return get_scale_format(config.scale_format).round(s), None
    raise ConfigError(f"{part}_granularity={gran!r} is not handled")  # unreachable: config validated


def _token_group_for(gran: str, config: KVQuantConfig, T: int) -> int | None:
    if gran in ("per_token", "per_token_block"):
        return 1
    if gran == "per_channel" and config.token_group is not None and config.token_group < T:
        return config.token_group
    return None


def _expand(s: torch.Tensor, shape: torch.Size, token_group: int | None) -> torch.Tensor:
    """Canonical-layout scales -> broadcastable to the full [*lead, T, width] tensor."""
    T, width = shape[-2], shape[-1]
    if token_group is not None and token_group > 1:
        s = s.repeat_interleave(token_group, dim=-2)[..., :T, :]
    nb = s.shape[-1]
    if nb > 1 and nb != width:
        s = s.repeat_interleave(width // nb, dim=-1)
    return s


def _prescale_rope(rope: torch.Tensor, q_latent: QuantizedTensor, config: KVQuantConfig) -> QuantizedTensor:
    """RoPE divided by the latent's scale (one per token; per-tensor: the same for all), no scale of its own."""
    fmt = config.rope_format
    s = q_latent.token_scales()  # [*lead, T, 1]
    x = rope.to(torch.float32) / s
    if fmt.is_quantized:  # vLLM's shared scale: the format's own encode (saturating)
        codes = fmt.encode(x)
    else:
        limit = SIXTEEN_BIT_MAX[fmt.storage_dtype]
        codes = x.clamp(-limit, limit).to(fmt.storage_dtype)
    return QuantizedTensor(codes, None, fmt, None, "per_token", rope.shape[-1], token_group=1)


def _check_inputs(latent: torch.Tensor, rope: torch.Tensor) -> None:
    for name, t in (("latent", latent), ("rope", rope)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ShapeError(f"{name} must be [..., T, width], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ShapeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if latent.shape[:-1] != rope.shape[:-1]:
        raise ShapeError(
            f"latent {tuple(latent.shape)} and rope {tuple(rope.shape)} must agree on all dims but the last"
        )
    if latent.device != rope.device:
        raise ShapeError(f"latent is on {latent.device} but rope is on {rope.device}")


def calibrate(config: KVQuantConfig, latent: torch.Tensor, rope: torch.Tensor,
              percentile: float = 100.0) -> KVQuantConfig:
    """Fill `nope_scale` / `rope_scale` of per_tensor_static parts from calibration activations.

    The scale is the `percentile` of |x| (100 = absmax) over all given tokens, turned into a scale by the
    config's rule and divisor exactly as a dynamic per-tensor scale would be.
    """
    _check_inputs(latent, rope)
    changes = {}
    for part, x in (("nope", latent), ("rope", rope)):
        if config.part_granularity(part) != "per_tensor_static" or not config.part_format(part).is_quantized:
            continue
        if part == "rope" and config.rope_prescale:
            continue
        a = x.detach().to(torch.float32).abs().flatten()
        if not 0 < percentile <= 100:
            raise ConfigError(f"percentile={percentile!r} is not valid; expected 0 < percentile <= 100")
        k = max(1, math.ceil(percentile / 100 * a.numel()))
        amax = a.max() if percentile >= 100 else a.kthvalue(k).values
        changes[f"{part}_scale"] = float(scale_for(amax, config, config.part_format(part).qmax))
    return config.replace(**changes) if changes else config
