"""Triton kernels of absorbed MLA's per-head projections around the decode: one launch each (CUDA).

Each decode step of each layer projects the query into the latent space and the latent output back:

    q_abs[h] = [W_UK[h]^T q_nope[h] | q_rope[h]]   fp32, from exact products (`reference.absorb_query`)
    out[h]   = W_UV[h] o[h]                         fp32 from exact products, then the model's dtype

In torch operations (`reference.absorb.absorb_query` / `project_output` with fp32=True) that is a bmm with an
fp32 output, transposes and a cat for the query, and for the output the fp32 `o` split into three bf16 parts
(hi + mid + lo == o exactly, so one bf16 bmm gives exact products), the bmm, two adds, a transpose copy and
the final rounding: ~15 launches per layer and step, each a few microseconds of a CUDA-graph replay
whatever its size. Here:

  * `absorb_query_fused`: per (head, row block, latent block) one bf16 dot [rows, dn] x [dn, r block] with
    fp32 accumulation (a bf16 x bf16 product is exact in fp32), the RoPE columns copied exactly to fp32;
  * `project_output_fused`: per (head, row block, value block) `o` split in registers into the same three
    bf16 parts and three dots into one fp32 accumulator, rounded once to the output dtype.

Products exact, fp32 sums in the dot's order (not cuBLAS's): both are within fp32 accumulation error of the
float64 value, gamma_K * sum |terms| with K = dn or 3 r (`tests/test_absorb_kernels.py` checks that bound on
fresh inputs). The interpreter (CPU tests) has no bf16 arithmetic: there the operands are widened to fp32
from their bits and the dots run in fp32 (the same exact values, products rounded at most once each).
`absorb_reason` / `project_reason` say why a call cannot use them (then the torch operations run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...runtime import allow_host_sync, stream_capturing, warn_once
from .._launch import for_device, interpreting
from .common import OP_BF16, OP_F32, bf16_bits_to_f32, bits16, mma, store_bf16_bits

BLOCK_M = 32  # query rows (requests x tokens) per program: a decode batch of 32 in one block
BLOCK_R = 128  # latent channels per absorb program
BLOCK_V = 64  # value channels per project program
BLOCK_K = 64  # latent channels per project step


@triton.jit
def _absorb_kernel(QN, QR, W, OUT, M, stride_qm, stride_qh, stride_rm, stride_rh, stride_wh, stride_wn, stride_wr,
                   stride_om, stride_oh, DN: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                   BR: tl.constexpr, NATIVE: tl.constexpr, KIND: tl.constexpr):
    h = tl.program_id(0)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    c = tl.program_id(2) * BR + tl.arange(0, BR)
    m_ok = m < M
    m64 = m.to(tl.int64)
    n = tl.arange(0, DN)
    a = bits16(tl.load(QN + m64[:, None] * stride_qm + h * stride_qh + n[None, :], mask=m_ok[:, None], other=0),
               NATIVE)  # [BM, DN]
    b = bits16(tl.load(W + h * stride_wh + n[:, None] * stride_wn + c[None, :] * stride_wr, mask=(c < R)[None, :],
                       other=0), NATIVE)
    acc = mma(a, b, tl.full([BM, BR], 0.0, tl.float32), KIND)
    out_row = OUT + m64[:, None] * stride_om + h * stride_oh
    tl.store(out_row + c[None, :], acc, mask=m_ok[:, None] & (c < R)[None, :])
    if tl.program_id(2) == 0:  # the RoPE columns, exactly (bf16 -> fp32)
        d = tl.arange(0, D)
        rope = tl.load(QR + m64[:, None] * stride_rm + h * stride_rh + d[None, :], mask=m_ok[:, None], other=0)
        tl.store(out_row + R + d[None, :], bf16_bits_to_f32(rope), mask=m_ok[:, None])


@triton.jit
def _split3(x):
    """fp32 -> (hi, mid, lo) bf16 with hi + mid + lo == x exactly (each residue is exact: Sterbenz)."""
    hi = x.to(tl.bfloat16)
    r1 = x - hi.to(tl.float32)
    mid = r1.to(tl.bfloat16)
    lo = (r1 - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _project_kernel(OL, W, OUT, M, stride_om, stride_oh, stride_wh, stride_wv, stride_wr, stride_xm, stride_xh,
                    R: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                    OUT_BF16: tl.constexpr, NATIVE: tl.constexpr, KIND: tl.constexpr):
    h = tl.program_id(0)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    v = tl.program_id(2) * BV + tl.arange(0, BV)
    m_ok = m < M
    v_ok = v < DV
    m64 = m.to(tl.int64)
    acc = tl.full([BM, BV], 0.0, tl.float32)
    for k0 in tl.static_range(0, R, BK):
        k = k0 + tl.arange(0, BK)
        o = tl.load(OL + m64[:, None] * stride_om + h * stride_oh + k[None, :], mask=m_ok[:, None], other=0.0)
        wt = bits16(tl.load(W + h * stride_wh + v[None, :] * stride_wv + k[:, None] * stride_wr, mask=v_ok[None, :],
                            other=0), NATIVE)  # [BK, BV] = W_UV[h]^T
        if NATIVE:
            hi, mid, lo = _split3(o)
            acc = mma(hi, wt, acc, KIND)
            acc = mma(mid, wt, acc, KIND)
            acc = mma(lo, wt, acc, KIND)
        else:
            acc = mma(o, wt, acc, KIND)
    ptrs = OUT + m64[:, None] * stride_xm + h * stride_xh + v[None, :]
    mask = m_ok[:, None] & v_ok[None, :]
    if OUT_BF16:
        tl.store(ptrs, store_bf16_bits(acc, NATIVE), mask=mask)
    else:
        tl.store(ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def absorb_reason(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor) -> str | None:
    """Why the attention does not use `absorb_query_fused` for this call (None when it does: CUDA, bf16)."""
    if not q_nope.is_cuda:
        return "not a CUDA tensor (the torch operations are the CPU path)"
    if {q_nope.dtype, q_rope.dtype, w_uk.dtype} != {torch.bfloat16}:
        return f"dtypes {q_nope.dtype} / {q_rope.dtype} / {w_uk.dtype}, not bf16"
    dn, r = w_uk.shape[1:]
    if not (_pow2(dn) and r % 16 == 0 and _pow2(q_rope.shape[-1])):
        return f"head dims dn={dn}, r={r}, d={q_rope.shape[-1]} (dn and d powers of two >= 16, r a multiple of 16)"
    if q_nope.stride(-1) != 1 or q_rope.stride(-1) != 1:
        return "the query's channels are not contiguous"
    return None


def absorb_query_fused(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """`absorb_query(q_nope [..., H, dn], q_rope [..., H, d], w_uk [H, dn, r], fp32=True)` in one launch:
    `[..., H, r + d]` fp32."""
    lead, (H, dn) = q_nope.shape[:-2], q_nope.shape[-2:]
    r, d = w_uk.shape[-1], q_rope.shape[-1]
    qn, qr = q_nope.reshape(-1, H, dn), q_rope.reshape(-1, H, d)  # views for a decode step's layouts
    M = qn.shape[0]
    out = torch.empty(M, H, r + d, dtype=torch.float32, device=q_nope.device)
    if M:
        native = not interpreting(q_nope.device)
        wv = w_uk.view(torch.int16)
        for_device(_absorb_kernel, q_nope.device)[(H, triton.cdiv(M, BLOCK_M), triton.cdiv(r, BLOCK_R))](
            qn.view(torch.int16), qr.view(torch.int16), wv, out, M, qn.stride(0), qn.stride(1), qr.stride(0),
            qr.stride(1), wv.stride(0), wv.stride(1), wv.stride(2), out.stride(0), out.stride(1),
            DN=dn, R=r, D=d, BM=BLOCK_M, BR=BLOCK_R, NATIVE=native, KIND=OP_BF16 if native else OP_F32,
            **({"num_warps": 4} if native else {}))
    return out.view(*lead, H, r + d)


def project_reason(o_latent: torch.Tensor, w_uv: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """Why the attention does not use `project_output_fused` for this call (None when it does: CUDA)."""
    if not o_latent.is_cuda:
        return "not a CUDA tensor (the torch operations are the CPU path)"
    if o_latent.dtype != torch.float32 or w_uv.dtype != torch.bfloat16:
        return f"o_latent {o_latent.dtype} / W_UV {w_uv.dtype}, not fp32 / bf16"
    if out_dtype not in (torch.bfloat16, torch.float32):
        return f"output dtype {out_dtype}"
    dv, r = w_uv.shape[1:]
    if r % BLOCK_K or dv % 16:
        return f"r={r} (a multiple of {BLOCK_K}) or dv={dv} (of 16)"
    if o_latent.stride(-1) != 1:
        return "o_latent's channels are not contiguous"
    return None


def project_output_fused(o_latent: torch.Tensor, w_uv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`project_output(o_latent [..., H, r] fp32, w_uv [H, dv, r], fp32=True).to(out_dtype)` in one launch."""
    lead, (H, r) = o_latent.shape[:-2], o_latent.shape[-2:]
    dv = w_uv.shape[1]
    o = o_latent.reshape(-1, H, r)
    M = o.shape[0]
    out = torch.empty(M, H, dv, dtype=out_dtype, device=o_latent.device)
    if M:
        native = not interpreting(o_latent.device)
        bf16 = out_dtype == torch.bfloat16
        wv, xv = w_uv.view(torch.int16), out.view(torch.int16) if bf16 else out
        for_device(_project_kernel, o_latent.device)[(H, triton.cdiv(M, BLOCK_M), triton.cdiv(dv, BLOCK_V))](
            o, wv, xv, M, o.stride(0), o.stride(1), wv.stride(0), wv.stride(1), wv.stride(2), out.stride(0),
            out.stride(1), R=r, DV=dv, BM=BLOCK_M, BV=BLOCK_V, BK=BLOCK_K, OUT_BF16=bf16, NATIVE=native,
            KIND=OP_BF16 if native else OP_F32,
            **({"num_warps": 4} if native else {}))
    return out.view(*lead, H, dv)


