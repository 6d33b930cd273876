"""Triton kernel of DeepSeek-V2's complex rotary embedding, query and key in one launch.

transformers' DeepSeek-V2 attention rotates its RoPE channels as complex numbers
(`modeling_deepseek_v2.apply_rotary_emb`):

    xq_ = view_as_complex(xq.float().reshape(..., -1, 2)); (the same for xk)
    xq_out = view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)

six kernels per layer and decode step (two fp32 copies, two complex products, two roundings back). Here one
launch rotates both with the same arithmetic: for a pair (a, b) and a rotation (c, d), torch's complex
product is a*c - b*d and a*d + b*c in fp32, each then rounded to the input dtype. How the compiler that built
torch contracted those into fmas decides their last bits, so the kernel has five candidates (`MODES`: each
part with or without an fma, and which product the fma keeps exact) and `snapquant.models.rotary` picks, on
the GPU it runs on, the one whose bits equal torch's on a probe input (none matching: torch's operations
stay). The interpreter (CPU tests) checks every mode against its own definition in float64 terms; the kernel
is launched with fp contraction off, so only the fmas written here are fmas.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import for_device, interpreting
from .common import bf16_bits_to_f32, store_bf16_bits

# (real part, imaginary part): 0 = no fma (both products rounded), 1 = fma keeping the first product exact
# (real fma(a, c, -(b d)), imag fma(a, d, b c)), 2 = fma keeping the second (real fma(-b, d, a c),
# imag fma(b, c, a d))
MODES = ((1, 1), (2, 2), (1, 2), (2, 1), (0, 0))
BLOCK = 1024  # (row, pair) elements per program


@triton.jit
def _part(x1, y1, x2, y2, SIGN: tl.constexpr, MODE: tl.constexpr):
    """x1 y1 + SIGN x2 y2 in fp32 with the contraction MODE (see MODES)."""
    if MODE == 1:
        return tl.fma(x1, y1, SIGN * (x2 * y2))
    elif MODE == 2:
        return tl.fma(SIGN * x2, y2, x1 * y1)
    else:
        return x1 * y1 + SIGN * (x2 * y2)


@triton.jit
def _rotate(X1, O1, X2, O2, F, n1, n, H1, H2, S, P, s1b, s1h, s1s, s2b, s2h, s2s, sfb, sfs,
            REAL_MODE: tl.constexpr, IMAG_MODE: tl.constexpr, BITS: tl.constexpr, NATIVE: tl.constexpr,
            BLOCK_E: tl.constexpr):
    """Rotate the channel pairs of X1 [B, H1, S, 2P] then X2 [B, H2, S, 2P] (any strides, pairs contiguous; the
    elements (b, h, s, p) of both numbered one after the other) by F [B, S, P] (complex64 as fp32 pairs) into the
    contiguous O1, O2."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = e < n
    first = e < n1
    i = tl.where(first, e, e - n1)  # element of its own tensor
    H = tl.where(first, H1, H2)
    p = i % P
    s = (i // P) % S
    h = (i // (P * S)) % H
    b = (i // (P * S * H)).to(tl.int64)
    x_ptr = tl.where(first, X1 + b * s1b + h * s1h + s * s1s, X2 + b * s2b + h * s2h + s * s2s) + 2 * p
    f_ptr = F + b * sfb + s * sfs + 2 * p
    if BITS:
        a = bf16_bits_to_f32(tl.load(x_ptr, mask=ok, other=0))
        bb = bf16_bits_to_f32(tl.load(x_ptr + 1, mask=ok, other=0))
    else:
        a = tl.load(x_ptr, mask=ok, other=0).to(tl.float32)
        bb = tl.load(x_ptr + 1, mask=ok, other=0).to(tl.float32)
    c = tl.load(f_ptr, mask=ok, other=0.0)
    d = tl.load(f_ptr + 1, mask=ok, other=0.0)
    re = _part(a, c, bb, d, -1.0, REAL_MODE)
    im = _part(a, d, bb, c, 1.0, IMAG_MODE)
    o_ptr = tl.where(first, O1, O2) + i.to(tl.int64) * 2  # the outputs are contiguous
    if BITS:
        tl.store(o_ptr, store_bf16_bits(re, NATIVE), mask=ok)
        tl.store(o_ptr + 1, store_bf16_bits(im, NATIVE), mask=ok)
    else:
        tl.store(o_ptr, re.to(O1.dtype.element_ty), mask=ok)
        tl.store(o_ptr + 1, im.to(O1.dtype.element_ty), mask=ok)


def rotary_reason(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> str | None:
    """Why `rotary_fused` cannot run this call (None when it can): CUDA, 4-D 16/32-bit queries and keys with
    contiguous channel pairs, complex64 rotations [B, S, P] (or [B, 1, S, P])."""
    if not xq.is_cuda:
        return "not a CUDA tensor"
    if xq.dim() != 4 or xk.dim() != 4 or xq.dtype != xk.dtype or xq.dtype not in (torch.bfloat16, torch.float16,
                                                                                   torch.float32):
        return f"query {tuple(xq.shape)} {xq.dtype} / key {tuple(xk.shape)} {xk.dtype}"
    if freqs_cis.dtype != torch.complex64 or freqs_cis.dim() not in (3, 4):
        return f"rotations {tuple(freqs_cis.shape)} {freqs_cis.dtype}, not complex64 [B, S, P]"
    f = freqs_cis if freqs_cis.dim() == 3 else freqs_cis[:, 0]
    B, _, S, D = xq.shape
    if D % 2 or tuple(f.shape) != (B, S, D // 2) or xk.shape[0] != B or xk.shape[2:] != (S, D):
        return f"shapes query {tuple(xq.shape)}, key {tuple(xk.shape)}, rotations {tuple(freqs_cis.shape)}"
    if xq.stride(-1) != 1 or xk.stride(-1) != 1 or f.stride(-1) != 1:
        return "channels not contiguous"
    return None


def rotary_fused(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor,
                 mode: tuple[int, int] = MODES[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_emb(xq [B, H, S, D], xk [B, Hk, S, D], freqs_cis [B, S, D/2] complex64)` of DeepSeek-V2 in
    one launch: both rotated, in their dtype, as new contiguous tensors (`mode`: the fma contraction, MODES)."""
    f = freqs_cis if freqs_cis.dim() == 3 else freqs_cis[:, 0]
    B, H1, S, D = xq.shape
    H2 = xk.shape[1]
    oq = torch.empty(B, H1, S, D, dtype=xq.dtype, device=xq.device)
    ok = torch.empty(B, H2, S, D, dtype=xk.dtype, device=xk.device)
    P = D // 2
    n1, n = B * H1 * S * P, B * (H1 + H2) * S * P
    if n == 0:
        return oq, ok
    native = not interpreting(xq.device)
    bits = xq.dtype == torch.bfloat16
    fr = torch.view_as_real(f)  # [B, S, P, 2] fp32
    views = [t.view(torch.int16) if bits else t for t in (xq, oq, xk, ok)]
    extra = {"enable_fp_fusion": False, "num_warps": 4} if native else {}
    for_device(_rotate, xq.device)[(triton.cdiv(n, BLOCK),)](
        *views, fr, n1, n, H1, H2, S, P, xq.stride(0), xq.stride(1), xq.stride(2), xk.stride(0), xk.stride(1),
        xk.stride(2), fr.stride(0), fr.stride(1), REAL_MODE=mode[0], IMAG_MODE=mode[1], BITS=bits,
        NATIVE=native, BLOCK_E=BLOCK, **extra)
    return oq, ok


def rotary_reference(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' DeepSeek-V2 `apply_rotary_emb`, in torch operations."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = (freqs_cis if freqs_cis.dim() == 4 else freqs_cis[:, None]).to(xq_.device)
    return (torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk))
