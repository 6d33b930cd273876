"""Reading HF attention masks: which keys each query may see, and which new tokens are padding.

HF builds one mask per forward (`create_causal_mask`) in the format of `config._attn_implementation`:
a 4D bool mask (sdpa; True = attend), a 4D additive float mask (eager; 0 or the dtype's min), a 2D
padding mask (flash attention), or None (plain causal, no padding: sdpa's `is_causal` shortcut).
Patched attention never changes how the mask is built (the model config keeps its implementation,
so the unregistered-mask trap of docs/transformers-notes.md cannot drop it); it only reads it here.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError


def hf_visibility(mask, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """-> bool `[B, S, T]` (True = query s may attend key t, in HF positions), or None for plain causal.

    The S queries are the last S of the T positions.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ShapeError(
            f"attention mask of type {type(mask).__name__} is not supported by patched MLA attention "
            f"(flex attention BlockMask?); load the model with attn_implementation='sdpa' or 'eager'"
        )
    if mask.dim() == 2:  # flash-attention style padding mask [B, T]
        if mask.shape[-1] < kv_len:
            raise ShapeError(f"2D attention mask has {mask.shape[-1]} columns but the cache holds {kv_len} positions")
        keys = mask[:, -kv_len:].to(torch.bool)
        return _causal(batch, q_len, kv_len, mask.device) & keys[:, None, :]
    if mask.dim() != 4:
        raise ShapeError(f"attention mask must be 2D or 4D, got shape {tuple(mask.shape)}")
    m = mask[:, 0]
    if m.shape[-2:] != (q_len, kv_len):
        raise ShapeError(
            f"attention mask covers [{m.shape[-2]} queries, {m.shape[-1]} keys] but this step has {q_len} queries "
            f"over {kv_len} cached positions (static or sliding caches are not supported by LatentCache)"
        )
    if m.dtype == torch.bool:
        vis = m
    else:
        lo = torch.finfo(m.dtype).min / 2
        blocked = m <= lo
        if not bool(((m == 0) | blocked).all()):
            raise ShapeError("additive attention biases (other than 0 / -inf masking) are not supported")
        vis = ~blocked
    return vis.expand(batch, q_len, kv_len)


def token_validity(mask, batch: int, q_len: int, past: int) -> torch.Tensor:
    """Which of the S new tokens are real (not padding): `[B, S]` bool.

    A token attends to itself exactly when it is not padding (padding masks keys; causality keeps the
    diagonal), so validity is the diagonal of the new-token block of the mask.
    """
    vis = hf_visibility(mask, batch, q_len, past + q_len)
    if vis is None:
        dev = mask.device if isinstance(mask, torch.Tensor) else None
        return torch.ones(batch, q_len, dtype=torch.bool, device=dev)
    return torch.diagonal(vis[:, :, past:], dim1=-2, dim2=-1).clone()


def indices_visibility(indices: torch.Tensor, kv_len: int) -> torch.Tensor:
    """DSA top-k indices `[B, S, K]` (HF positions; out-of-range = unused) -> bool `[B, S, T]`."""
    ok = (indices >= 0) & (indices < kv_len)
    sel = torch.zeros(*indices.shape[:2], kv_len + 1, dtype=torch.bool, device=indices.device)
    sel.scatter_(-1, torch.where(ok, indices.long(), kv_len), True)
    return sel[..., :kv_len]


def _causal(batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    q_pos = torch.arange(q_len, device=device) + (kv_len - q_len)
    return (torch.arange(kv_len, device=device).view(1, 1, -1) <= q_pos.view(1, -1, 1)).expand(batch, q_len, kv_len)


def standard_visibility(stored: torch.Tensor, q_len: int) -> torch.Tensor:
    """What padding + causality allow: key t visible to query s iff t is stored and t <= its position.

    stored: `[B, T]` bool (HF positions holding a real token) -> `[B, S, T]`.
    """
    B, T = stored.shape
    return _causal(B, q_len, T, stored.device) & stored[:, None, :]
