"""Fused quantize-and-append: new latent and RoPE rows -> codes, scales and RoPE in the paged cache.

One program per new token. Bit-exact to `snapquant.quantize_kv` (the reference quantizer):
    snapmla  s = amax(|c|) / 448 (1 if amax = 0, floored), code = e4m3(c / s), rope = bf16(clamp(r / s))
    ds_v32   per block of `block_size` channels: s_k = pow2_ceil(amax_k / 448), code = e4m3(c / s_k),
             rope = bf16(r)
    bf16     latent = bf16(c), rope = bf16(r)
with correctly rounded divisions (div_rn) and round-to-nearest-even casts, so the stored bits equal
the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import KVQuantConfig
from ..errors import ConfigError, ShapeError
from ._checks import check_shape, check_tensor, raise_on_flags
from ._launch import for_device, interpreting
from ._tl import BF16_MAX, E4M3_MAX, bf16_bits_to_f32, rmax, scale_rule, store_bf16_bits, store_e4m3
from .layouts import PAGE_SIZE, layout_of
from .paged import PagedMLACache

_LAYOUT_ID = {"bf16": 0, "snapmla": 1, "ds_v32": 2}
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _load_f32(ptrs, BITS16: tl.constexpr):
    if BITS16:  # bf16 passed as int16 bits
        return bf16_bits_to_f32(tl.load(ptrs))
    else:
        return tl.load(ptrs).to(tl.float32)


@triton.jit
def _quantize_append_kernel(
    LAT_IN, ROPE_IN, SLOTS, LAT, ROPE, SCALE,
    stride_li, stride_ri,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk,
    R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, LAYOUT: tl.constexpr, POW2: tl.constexpr,
    LAT_BITS16: tl.constexpr, ROPE_BITS16: tl.constexpr, NATIVE: tl.constexpr, PAGE: tl.constexpr,
):
    BW: tl.constexpr = R // NB
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:  # negative slots are padding: nothing is written
        page = slot // PAGE
        row = slot % PAGE
        offs = tl.arange(0, NB)[:, None] * BW + tl.arange(0, BW)[None, :]  # [NB, BW]: one row per scale block
        offs_d = tl.arange(0, D)[None, :]
        x = _load_f32(LAT_IN + t * stride_li + offs, LAT_BITS16)
        r = _load_f32(ROPE_IN + t * stride_ri + offs_d, ROPE_BITS16)  # [1, D]
        lat_ptr = LAT + page * stride_lp + row * stride_lt + offs
        rope_ptr = ROPE + page * stride_rp + row * stride_rt + offs_d
        if LAYOUT == 0:
            tl.store(lat_ptr, store_bf16_bits(x, NATIVE))
            tl.store(rope_ptr, store_bf16_bits(r, NATIVE))
        else:
            s = scale_rule(rmax(tl.abs(x), 1, NATIVE), POW2)  # [NB]
            q = tl.clamp(tl.math.div_rn(x, s[:, None]), -E4M3_MAX, E4M3_MAX)
            tl.store(lat_ptr, store_e4m3(q, NATIVE))
            tl.store(SCALE + page * stride_sp + row * stride_st + tl.arange(0, NB) * stride_sk, s)
            if LAYOUT == 1:  # pre-scaled domain: RoPE divided by the token's (single) scale
                r = tl.clamp(tl.math.div_rn(r, s[:, None]), -BF16_MAX, BF16_MAX)
            tl.store(rope_ptr, store_bf16_bits(r, NATIVE))


def quantize_append(
    latent: torch.Tensor,
    rope: torch.Tensor,
    paged_cache: PagedMLACache,
    slot_mapping: torch.Tensor,
    config: KVQuantConfig | None = None,
    *,
    check_bounds: bool = True,
) -> None:
    """Quantize new tokens and write them into `paged_cache` at `slot_mapping` (in place).

    Args:
        latent: `[..., r]` NoPE latent after kv_a_layernorm (bf16, fp16 or fp32).
        rope: `[..., d]` rotated shared RoPE key, same leading shape.
        paged_cache: destination; its `lengths` are not changed (see `PagedMLACache.append`).
        slot_mapping: `[...]` int32/int64 slots (page * 64 + row); negative entries are skipped.
        config: must match the cache's storage (default: the cache's config).
        check_bounds: verify every slot lies inside the page pool (one device sync).
    """
    if not isinstance(paged_cache, PagedMLACache):
        raise ShapeError(f"paged_cache must be a PagedMLACache, got {type(paged_cache).__name__}")
    cache = paged_cache
    config = cache.config if config is None else config
    if layout_of(config) != cache.layout:
        raise ConfigError(f"config {config.label()!r} stores the {layout_of(config)} layout but the cache "
                          f"holds the {cache.layout} layout")
    if config.scale_format != cache.config.scale_format or config.block_size != cache.config.block_size:
        raise ConfigError("config's scale_format/block_size differ from the cache's config")
    dev = cache.device
    check_tensor("latent", latent, dtypes=_IN_DTYPES, ndim=range(1, 9), device=dev)
    check_tensor("rope", rope, dtypes=_IN_DTYPES, ndim=range(1, 9), device=dev)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64), ndim=range(0, 8), device=dev,
                 last_contiguous=False)
    lead = tuple(slot_mapping.shape)
    r, d = cache.kv_lora_rank, cache.rope_dim
    check_shape("latent", latent, (*lead, r), " (slot_mapping's shape + kv_lora_rank)")
    check_shape("rope", rope, (*lead, d), " (slot_mapping's shape + rope_dim)")
    latent, rope = latent.reshape(-1, r), rope.reshape(-1, d)
    slots = slot_mapping.reshape(-1).contiguous()
    n = slots.numel()
    if n == 0:
        return
    if check_bounds:
        raise_on_flags((slots >= cache.num_pages * PAGE_SIZE).any()[None], [
            f"slot_mapping has a slot beyond the page pool ({cache.num_pages} pages x {PAGE_SIZE} slots)"])

    interp = interpreting(dev)
    nb = max(cache.num_scale_blocks, 1)
    lat_out = cache.latent.view(torch.int16) if cache.layout == "bf16" else (
        cache.latent.view(torch.uint8) if interp else cache.latent)
    scale = cache.scale if cache.scale is not None else cache.lengths  # unused by the bf16 layout
    s_strides = (scale.stride(0), scale.stride(1), scale.stride(2) if scale.dim() == 3 else 0) \
        if cache.scale is not None else (0, 0, 0)
    kernel = for_device(_quantize_append_kernel, dev)
    kernel[(n,)](
        _bits(latent), _bits(rope), slots, lat_out, cache.rope.view(torch.int16), scale,
        latent.stride(0), rope.stride(0),
        cache.latent.stride(0), cache.latent.stride(1), cache.rope.stride(0), cache.rope.stride(1), *s_strides,
        R=r, D=d, NB=nb, LAYOUT=_LAYOUT_ID[cache.layout], POW2=config.scale_format == "pow2",
        LAT_BITS16=latent.dtype == torch.bfloat16, ROPE_BITS16=rope.dtype == torch.bfloat16,
        NATIVE=not interp, PAGE=PAGE_SIZE,
    )


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x
