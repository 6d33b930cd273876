"""Triton kernels of the fused quantize-and-append: new latent and RoPE rows -> codes, scales, RoPE in pages.

One program per new token. Bit-exact to `snapquant.quantize_kv` (the reference quantizer):
    snapmla  s = amax(|c|) / 448 (1 if amax = 0, floored), code = e4m3(c / s), rope = bf16(clamp(r / s))
    ds_v32   per block of `block_size` channels: s_k = the config's scale rule of amax_k (FlashMLA's
             power of two for the ds_v32 preset, vLLM's fp32 max(amax_k / 448, FLT_MIN) for ds_v32_vllm),
             code = e4m3(c / s_k), rope = bf16(r)
    bf16     latent = bf16(c), rope = bf16(r)
with correctly rounded divisions (div_rn) and round-to-nearest-even casts, so the stored bits equal
the reference's.

`_quantize_append_tokens` quantizes a block of tokens per program as a [tokens x scale blocks, block
width] tile (fewer, larger programs for big appends such as a long prefill). Every token is still
quantized on its own with the same operations, so the stored bits are the same (`scripts/
check_kernels_gpu.py` checks both on a GPU). `launch_append` runs either over raw tensors; the checked
entry point is `snapquant.kernels.quantize_append` (`paged.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import for_device, interpreting
from ..layouts import LAYOUT_ID, PAGE_SIZE
from .common import (
    BF16_MAX,
    E4M3_MAX,
    SCALE_RULE_ID,
    bf16_bits_to_f32,
    cache_scale,
    rmax,
    store_bf16_bits,
    store_e4m3,
)


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
    RULE: tl.constexpr, DIV: tl.constexpr,
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
            s = cache_scale(rmax(tl.abs(x), 1, NATIVE), POW2, RULE, DIV)  # [NB]
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
    RULE: tl.constexpr, DIV: tl.constexpr,
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
        s = cache_scale(rmax(tl.abs(x), 1, NATIVE), POW2, RULE, DIV)  # [BLOCK_T * NB]
        q = tl.clamp(tl.math.div_rn(x, s[:, None]), -E4M3_MAX, E4M3_MAX)
        tl.store(lat_ptr, store_e4m3(q, NATIVE), mask=ok[:, None])
        tl.store(SCALE + (slot // PAGE) * stride_sp + (slot % PAGE) * stride_st + blk * stride_sk, s, mask=ok)
        if LAYOUT == 1:  # one scale per token (NB == 1): latent row i is token i
            r = tl.clamp(tl.math.div_rn(r, s[:, None]), -BF16_MAX, BF16_MAX)
        tl.store(rope_ptr, store_bf16_bits(r, NATIVE), mask=r_ok[:, None])


def launch_append(
    latent: torch.Tensor,
    rope: torch.Tensor,
    slots: torch.Tensor,
    cache_latent: torch.Tensor,
    cache_scale: torch.Tensor,
    cache_rope: torch.Tensor,
    *,
    layout: str,
    num_scale_blocks: int,
    pow2: bool,
    tokens_per_program: int,
    scale_rule: str = "snapquant",
    divisor: float | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize `latent` [n, r] / `rope` [n, d] into page slots `slots` [n] of the cache tensors (trusted:
    the caller checked shapes, dtypes, devices and bounds); `cache_scale` is any tensor for the bf16
    layout (never read). The compiled kernels on a GPU, their interpreted twins on CPU."""
    n, r = latent.shape
    d = rope.shape[-1]
    dev = cache_latent.device
    interp = interpreting(dev)
    lat_out = cache_latent.view(torch.int16) if layout == "bf16" else (
        cache_latent.view(torch.uint8) if interp else cache_latent)
    s_strides = (0, 0, 0) if layout == "bf16" else (
        cache_scale.stride(0), cache_scale.stride(1), cache_scale.stride(2) if cache_scale.dim() == 3 else 0)
    args = (latent.stride(0), rope.stride(0),
            cache_latent.stride(0), cache_latent.stride(1), cache_rope.stride(0), cache_rope.stride(1), *s_strides)
    consts = dict(R=r, D=d, NB=num_scale_blocks, LAYOUT=LAYOUT_ID[layout], POW2=pow2,
                  RULE=SCALE_RULE_ID[scale_rule],
                  DIV=float(E4M3_MAX.value if divisor is None else divisor),
                  LAT_BITS16=latent.dtype == torch.bfloat16, ROPE_BITS16=rope.dtype == torch.bfloat16,
                  NATIVE=not interp, PAGE=PAGE_SIZE)
    if num_warps is not None and not interp:
        consts["num_warps"] = num_warps
    tensors = (_bits(latent), _bits(rope), slots, lat_out, cache_rope.view(torch.int16), cache_scale)
    if tokens_per_program == 1:
        for_device(_quantize_append_kernel, dev)[(n,)](*tensors, *args, **consts)
    else:
        for_device(_quantize_append_tokens, dev)[(triton.cdiv(n, tokens_per_program),)](
            *tensors, n, *args, BLOCK_T=tokens_per_program, **consts)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x
