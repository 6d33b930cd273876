"""Triton kernel of the MoE gate: act(gate) * up over the grouped rows, in one pass.

transformers' default gate (`integrations.moe._default_apply_gate`, SiLU for the DeepSeek families) runs

    gate, up = gate_up.chunk(2, dim=-1); silu(gate) * up

as two kernels over a [T*k, N] tensor, writing silu(gate) in between: ~13 GB of traffic per MoE layer of
a batch-128 1K-token prefill at DeepSeek-V2-Lite sizes (T*k = 786432 rows, N = 1408), against 6.6 read
and written here. The arithmetic is torch's, operation for operation, so the bits are the same:

  * silu: x / (1 + exp(-x)) in fp32 (torch's CUDA kernel: opmath x, `exp` the accurate expf, which is
    libdevice's `exp`, not Triton's `tl.exp` (an ex2.approx); the division correctly rounded, `div_rn`),
    rounded to the tensor's dtype (the intermediate torch stores);
  * the product of that rounded value and `up` in fp32, rounded to the dtype.
The GPU test checks the bits against transformers' function; `gate_reference` is the torch expression.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._launch import for_device, interpreting
from .common import bf16_bits_to_f32, store_bf16_bits


@triton.jit
def _round_to(x, OUT, BF16_BITS: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 -> the value of OUT's dtype nearest to it, back in fp32 (what a store and reload gives)."""
    if BF16_BITS:
        return bf16_bits_to_f32(store_bf16_bits(x, NATIVE))
    else:
        return x.to(OUT.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_mul_kernel(GU, OUT, R, N, stride_g, stride_o, BR: tl.constexpr, BI: tl.constexpr,
                     BF16_BITS: tl.constexpr, NATIVE: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (r < R)[:, None] & (c < N)[None, :]
    base = GU + r.to(tl.int64)[:, None] * stride_g + c[None, :]
    g = tl.load(base, mask=m, other=0)
    u = tl.load(base + N, mask=m, other=0)
    if BF16_BITS:
        g = bf16_bits_to_f32(g)
        u = bf16_bits_to_f32(u)
    else:
        g = g.to(tl.float32)
        u = u.to(tl.float32)
    if NATIVE:
        e = libdevice.exp(-g)
    else:  # the interpreter runs numpy's float32 exp (it has no libdevice)
        e = tl.exp(-g)
    s = tl.math.div_rn(g, 1.0 + e)
    s = _round_to(s, OUT, BF16_BITS, NATIVE)
    y = s * u
    o_ptrs = OUT + r.to(tl.int64)[:, None] * stride_o + c[None, :]
    if BF16_BITS:
        tl.store(o_ptrs, store_bf16_bits(y, NATIVE), mask=m)
    else:
        tl.store(o_ptrs, y.to(OUT.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up [R, 2N]` (gate columns first) -> `silu(gate) * up [R, N]` in its dtype (bf16, fp16 or fp32)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype not in (torch.bfloat16, torch.float16,
                                                                             torch.float32):
        raise ValueError(f"silu_mul: gate_up must be [R, 2N] in bf16, fp16 or fp32, got {tuple(gate_up.shape)} "
                         f"{gate_up.dtype}")
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    R, N = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(R, N, dtype=gate_up.dtype, device=gate_up.device)
    native = not interpreting(gate_up.device)
    bits = gate_up.dtype == torch.bfloat16
    BR, BI = 8, 256
    kernel = for_device(_silu_mul_kernel, gate_up.device)
    extra = {"enable_fp_fusion": False, "num_warps": 4} if native else {}
    kernel[(triton.cdiv(R, BR), triton.cdiv(N, BI))](
        gate_up.view(torch.int16) if bits else gate_up, out.view(torch.int16) if bits else out, R, N,
        gate_up.stride(0), out.stride(0), BR=BR, BI=BI, BF16_BITS=bits, NATIVE=native, **extra)
    return out


def gate_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' default gate with SiLU, in torch operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
