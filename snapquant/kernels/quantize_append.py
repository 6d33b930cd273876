"""Fused quantize-and-append: new latent and RoPE rows -> codes, scales and RoPE in the paged cache.

One program per new token. Bit-exact to `snapquant.quantize_kv` (the reference quantizer):
    snapmla  s = amax(|c|) / 448 (1 if amax = 0, floored), code = e4m3(c / s), rope = bf16(clamp(r / s))
    ds_v32   per block of `block_size` channels: s_k = pow2_ceil(amax_k / 448), code = e4m3(c / s_k),
             rope = bf16(r)
    bf16     latent = bf16(c), rope = bf16(r)
with correctly rounded divisions (div_rn) and round-to-nearest-even casts, so the stored bits equal
the reference's.

`tokens_per_program` > 1 runs `_quantize_append_tokens` instead: one program quantizes a block of
tokens as a [tokens x scale blocks, block width] tile (fewer, larger programs for big appends such as
a 64K-token prefill). Every token is still quantized on its own with the same operations, so the
stored bits are the same (checked on the H200 by scripts/bench_decode.py). Large appends use it by
default (results/bench/decode_h200.md: 3.1 TB/s with 8 tokens per program vs 1.9 TB/s with 1).
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

BIG_APPEND = 4096  # tokens; from here on the default is 8 tokens per program

_LAYOUT_ID = {"bf16": 0, "snapmla": 1, "ds_v32": 2}
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _load_f32(ptrs, BITS16: tl.constexpr):
    if BITS16:  # bf16 passed as int16 bits
        return bf16_bits_to_f32(tl.load(ptrs))
    else:
        return tl.load(ptrs).to(tl.float32)


@triton.jit
def _load_f32_masked(ptrs, BITS16: tl.constexpr, mask):
    if BITS16:
        return bf16_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


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


@triton.jit
def _quantize_append_tokens(
    LAT_IN, ROPE_IN, SLOTS, LAT, ROPE, SCALE, n_tokens,
    stride_li, stride_ri,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk,
    R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, LAYOUT: tl.constexpr, POW2: tl.constexpr,
    LAT_BITS16: tl.constexpr, ROPE_BITS16: tl.constexpr, NATIVE: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """BLOCK_T tokens per program; latent rows i of the [BLOCK_T * NB, BW] tile are (token i // NB,
    scale block i % NB). Same per-token arithmetic as `_quantize_append_kernel`; masked rows (past
    the end, or negative slots) are never stored."""
    BW: tl.constexpr = R // NB
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    ri = tl.arange(0, BLOCK_T * NB)
    tok = t0 + ri // NB
    blk = ri % NB
    slot = tl.load(SLOTS + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
    ok = slot >= 0
    slot = tl.where(ok, slot, 0)
    offs_w = tl.arange(0, BW)[None, :]
    x = _load_f32_masked(LAT_IN + tok[:, None] * stride_li + blk[:, None] * BW + offs_w, LAT_BITS16, ok[:, None])
    lat_ptr = LAT + (slot // PAGE)[:, None] * stride_lp + (slot % PAGE)[:, None] * stride_lt + blk[:, None] * BW + offs_w
    # RoPE rows, one per token
    rt = t0 + tl.arange(0, BLOCK_T)
    r_slot = tl.load(SLOTS + rt, mask=rt < n_tokens, other=-1).to(tl.int64)
    r_ok = r_slot >= 0
    r_slot = tl.where(r_ok, r_slot, 0)
    offs_d = tl.arange(0, D)[None, :]
    r = _load_f32_masked(ROPE_IN + rt[:, None] * stride_ri + offs_d, ROPE_BITS16, r_ok[:, None])
    rope_ptr = ROPE + (r_slot // PAGE)[:, None] * stride_rp + (r_slot % PAGE)[:, None] * stride_rt + offs_d
    if LAYOUT == 0:
        tl.store(lat_ptr, store_bf16_bits(x, NATIVE), mask=ok[:, None])
        tl.store(rope_ptr, store_bf16_bits(r, NATIVE), mask=r_ok[:, None])
    else:
        s = scale_rule(rmax(tl.abs(x), 1, NATIVE), POW2)  # [BLOCK_T * NB]
        q = tl.clamp(tl.math.div_rn(x, s[:, None]), -E4M3_MAX, E4M3_MAX)
        tl.store(lat_ptr, store_e4m3(q, NATIVE), mask=ok[:, None])
        tl.store(SCALE + (slot // PAGE) * stride_sp + (slot % PAGE) * stride_st + blk * stride_sk, s, mask=ok)
        if LAYOUT == 1:  # one scale per token (NB == 1): latent row i is token i
            r = tl.clamp(tl.math.div_rn(r, s[:, None]), -BF16_MAX, BF16_MAX)
        tl.store(rope_ptr, store_bf16_bits(r, NATIVE), mask=r_ok[:, None])


def quantize_append(
    latent: torch.Tensor,
    rope: torch.Tensor,
    paged_cache: PagedMLACache,
    slot_mapping: torch.Tensor,
    config: KVQuantConfig | None = None,
    *,
    check_bounds: bool = True,
    tokens_per_program: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize new tokens and write them into `paged_cache` at `slot_mapping` (in place).

    Args:
        latent: `[..., r]` NoPE latent after kv_a_layernorm (bf16, fp16 or fp32).
        rope: `[..., d]` rotated shared RoPE key, same leading shape.
        paged_cache: destination; its `lengths` are not changed (see `PagedMLACache.append`).
        slot_mapping: `[...]` int32/int64 slots (page * 64 + row); negative entries are skipped.
        config: must match the cache's storage (default: the cache's config).
        check_bounds: verify every slot lies inside the page pool (one device sync).
        tokens_per_program: tokens one program quantizes (a power of two). Default: 8 for appends of
            at least `BIG_APPEND` tokens (H200, 64K tokens: 3.1 TB/s vs 1.9 TB/s with 1), else 1 (one
            program per token: the least latency for a decode step's few tokens). Same bits either way.
        num_warps: launch knob (GPU only; default Triton's).
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

    if tokens_per_program is None:
        tokens_per_program = 8 if n >= BIG_APPEND else 1
    if (not isinstance(tokens_per_program, int) or isinstance(tokens_per_program, bool) or tokens_per_program < 1
            or tokens_per_program & (tokens_per_program - 1)):
        raise ShapeError(f"tokens_per_program must be a power of two >= 1, got {tokens_per_program!r}")
    if num_warps is not None and (not isinstance(num_warps, int) or num_warps < 1):
        raise ShapeError(f"num_warps must be a positive int, got {num_warps!r}")
    interp = interpreting(dev)
    nb = max(cache.num_scale_blocks, 1)
    lat_out = cache.latent.view(torch.int16) if cache.layout == "bf16" else (
        cache.latent.view(torch.uint8) if interp else cache.latent)
    scale = cache.scale if cache.scale is not None else cache.lengths  # unused by the bf16 layout
    s_strides = (scale.stride(0), scale.stride(1), scale.stride(2) if scale.dim() == 3 else 0) \
        if cache.scale is not None else (0, 0, 0)
    args = (latent.stride(0), rope.stride(0),
            cache.latent.stride(0), cache.latent.stride(1), cache.rope.stride(0), cache.rope.stride(1), *s_strides)
    consts = dict(R=r, D=d, NB=nb, LAYOUT=_LAYOUT_ID[cache.layout], POW2=config.scale_format == "pow2",
                  LAT_BITS16=latent.dtype == torch.bfloat16, ROPE_BITS16=rope.dtype == torch.bfloat16,
                  NATIVE=not interp, PAGE=PAGE_SIZE)
    if num_warps is not None and not interp:
        consts["num_warps"] = num_warps
    tensors = (_bits(latent), _bits(rope), slots, lat_out, cache.rope.view(torch.int16), scale)
    if tokens_per_program == 1:
        for_device(_quantize_append_kernel, dev)[(n,)](*tensors, *args, **consts)
    else:
        for_device(_quantize_append_tokens, dev)[(triton.cdiv(n, tokens_per_program),)](
            *tensors, n, *args, BLOCK_T=tokens_per_program, **consts)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x
