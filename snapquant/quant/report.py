"""`format_report`: every preset's storage cost and measured error on one synthetic MLA cache.

Errors are measured against exact float64 attention on the *unquantized* data, so each row shows
the total damage of the scheme: cache rounding, query quantization and the PV pipeline together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd
import torch

from ..config import KVQuantConfig
from ..errors import ConfigError
from ..presets import PRESETS, resolve_config
from ..reference.decode import mla_decode_reference
from ..reference.oracle import attention_fp64
from .layout import bytes_per_token
from .quantizer import calibrate, quantize_kv
from .synthetic import synthetic_latent_rope, synthetic_queries


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when exact)."""
    noise = (x.double() - x_hat.double()).pow(2).sum()
    if noise == 0:
        return math.inf
    return float(10 * torch.log10(x.double().pow(2).sum() / noise))


def format_report(
    presets: Iterable[str | KVQuantConfig] | None = None,
    num_tokens: int = 2048,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    num_heads: int = 16,
    batch: int = 2,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per preset: bytes/token, NoPE/RoPE SQNR, score and output error vs exact attention."""
    for name, v in (("num_tokens", num_tokens), ("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim),
                    ("num_heads", num_heads), ("batch", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name}={v!r} is not valid; expected a positive integer")
    latent, rope = synthetic_latent_rope(num_tokens, kv_lora_rank, rope_dim, batch=batch, seed=seed)
    q = synthetic_queries(latent, rope, num_heads, seed=seed + 1)
    lengths = torch.tensor([max(1, num_tokens - 17 * i) for i in range(batch)])  # ragged batch, never empty
    exact_out, exact_lse = attention_fp64(q, latent, rope, lengths)
    rows = []
    for spec in presets if presets is not None else PRESETS:
        cfg = resolve_config(spec)
        if "per_tensor_static" in (cfg.nope_granularity, cfg.rope_granularity) and (
            cfg.nope_scale is None or cfg.rope_scale is None
        ):
            cfg = calibrate(cfg, latent, rope)
        try:
            kv = quantize_kv(latent, rope, cfg)
        except ConfigError as e:  # e.g. a block size that does not divide these widths: say which preset
            raise ConfigError(f"preset {cfg.label()!r}: {e}") from None
        lat_hat, rope_hat = kv.dequantize()
        out, lse = mla_decode_reference(q, kv, lengths)
        diff = out.double() - exact_out
        row_err = diff.norm(dim=-1) / exact_out.norm(dim=-1).clamp_min(1e-30)
        rows.append({
            "preset": cfg.label(),
            "bytes_per_token": bytes_per_token(cfg, kv_lora_rank, rope_dim),
            "ratio_vs_bf16": bytes_per_token(cfg, kv_lora_rank, rope_dim) / (2 * (kv_lora_rank + rope_dim)),
            "nope_sqnr_db": sqnr_db(latent, lat_hat),
            "rope_sqnr_db": sqnr_db(rope, rope_hat),
            "out_rel_l2": float(diff.norm() / exact_out.norm()),
            "out_rel_l2_worst_row": float(row_err.max()),
            "lse_abs_err_max": float((lse.double() - exact_lse).abs().max()),
            "scheme": cfg.short_description(),
        })
    df = pd.DataFrame(rows)
    df.attrs.update(num_tokens=num_tokens, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                    num_heads=num_heads, batch=batch, seed=seed)
    return df
