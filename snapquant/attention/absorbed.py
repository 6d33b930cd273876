"""Absorbed MLA attention over a `LatentStore`, through a decode backend (docs/numerics.md, "MLA in one paragraph").

    q_abs[h] = [W_UK[h]^T q_nope[h] | q_rope[h]]        (fp32 products and sums of the stored weights;
                                                         the backend applies the config's query format)
    (o, lse) = backend(q_abs, cache segment, lengths)   (latent-space output, natural-log LSE)
    out[h]   = W_UV[h] o[h]

Two ways to run the backend:
- standard (padding + causal, one segment): each request's queries are its last stored tokens, so the
  backend's `lengths` + `causal` describe the mask exactly. With S > 1 the valid queries of every
  request are right-aligned first (padding rows on the left), which makes the reference's causal rule
  (query i sees rows < length - S + 1 + i) hold for every request whatever its padding; queries are
  processed in chunks to bound memory.
- general (a sparse DSA top-k mask, a custom 4D mask, or KIVI's two segments): for each query row the
  visible rows of each segment are gathered (as a sparse kernel does), the backend runs with S = 1 per
  (request, row), and segments are merged by their LSE.
Attention sinks (`s_aux`, one logit per head) scale the output by sigmoid(lse - sink), which is exactly
softmax with the extra sink column.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..config import KVQuantConfig
from ..quant.quantizer import QuantizedKV
from ..quant.tensor import QuantizedTensor
from ..reference import absorb_query, project_output
from .storage import Segment

# Work per backend call is bounded by this many fp32 elements of gathered or blocked intermediates.
_CHUNK_ELEMENTS = 1 << 25
# On CUDA the two projections run as one Triton launch each (`kernels/triton/absorb.py`: the same exact products,
# fp32 sums in another order) instead of ~15 small torch kernels per layer and decode step; False keeps torch's.
FUSED_PROJECTIONS = True


def absorbed_attention(
    query: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    segments: list[Segment],
    positions: torch.Tensor | None,
    *,
    softmax_scale: float,
    config: KVQuantConfig,
    backend: Callable,
    round_16bit: bool,
    visibility: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of HF-layout `query [B, H, S, dn + dr]` over cached segments -> `[B, S, H, dv]` (query dtype).

    positions: `[B, S]` the stored-row index of each query token (-1 for padding rows, whose output is 0).
    visibility: `[B, S, L]` bool over stored rows; None = standard padding + causal.
    lengths: instead of positions, the fixed-shape decode step's stored rows per request `[B]` after its one
    token each (every query real: its row is the last), as the device holds them: no bookkeeping launches.
    """
    B, H, S, _ = query.shape
    dn = w_uk.shape[1]
    q = query.transpose(1, 2)  # [B, S, H, dn + dr]
    # fp32 products of the weights as stored (no per-step fp32 copy of W_UK / W_UV where torch can).
    q_abs = _absorb(q[..., :dn], q[..., dn:], w_uk)  # [B, S, H, r + dr] fp32
    if lengths is not None:
        if S != 1 or visibility is not None or len(segments) != 1:
            raise ValueError("lengths describes one real query token per request over one segment")
        out, lse = backend(q_abs[:, 0], segments[0].kv, lengths, softmax_scale, config, causal=True,
                           round_16bit=round_16bit)
        out, lse = out[:, None], lse[:, None]
    elif visibility is None and len(segments) == 1:
        out, lse = _standard(q_abs, segments[0], positions, softmax_scale, config, backend, round_16bit)
    else:
        if visibility is None:
            visibility = _causal_rows(positions, segments)
        out, lse = _general(q_abs, segments, visibility, softmax_scale, config, backend, round_16bit)
    if sinks is not None:
        sink = sinks.to(device=lse.device, dtype=torch.float32).view(1, 1, H)
        out = out * torch.sigmoid(lse - sink).nan_to_num(0.0)[..., None]
    if positions is not None:
        out = out.masked_fill((positions < 0).view(B, S, 1, 1), 0.0)
    return _project(out, w_uv, query.dtype)


