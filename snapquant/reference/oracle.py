"""Float64 oracles: exact attention over dequantized (or raw) latent caches.

`attention_fp64` is plain softmax attention with MLA's shapes (K = [latent | rope], V = latent), no
blocking and no rounding. `mla_decode_oracle` dequantizes a `QuantizedKV` (and, by default, applies
the config's query quantization) and runs it, so the difference to `mla_decode_reference` is exactly
the decode pipeline's own arithmetic (softmax blocking, P precision).
"""

from __future__ import annotations

import math

import torch

from ..config import KVQuantConfig
from ..quant.quantizer import QuantizedKV
from .decode import check_decode_inputs, checked_lengths
from .query import quantize_query


def attention_fp64(
    q: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    lengths: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    *,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[B, (S,) H, r + d]`, latent `[B, T, r]`, rope `[B, T, d]` -> (out `[B, (S,) H, r]`, lse), float64."""
    single = q.dim() == 3
    if single:
        q = q.unsqueeze(1)
    B, S, _, D = q.shape
    T = latent.shape[-2]
    lengths = checked_lengths(lengths, B, T, q.device)
    tau = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    k = torch.cat([latent, rope], dim=-1).double()  # [B, T, r + d]
    scores = torch.einsum("bshd,btd->bsht", q.double(), k) * tau
    limit = lengths.view(B, 1) - ((S - 1 - torch.arange(S, device=q.device)) if causal else 0)
    visible = torch.arange(T, device=q.device).view(1, 1, T) < limit[..., None]  # [B, S, T]
    scores = scores.masked_fill(~visible[:, :, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
    p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("bsht,btr->bshr", p, latent.double())
    if single:
        return out[:, 0], lse[:, 0]
    return out, lse


def mla_decode_oracle(
    q: torch.Tensor,
    kv: QuantizedKV,
    lengths: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    config: KVQuantConfig | None = None,
    *,
    causal: bool = True,
    quantize_q: bool = True,
    round_16bit: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 attention over the dequantized cache (query quantized as the config says)."""
    cfg = config or kv.config
    check_decode_inputs(q if q.dim() == 4 else q.unsqueeze(1), kv)
    r = kv.latent.width
    if quantize_q:
        q_nope, q_rope, sigma = quantize_query(q, cfg, r, round_16bit)
        q = torch.cat([q_nope, q_rope], dim=-1).double() * sigma.double()[..., None]
    latent, rope = kv.dequantize(torch.float64)
    return attention_fp64(q, latent, rope, lengths, softmax_scale, causal=causal)
