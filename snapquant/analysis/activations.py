"""Activation statistics that decide whether FP8 KV quantization is hard: outliers, massive activations, sinks.

For one model and one batch of text (teacher-forced):
- `cache_statistics`: per layer, per channel absmax / RMS / excess kurtosis / outlier share of the
  cached latent (after `kv_a_layernorm`) and of the rotated RoPE key (`capture_mla`);
- `massive_activations`: per layer output, max |h| / median |h| of the residual stream and the tokens
  that carry the largest values (position, token text, channel), as in Sun et al. (2024);
- `attention_sinks`: per layer and head, the attention mass on the first position and on the
  most-attended key, recomputed in float64 from the captured query and cache.
Everything returns pandas DataFrames (tidy, one row per layer or per layer x channel).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from .capture import capture_mla
from .sensitivity import channel_statistics, latent_terms

OUTLIER_SIGMA = 6.0


def _per_channel(x: torch.Tensor) -> dict[str, torch.Tensor]:
    st = channel_statistics(x, OUTLIER_SIGMA)
    st["rms"] = x.double().pow(2).mean(0).sqrt()
    return st


@torch.no_grad()
def cache_statistics(model: Any, input_ids: torch.Tensor, caps: list | None = None
                     ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-channel rows, per-layer summary rows) for the latent ('nope') and RoPE key ('rope')."""
    caps = caps if caps is not None else capture_mla(model, input_ids)
    rows, summary = [], []
    for cap in caps:
        for part, x in (("nope", cap.latent), ("rope", cap.rope)):
            flat = x.reshape(-1, x.shape[-1]).cpu()
            st = _per_channel(flat)
            overall_rms = float(flat.double().pow(2).mean().sqrt())
            for c in range(flat.shape[-1]):
                rows.append({"layer": cap.layer_idx, "part": part, "channel": c,
                             **{k: float(v[c]) for k, v in st.items()}})
            absmax = st["absmax"]
            summary.append({
                "layer": cap.layer_idx, "part": part, "channels": flat.shape[-1], "tokens": flat.shape[0],
                "absmax": float(absmax.max()), "rms": overall_rms,
                "absmax_over_rms": float(absmax.max()) / max(overall_rms, 1e-30),
                "channel_absmax_max_over_median": float(absmax.max() / absmax.median().clamp_min(1e-30)),
                "kurtosis_median": float(st["kurtosis"].median()), "kurtosis_max": float(st["kurtosis"].max()),
                "outlier_share": float((flat.double().abs() > OUTLIER_SIGMA * overall_rms).double().mean()),
                "channels_with_outliers": int((st["outlier_share"] > 0).sum()),
            })
    return pd.DataFrame(rows), pd.DataFrame(summary)


def _token_text(tokenizer: Any, tid: int) -> str:
    try:
        return tokenizer.decode([tid])
    except Exception:
        return f"<{tid}>"


def _token_class(text: str, tid: int, position: int, eos_id: int | None) -> str:
    if position == 0:
        return "first"
    if eos_id is not None and tid == eos_id:
        return "eos"
    s = text.strip()
    if not s:
        return "whitespace/newline"
    if all(not ch.isalnum() for ch in s):
        return "delimiter"
    return "word"


@torch.no_grad()
def massive_activations(model: Any, tokenizer: Any, input_ids: torch.Tensor, top: int = 5
                        ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-layer ratios, top carriers): residual-stream max |h| / median |h| after each layer."""
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), output_hidden_states=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    layers, carriers = [], []
    ids = input_ids.cpu()
    for li, h in enumerate(out.hidden_states[1:]):  # [0] is the embedding output
        a = h.float().abs()
        med = float(a.median())
        tok_max, tok_dim = a.max(-1)  # [B, T]
        flat = tok_max.flatten()
        k = min(top, flat.numel())
        vals, idx = flat.topk(k)
        T = tok_max.shape[1]
        amax = float(vals[0])
        layers.append({"layer": li, "max_abs": amax, "median_abs": med, "max_over_median": amax / max(med, 1e-30),
                       "n_above_100": int((a > 100).sum()), "n_above_1000x_median": int((a > 1000 * med).sum()),
                       "tokens": int(flat.numel())})
        for rank, (v, i) in enumerate(zip(vals.tolist(), idx.tolist(), strict=True)):
            b, t = divmod(i, T)
            tid = int(ids[b, t])
            text = _token_text(tokenizer, tid)
            carriers.append({"layer": li, "rank": rank, "value": v, "over_median": v / max(med, 1e-30),
                             "sequence": b, "position": t, "token": text, "class": _token_class(text, tid, t, eos),
                             "channel": int(tok_dim[b, t])})
    return pd.DataFrame(layers), pd.DataFrame(carriers)


@torch.no_grad()
def attention_sinks(model: Any, input_ids: torch.Tensor, tokenizer: Any | None = None, caps: list | None = None,
                    skip_first: int = 16) -> pd.DataFrame:
    """Per layer and head: mean attention mass on position 0, on the most-attended key, and on EOS keys.

    Averaged over queries at positions >= `skip_first` (early queries have few keys to spread over).
    Float64 recomputation of the model's own (un-absorbed) attention from the captured tensors.
    """
    caps = caps if caps is not None else capture_mla(model, input_ids)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    rows = []
    for cap in caps:
        m = cap.module
        dn, dr = m.qk_nope_head_dim, m.qk_rope_head_dim
        nope_scores, _ = latent_terms(cap, cap.latent)
        q = cap.f64["q"]
        scaling = cap.scaling if cap.scaling is not None else (dn + dr) ** -0.5
        scores = (nope_scores + torch.einsum("bhsd,btd->bhst", q[..., dn:], cap.rope.double())) * scaling
        B, H, S, T = scores.shape
        vis = torch.arange(T, device=scores.device)[None, :] <= torch.arange(S, device=scores.device)[:, None]
        p = torch.softmax(scores.masked_fill(~vis, -math.inf), dim=-1)[:, :, skip_first:]  # [B, H, S', T]
        first = p[..., 0].mean(dim=(0, 2))
        top = p.amax(-1).mean(dim=(0, 2))
        eos_mass = None
        if eos is not None:
            is_eos = (input_ids.to(p.device) == eos).double()  # [B, T]
            eos_mass = (p * is_eos[:, None, None, :]).sum(-1).mean(dim=(0, 2))
        # Entropy relative to uniform over the visible keys: 1 = uniform, 0 = one key.
        ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
        n_vis = torch.arange(skip_first, S, device=p.device, dtype=torch.float64) + 1
        rel_ent = (ent / n_vis.log()[None, None, :]).mean(dim=(0, 2))
        for h in range(H):
            rows.append({"layer": cap.layer_idx, "head": h, "mass_first": float(first[h]), "mass_top_key": float(top[h]),
                         "mass_eos": float(eos_mass[h]) if eos_mass is not None else math.nan,
                         "relative_entropy": float(rel_ent[h]), "queries": int(B * (S - skip_first))})
    return pd.DataFrame(rows)