_VERIFIED: dict[tuple, bool] = {}
_U = 2.0 ** -24


def fused_projections_ok(device: torch.device) -> bool:
    """Whether both kernels, compiled on this GPU, are within their error bounds of float64 on a probe (checked
    once per device, outside any CUDA-graph capture; until then, and after a failure, the torch operations
    run, with a warning naming what failed). A guard for a compiler or GPU the tests never ran on."""
    key = (device.type, device.index)
    if key in _VERIFIED:
        return _VERIFIED[key]
    if stream_capturing():
        return False  # a probe cannot run inside a capture; the graph keeps the torch operations
    try:
        with allow_host_sync("the fused projections' one-off check against float64"):
            ok, what = _probe(device)
    except Exception as e:
        ok, what = False, f"{type(e).__name__}: {e}"
    if not ok:
        warn_once(f"snapquant: the fused MLA projections failed their check on {device} ({what}); "
                  f"using the torch operations")
    _VERIFIED[key] = ok
    return ok


def _probe(device: torch.device) -> tuple[bool, str]:
    g = torch.Generator().manual_seed(0)
    M, H, dn, d, dv, r = 37, 3, 128, 64, 128, 512
    q = torch.randn(M, H, dn + d, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(H, dn + dv, r, generator=g) / r ** 0.5).to(torch.bfloat16).to(device)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    got = absorb_query_fused(q[..., :dn], q[..., dn:], w_uk).double()
    qd, wk = q[..., :dn].double(), w_uk.double()
    exact = torch.einsum("mhn,hnr->mhr", qd, wk)
    bound = dn * _U * 1.01 * torch.einsum("mhn,hnr->mhr", qd.abs(), wk.abs())
    if not ((got[..., :r] - exact).abs() <= bound).all() or not torch.equal(got[..., r:], q[..., dn:].double()):
        return False, "query projection outside its bound"
    o = torch.randn(M, H, r, generator=g).to(device)
    got = project_output_fused(o, w_uv, torch.float32).double()
    exact = torch.einsum("mhr,hvr->mhv", o.double(), w_uv.double())
    bound = 3 * r * _U * 1.01 * torch.einsum("mhr,hvr->mhv", o.double().abs(), w_uv.double().abs())
    if not ((got - exact).abs() <= bound).all():
        return False, "output projection outside its bound"
    return True, "ok"
