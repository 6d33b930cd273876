"""Triton kernel of the T5-style RMSNorm that the DeepSeek families run, in one pass.

transformers' `DeepseekV2RMSNorm` (and the same class in V3, Kimi, LongCat, ...) computes

    x = hidden.to(fp32); var = x.pow(2).mean(-1, keepdim=True)
    weight * (x * torch.rsqrt(var + eps)).to(hidden.dtype)

as eight kernels. In a captured decode step each is a few microseconds of launch and latency over a
[batch, hidden] tensor, and a V2-Lite step runs 81 of these norms (three per layer): ~570 launches that
one kernel per norm removes. In a batch-128 1K-token prefill the same expression moves ~9 GB per norm
(fp32 copies of a [131072, 2048] tensor) against ~1 GB here.

The arithmetic is torch's, operation for operation: squares rounded to fp32, their fp32 sum times
fp32(1 / N) (ATen's mean multiplies by that factor), + eps in fp32, the hardware reciprocal square root
(libdevice's `rsqrt`, which torch's CUDA `rsqrt` also compiles to), the product rounded to fp32, then to
the hidden dtype, then times the weight in fp32 rounded to the output dtype. Only the order of the fp32 sum
differs (a tree here, ATen's launch-dependent order there), so an output can differ from torch's by one
rounding of the hidden dtype where the fp32 value sits at a rounding boundary: rare (about 1e-4 of the
bf16 outputs), never more than that (tests/test_rms_norm.py bounds both). The launch disables fp
contraction, so each square is rounded before it is added, as in torch.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._launch import for_device, interpreting
from .common import bf16_bits_to_f32, rsum, store_bf16_bits

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Widest row one program holds in registers (the largest hidden size of the supported families is 7168).
MAX_WIDTH = 16384


@triton.jit
def _load_f32(ptrs, m, BITS: tl.constexpr):
    v = tl.load(ptrs, mask=m, other=0)
    if BITS:
        return bf16_bits_to_f32(v)
    else:
        return v.to(tl.float32)


@triton.jit
def _round_to(x, REF, BITS: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 -> the nearest value of REF's dtype (bf16 when BITS, REF being an int16 view), back in fp32."""
    if BITS:
        return bf16_bits_to_f32(store_bf16_bits(x, NATIVE))
    else:
        return x.to(REF.dtype.element_ty).to(tl.float32)


@triton.jit
def _rms_norm_kernel(X, W, OUT, N, stride_x, stride_o, inv_n, eps, BN: tl.constexpr,
                     X_BITS: tl.constexpr, W_BITS: tl.constexpr, OUT_BITS: tl.constexpr, NATIVE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BN)
    m = c < N
    x = _load_f32(X + row * stride_x + c, m, X_BITS)
    var = rsum(x * x, 0, NATIVE) * inv_n
    if NATIVE:
        r = libdevice.rsqrt(var + eps)
    else:  # the interpreter has no libdevice: numpy's float32 1 / sqrt
        r = 1.0 / tl.sqrt(var + eps)
    y = _round_to(x * r, X, X_BITS, NATIVE)  # hidden_states.to(input_dtype)
    o = _load_f32(W + c, m, W_BITS) * y
    if OUT_BITS:
        tl.store(OUT + row * stride_o + c, store_bf16_bits(o, NATIVE), mask=m)
    else:
        tl.store(OUT + row * stride_o + c, o.to(OUT.dtype.element_ty), mask=m)


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `rms_norm(x, weight, eps)` cannot run these tensors (None: it can)."""
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        return f"dtypes {x.dtype} / {weight.dtype} (bf16, fp16 or fp32 only)"
    if weight.dim() != 1 or x.shape[-1:] != weight.shape:
        return f"weight {tuple(weight.shape)} does not match the last dimension of hidden {tuple(x.shape)}"
    if not 0 < weight.shape[0] <= MAX_WIDTH:
        return f"hidden size {weight.shape[0]} (1 .. {MAX_WIDTH})"
    if x.device != weight.device:
        return f"hidden on {x.device}, weight on {weight.device}"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)` over the last dimension of `x [..., N]`,
    in `promote_types(weight.dtype, x.dtype)`: transformers' DeepSeek RMSNorm in one kernel."""
    reason = unsupported_reason(x, weight)
    if reason is not None:
        raise ValueError(f"rms_norm: {reason}")
    N = weight.shape[0]
    rows = x.reshape(-1, N)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    native = not interpreting(x.device)
    x_bits, w_bits, o_bits = (t == torch.bfloat16 for t in (x.dtype, weight.dtype, out_dtype))

    def view(t: torch.Tensor, bits: bool) -> torch.Tensor:
        return t.view(torch.int16) if bits else t

    BN = triton.next_power_of_2(N)
    kernel = for_device(_rms_norm_kernel, x.device)
    extra = {"enable_fp_fusion": False, "num_warps": 4 if BN <= 2048 else 8} if native else {}
    inv_n = float(np.float32(1.0) / np.float32(N))  # fp32(1 / N), ATen's mean factor
    kernel[(rows.shape[0],)](
        view(rows, x_bits), view(weight.contiguous(), w_bits), view(out, o_bits), N, rows.stride(0), out.stride(0),
        inv_n, float(np.float32(eps)), BN=BN, X_BITS=x_bits, W_BITS=w_bits, OUT_BITS=o_bits, NATIVE=native,
        **extra)
    return out.view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepSeek RMSNorm expression, in torch operations."""
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype)