def _absorb(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    if FUSED_PROJECTIONS and q_nope.is_cuda:
        from ..kernels.triton.absorb import absorb_query_fused, absorb_reason, fused_projections_ok

        if absorb_reason(q_nope, q_rope, w_uk) is None and fused_projections_ok(q_nope.device):
            return absorb_query_fused(q_nope, q_rope, w_uk)
    return absorb_query(q_nope, q_rope, w_uk, fp32=True)


def _project(out: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if FUSED_PROJECTIONS and out.is_cuda:
        from ..kernels.triton.absorb import fused_projections_ok, project_output_fused, project_reason

        if project_reason(out, w_uv, dtype) is None and fused_projections_ok(out.device):
            return project_output_fused(out, w_uv, dtype)
    return project_output(out, w_uv, fp32=True).to(dtype)


def _standard(q_abs, seg: Segment, positions, tau, config, backend, round_16bit):
    B, S, H, D = q_abs.shape
    kv = seg.kv
    if S == 1:
        lengths = (positions[:, 0] + 1).clamp(min=0)
        out, lse = backend(q_abs[:, 0], kv, lengths, tau, config, causal=True, round_16bit=round_16bit)
        return out[:, None], lse[:, None]
    valid = positions >= 0
    # Right-align each request's valid queries (stable: padding rows first, then the valid ones in order).
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices  # [B, S]
    q_c = torch.gather(q_abs, 1, order.view(B, S, 1, 1).expand(B, S, H, D))
    end = positions.max(dim=1).values + 1  # stored rows up to the last query token; 0 if all padding
    per_row = B * H * (config.pv_block * kv.latent.channel_blocks + D)  # the reference's per-block intermediates
    chunk = max(1, _CHUNK_ELEMENTS // per_row)
    outs, lses = [], []
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        lengths = (end - (S - c1)).clamp(min=0)  # the chunk's queries are the last c1 - c0 of these rows
        o, l_ = backend(q_c[:, c0:c1], kv, lengths, tau, config, causal=True, round_16bit=round_16bit)
        outs.append(o)
        lses.append(l_)
    out_c, lse_c = torch.cat(outs, 1), torch.cat(lses, 1)
    out = torch.empty_like(out_c).scatter_(1, order.view(B, S, 1, 1).expand_as(out_c), out_c)
    lse = torch.empty_like(lse_c).scatter_(1, order.view(B, S, 1).expand_as(lse_c), lse_c)
    return out, lse


def _causal_rows(positions: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """Standard visibility over stored rows: row t visible to a query at row p iff t <= p."""
    L = max(int((s.offset + s.lengths).max()) if s.lengths.numel() else 0 for s in segments)
    rows = torch.arange(L, device=positions.device).view(1, 1, L)
    return rows <= positions[..., None]


def _general(q_abs, segments: list[Segment], visibility, tau, config, backend, round_16bit):
    B, S, H, _ = q_abs.shape
    r = segments[0].kv.latent.width
    out = q_abs.new_zeros(B, S, H, r)
    lse = q_abs.new_full((B, S, H), -math.inf)
    L = visibility.shape[-1]
    chunk = max(1, _CHUNK_ELEMENTS // max(1, B * max(L, 1) * 2 * r))  # gathered rows + their scales
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        parts = []
        for seg in segments:
            res = _gather_run(q_abs[:, s0:s1], seg, visibility[:, s0:s1], tau, config, backend, round_16bit)
            if res is not None:
                parts.append(res)
        if parts:
            o, l_ = merge_lse([p[0] for p in parts], [p[1] for p in parts])
            out[:, s0:s1], lse[:, s0:s1] = o, l_
    return out, lse


def _gather_run(q_abs, seg: Segment, vis, tau, config, backend, round_16bit):
    """Gather the rows of `seg` each query sees and run the backend with one query per (request, row)."""
    B, c, H, D = q_abs.shape
    n = seg.kv.num_tokens
    if n == 0:
        return None
    dev = q_abs.device
    cols = seg.offset.view(B, 1) + torch.arange(n, device=dev).view(1, n)  # [B, n] global row of each seg row
    in_seg = torch.arange(n, device=dev).view(1, n) < seg.lengths.view(B, 1)
    L = vis.shape[-1]
    seg_vis = torch.gather(vis, 2, cols.clamp(max=max(L - 1, 0)).view(B, 1, n).expand(B, c, n))
    seg_vis = seg_vis & in_seg[:, None, :] & (cols < L)[:, None, :]
    counts = seg_vis.sum(-1)  # [B, c]
    k_max = int(counts.max()) if counts.numel() else 0
    if k_max == 0:
        return None
    idx = torch.sort((~seg_vis).to(torch.int8), dim=-1, stable=True).indices[..., :k_max]  # [B, c, K]
    kv = gather_kv(seg.kv, idx)
    o, l_ = backend(q_abs.reshape(B * c, H, D), kv, counts.reshape(B * c), tau, config,
                    causal=True, round_16bit=round_16bit)
    return o.view(B, c, H, -1), l_.view(B, c, H)


def gather_kv(kv: QuantizedKV, idx: torch.Tensor) -> QuantizedKV:
    """Rows `idx [B, c, K]` of each request -> a QuantizedKV of batch B*c and K tokens (per-token scales)."""
    return QuantizedKV(_gather_qt(kv.latent, idx), _gather_qt(kv.rope, idx), kv.config, kv.rope_prescaled)


def _gather_qt(qt: QuantizedTensor, idx: torch.Tensor) -> QuantizedTensor:
    B, c, K = idx.shape
    T = qt.num_tokens

    def take(t: torch.Tensor) -> torch.Tensor:
        t = t.expand(B, *t.shape[1:])
        w = t.shape[-1]
        # gather has no fp8 kernel on CPU: move 8-bit codes as raw bytes (a bit-exact reinterpretation).
        raw = t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
        out = torch.gather(raw.unsqueeze(1).expand(B, c, T, w), 2, idx.unsqueeze(-1).expand(B, c, K, w))
        return out.view(t.dtype).reshape(B * c, K, w)

    data = take(qt.data)
    if qt.scale is None:
        return QuantizedTensor(data, None, qt.fmt, None, qt.granularity, qt.width, token_group=1)
    scale = qt.scale  # stored form; expand group / shared rows to one row per token before gathering
    if qt.token_group is None:
        scale = scale.expand(scale.shape[0], T, scale.shape[-1])
    elif qt.token_group > 1:
        scale = scale.repeat_interleave(qt.token_group, dim=1)[:, :T]
    return QuantizedTensor(data, take(scale), qt.fmt, qt.scale_fmt, qt.granularity, qt.width, token_group=1)


def merge_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets: softmax-weighted by exp(lse); all -inf rows give 0, -inf."""
    if len(outs) == 1:
        return outs[0], lses[0]
    stacked = torch.stack(lses)  # [n, ...]
    m = stacked.amax(0)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(stacked - m_safe)  # exp(-inf) = 0 for empty parts
    denom = w.sum(0)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = sum(wi[..., None] * oi for wi, oi in zip(w, outs, strict=True)) / safe[..., None]
    lse = torch.where(denom > 0, m_safe + torch.log(safe), torch.full_like(m, -math.inf))
    return out, lse
