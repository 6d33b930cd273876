"""Weight absorption for MLA decode: fold W_UK into the query, apply W_UV to the latent output.

`kv_b_proj.weight` has shape `[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`; viewed as
`[H, dn + dv, r]`, rows `[:dn]` are W_UK and rows `[dn:]` are W_UV (docs/numerics.md, "MLA in one paragraph").

`fp32=True` (what patched attention uses) asks for an fp32 result of exact fp32 products accumulated
in fp32, reading 16-bit weights as they are: on CUDA through `torch.bmm(..., out_dtype=torch.float32)`
when the installed torch implements it for the weights' dtype (probed once per device and dtype),
otherwise by converting the operands to fp32 (the previous path, bit for bit). The products of two
bf16 (or fp16) numbers are exact in fp32, so the two paths differ only in fp32 summation order. An
fp32 operand meeting a bf16 weight (the attention output times W_UV) is split exactly into three
bf16 parts (hi + mid + lo, 8 significant bits each, for |x| in bf16's normal range) stacked along
the rows of one product, so the weights are still read once.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError

_SIXTEEN = (torch.bfloat16, torch.float16)
_OUT_DTYPE_OK: dict[tuple[str, int | None, torch.dtype], bool] = {}


def split_kv_b(
    weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (W_UK `[H, dn, r]`, W_UV `[H, dv, r]`)."""
    rows = num_heads * (qk_nope_head_dim + v_head_dim)
    if weight.dim() != 2 or weight.shape[0] != rows:
        raise ShapeError(
            f"kv_b_proj.weight must be [H*(dn+dv)={rows}, kv_lora_rank], got {tuple(weight.shape)} "
            f"(H={num_heads}, dn={qk_nope_head_dim}, dv={v_head_dim})"
        )
    w = weight.view(num_heads, qk_nope_head_dim + v_head_dim, weight.shape[1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor, *, fp32: bool = False) -> torch.Tensor:
    """q_nope `[..., H, dn]`, q_rope `[..., H, d]` -> absorbed query `[..., H, r + d]` (W_UK^T q_nope | q_rope).

    Computed in q_nope's dtype (W_UK converted to it), or with `fp32=True` in fp32 from fp32 products
    (see the module docstring; reads 16-bit q_nope and W_UK directly on CUDA where torch can)."""
    if q_nope.shape[-2:] != w_uk.shape[:2]:
        raise ShapeError(f"q_nope [..., H, dn] = {tuple(q_nope.shape)} does not match W_UK [H, dn, r] = {tuple(w_uk.shape)}")
    if not fp32:
        q_latent = torch.einsum("...hn,hnr->...hr", q_nope, w_uk.to(q_nope.dtype))
        return torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1)
    if q_nope.dtype == w_uk.dtype and out_dtype_supported(w_uk.device, w_uk.dtype):
        lead, (H, dn) = q_nope.shape[:-2], q_nope.shape[-2:]
        a = q_nope.reshape(-1, H, dn).transpose(0, 1)  # [H, M, dn]
        q_latent = torch.bmm(a, w_uk, out_dtype=torch.float32).transpose(0, 1).reshape(*lead, H, w_uk.shape[-1])
    else:
        q_latent = torch.einsum("...hn,hnr->...hr", q_nope.float(), w_uk.float())
    return torch.cat([q_latent, q_rope.to(torch.float32)], dim=-1)


def project_output(o_latent: torch.Tensor, w_uv: torch.Tensor, *, fp32: bool = False) -> torch.Tensor:
    """Latent-space attention output `[..., H, r]` -> per-head values `[..., H, dv]`.

    Computed in o_latent's dtype (W_UV converted to it), or with `fp32=True` in fp32 from fp32 products
    (see the module docstring; reads a bf16 W_UV directly on CUDA where torch can)."""
    if o_latent.shape[-2] != w_uv.shape[0] or o_latent.shape[-1] != w_uv.shape[2]:
        raise ShapeError(f"o_latent {tuple(o_latent.shape)} does not match W_UV [H, dv, r] = {tuple(w_uv.shape)}")
    if not fp32:
        return torch.einsum("...hr,hvr->...hv", o_latent, w_uv.to(o_latent.dtype))
    lead, (H, r) = o_latent.shape[:-2], o_latent.shape[-2:]
    dv = w_uv.shape[1]
    if w_uv.dtype in _SIXTEEN and out_dtype_supported(w_uv.device, w_uv.dtype):
        a = o_latent.reshape(-1, H, r).transpose(0, 1)  # [H, M, r]
        if o_latent.dtype == w_uv.dtype:
            out = torch.bmm(a, w_uv.transpose(1, 2), out_dtype=torch.float32)
        elif o_latent.dtype == torch.float32 and w_uv.dtype == torch.bfloat16:
            M = a.shape[1]
            parts = split_bf16(a)  # 3 x [H, M, r]
            out3 = torch.bmm(torch.cat(parts, dim=1), w_uv.transpose(1, 2), out_dtype=torch.float32)
            out = (out3[:, :M] + out3[:, M:2 * M]) + out3[:, 2 * M:]
        else:
            out = None
        if out is not None:
            return out.transpose(0, 1).reshape(*lead, H, dv)
    return torch.einsum("...hr,hvr->...hv", o_latent.float(), w_uv.float())


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 `x` -> (hi, mid, lo) bf16 with hi + mid + lo == x exactly (for |x| in bf16's normal range)."""
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()  # exact (Sterbenz / error-free rounding residue)
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def out_dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.bmm(a, b, out_dtype=torch.float32)` runs for `dtype` inputs on `device` (probed once).

    Only CUDA is probed (the CPU build has no such kernel; CPU is not the speed path)."""
    if device.type != "cuda" or dtype not in _SIXTEEN:
        return False
    key = (device.type, device.index, dtype)
    ok = _OUT_DTYPE_OK.get(key)
    if ok is None:
        try:
            a = torch.ones(1, 2, 2, dtype=dtype, device=device)
            r = torch.bmm(a, a, out_dtype=torch.float32)
            ok = r.dtype == torch.float32 and r.shape == (1, 2, 2)
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _OUT_DTYPE_OK[key] = ok
    return ok
