"""Weight absorption for MLA decode: fold W_UK into the query, apply W_UV to the latent output.

`kv_b_proj.weight` has shape `[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`; viewed as
`[H, dn + dv, r]`, rows `[:dn]` are W_UK and rows `[dn:]` are W_UV (numerics.md).
"""

from __future__ import annotations

import torch

from ..errors import ShapeError


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


def absorb_query(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope `[..., H, dn]`, q_rope `[..., H, d]` -> absorbed query `[..., H, r + d]` (W_UK^T q_nope | q_rope)."""
    if q_nope.shape[-2:] != w_uk.shape[:2]:
        raise ShapeError(f"q_nope [..., H, dn] = {tuple(q_nope.shape)} does not match W_UK [H, dn, r] = {tuple(w_uk.shape)}")
    q_latent = torch.einsum("...hn,hnr->...hr", q_nope, w_uk.to(q_nope.dtype))
    return torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1)


def project_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Latent-space attention output `[..., H, r]` -> per-head values `[..., H, dv]`."""
    if o_latent.shape[-2] != w_uv.shape[0] or o_latent.shape[-1] != w_uv.shape[2]:
        raise ShapeError(f"o_latent {tuple(o_latent.shape)} does not match W_UV [H, dv, r] = {tuple(w_uv.shape)}")
    return torch.einsum("...hr,hvr->...hv", o_latent, w_uv.to(o_latent.dtype))
