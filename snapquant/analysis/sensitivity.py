"""Per-layer, per-channel sensitivity of the MLA cache: statistics, quantization error, attention error.

For a model and some text (teacher-forced, one forward, see `capture.py`), per layer:

1. channel statistics of the NoPE latent and the RoPE key: absmax, mean, std, excess kurtosis
   (0 for a Gaussian) and outlier share (fraction of values with |x| > `outlier_sigma` x the RMS of
   that part in that layer: RoPE's heavy channels stand out, the normed latent does not);
2. quantization error of each part alone under each element dtype x granularity: per-channel MSE
   and SQNR (dB), and per-layer totals. Each sequence is quantized as a cache would hold it, so
   dynamic per-tensor / per-channel scales see one sequence;
3. the attention-output error of each layer when only the NoPE latent, only the RoPE key, or both
   are replaced by their quantized-dequantized values (float64, the layer's own captured query, its
   kv_b_proj expansion and o_proj): relative L2 error of the layer's attention output vs the same
   computation on the exact cache. Layers are isolated (every layer sees the exact model's inputs).

`block_size` for per_token_block is taken as gcd(block_size, kv_lora_rank, rope_dim) so one
setting applies to both parts at any model width (64 at DeepSeek's 512 / 64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..atomic import atomic_write_text
from ..config import KVQuantConfig
from ..errors import ConfigError, ShapeError
from ..presets import resolve_config
from ..quant.dtypes import get_element_format
from ..quant.quantizer import quantize_kv, quantize_part
from .capture import LayerCapture, capture_mla

DEFAULT_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
DEFAULT_GRANULARITIES = ("per_tensor_dynamic", "per_channel", "per_token", "per_token_block")
DEFAULT_SCHEMES = ("snapmla_kv_only", "rope_fp8_per_token", "per_tensor_fp8_dynamic")
MODES = ("nope", "rope", "both")


@dataclass
class SensitivityReport:
    channel_stats: pd.DataFrame
    """layer, part, channel, absmax, mean, std, kurtosis, outlier_share."""
    channel_error: pd.DataFrame
    """layer, part, dtype, granularity, channel, mse, sqnr_db."""
    layer_error: pd.DataFrame
    """layer, part, dtype, granularity, mse, sqnr_db, absmax, outlier_share (per layer totals)."""
    attn_error: pd.DataFrame
    """layer, scheme, mode (nope | rope | both), rel_l2, max_token_rel."""
    meta: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> pd.DataFrame:
        """Per part and scheme: mean over layers of SQNR, and of attention error per mode."""
        le = self.layer_error.groupby(["part", "dtype", "granularity"], sort=False)["sqnr_db"].mean().unstack("part")
        return le.reset_index()

    def attn_summary(self) -> pd.DataFrame:
        if self.attn_error.empty:
            return self.attn_error
        return (self.attn_error.groupby(["scheme", "mode"], sort=False)["rel_l2"].agg(["mean", "max"])
                .unstack("mode").reset_index())

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = {}
        for name in ("channel_stats", "channel_error", "layer_error", "attn_error"):
            files[name] = atomic_write_text(out / f"{name}.csv", getattr(self, name).to_csv(index=False))
        files["summary"] = atomic_write_text(out / "summary.md", self.to_markdown())
        return files

    def to_markdown(self) -> str:
        lines = [f"# Per-channel sensitivity: {self.meta.get('model', '?')}", "",
                 f"tokens: {self.meta.get('tokens')} ({self.meta.get('num_sequences')} x {self.meta.get('seq_len')}), "
                 f"layers: {self.meta.get('layers')}, kv_lora_rank: {self.meta.get('kv_lora_rank')}, "
                 f"rope_dim: {self.meta.get('rope_dim')}", "", "## Cache statistics (mean over layers)", ""]
        st = self.layer_error.drop_duplicates(["layer", "part"]).groupby("part")[["absmax", "outlier_share"]].agg(
            ["mean", "max"])
        st.columns = [f"{a} {b}" for a, b in st.columns]
        lines += [_md_frame(st.reset_index()), "", "## Quantization SQNR (dB, mean over layers)", "",
                  _md_frame(self.summary()), ""]
        if not self.attn_error.empty:
            a = self.attn_summary()
            a.columns = [" ".join(str(x) for x in c if x) if isinstance(c, tuple) else c for c in a.columns]
            lines += ["## Attention-output relative L2 error (mean / max over layers)", "", _md_frame(a), ""]
        return "\n".join(lines)


# ---------------------------------------------------------------------- statistics
def channel_statistics(x: torch.Tensor, outlier_sigma: float = 6.0) -> dict[str, torch.Tensor]:
    """x [N, C] -> per-channel absmax, mean, std, excess kurtosis, outlier share (float64 math)."""
    x = x.double()
    mean = x.mean(0)
    c = x - mean
    var = c.pow(2).mean(0)
    m4 = c.pow(4).mean(0)
    kurt = torch.where(var > 0, m4 / var.clamp_min(1e-300).pow(2) - 3.0, torch.zeros_like(var))
    rms = x.pow(2).mean().sqrt()
    thresh = outlier_sigma * rms
    out = (x.abs() > thresh).double().mean(0) if rms > 0 else torch.zeros_like(mean)
    return {"absmax": x.abs().amax(0), "mean": mean, "std": var.sqrt(), "kurtosis": kurt, "outlier_share": out}


def sqnr_db(signal_power: torch.Tensor, noise_power: torch.Tensor) -> torch.Tensor:
    """10 log10(signal / noise), +inf where the noise is exactly zero."""
    return torch.where(noise_power > 0, 10 * torch.log10(signal_power / noise_power.clamp_min(1e-300)),
                       torch.full_like(signal_power, math.inf))


def part_config(dtype: str, granularity: str, block_size: int) -> KVQuantConfig:
    """A config quantizing both parts with the same element format and granularity, RoPE not pre-scaled."""
    scaled = get_element_format(dtype).is_quantized
    knobs = {"nope_granularity": granularity, "rope_granularity": granularity} if scaled else {}
    if scaled and granularity == "per_token_block":  # the only granularity that reads block_size
        knobs["block_size"] = block_size
    return KVQuantConfig(nope_dtype=dtype, rope_dtype=dtype, rope_prescale=False, query="bf16", pv="bf16",
                         name=f"{dtype}/{granularity}", **knobs)


def quant_schemes(dtypes: Sequence[str], granularities: Sequence[str]) -> list[tuple[str, str]]:
    """(dtype, granularity) pairs; 16-bit formats have no scale, so they get one entry ('none')."""
    out = []
    for dt in dtypes:
        fmt = get_element_format(dt, field="dtypes")
        if not fmt.is_quantized:
            out.append((dt, "none"))
            continue
        for g in granularities:
            out.append((dt, g))
    return out


# ---------------------------------------------------------------------- attention error
@torch.no_grad()
def attention_output(cap: LayerCapture, latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """The layer's attention output (after o_proj) in float64, from a (possibly quantized) cache.

    Mirrors the model's un-absorbed path: kv_b_proj expands the latent into per-head K_nope and V,
    the shared RoPE key is broadcast over heads, causal softmax with the layer's scaling.
    """
    return _attend(cap, latent_terms(cap, latent), rope)


def latent_terms(cap: LayerCapture, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the latent contributes: NoPE scores q_nope . k_nope [B, H, S, T] and V [B, H, T, dv] (float64).

    Split from `_attend` so the report reuses them across variants that share the latent.
    """
    m = cap.module
    for attr in ("num_heads", "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim", "kv_b_proj", "o_proj"):
        if not hasattr(m, attr):
            raise ShapeError(f"{type(m).__name__} lacks {attr!r}; attention error needs a DeepSeek-style MLA module")
    if cap.query is None:
        raise ShapeError(f"layer {cap.layer_idx}: no query was captured")
    H, dn, dv = m.num_heads, m.qk_nope_head_dim, m.v_head_dim
    B, T, _ = latent.shape
    c = cap.f64
    if not c:  # float64 weights and query, once per layer (the report calls this many times a layer)
        def f64(t):
            return None if t is None else t.detach().double()

        c.update(w_kv=f64(m.kv_b_proj.weight), b_kv=f64(m.kv_b_proj.bias), w_o=f64(m.o_proj.weight),
                 b_o=f64(m.o_proj.bias), q=f64(cap.query))
    kv = torch.nn.functional.linear(latent.double(), c["w_kv"], c["b_kv"])
    kv = kv.view(B, T, H, dn + dv).transpose(1, 2)  # [B, H, T, dn + dv]
    k_nope, v = kv.split([dn, dv], dim=-1)
    return torch.einsum("bhsd,bhtd->bhst", c["q"][..., :dn], k_nope), v


def _attend(cap: LayerCapture, terms: tuple[torch.Tensor, torch.Tensor], rope: torch.Tensor) -> torch.Tensor:
    m, c = cap.module, cap.f64
    nope_scores, v = terms
    dn, dr = m.qk_nope_head_dim, m.qk_rope_head_dim
    B, _, S, T = nope_scores.shape
    scaling = cap.scaling if cap.scaling is not None else (dn + dr) ** -0.5
    scores = (nope_scores + torch.einsum("bhsd,btd->bhst", c["q"][..., dn:], rope.double())) * scaling
    # Query i is the (T - S + i)-th token: it sees cache positions <= T - S + i.
    visible = torch.arange(T, device=v.device)[None, :] <= (T - S + torch.arange(S, device=v.device))[:, None]
    scores = scores.masked_fill(~visible, -math.inf)
    o = torch.softmax(scores, dim=-1) @ v  # [B, H, S, dv]
    o = o.transpose(1, 2).reshape(B, S, -1)
    return torch.nn.functional.linear(o, c["w_o"], c["b_o"])


def _rel_errors(ref: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    diff = (approx - ref).flatten(0, -2)
    r = ref.flatten(0, -2)
    rel = float(diff.norm() / r.norm().clamp_min(1e-300))
    per_tok = diff.norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-300)
    return rel, float(per_tok.max())


# ---------------------------------------------------------------------- the report
@torch.no_grad()
def sensitivity_report(
    model: Any,
    input_ids: torch.Tensor,
    *,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
    granularities: Sequence[str] = DEFAULT_GRANULARITIES,
    schemes: Sequence[str | KVQuantConfig] = DEFAULT_SCHEMES,
    block_size: int = 64,
    outlier_sigma: float = 6.0,
    attention: bool = True,
    model_name: str | None = None,
) -> SensitivityReport:
    """Run the whole analysis on `input_ids` [B, T] (equal-length rows, no padding).

    `schemes` are extra full KV configs (preset names or configs, e.g. SnapMLA's pre-scaled RoPE)
    for the attention-error part, on top of every dtype x granularity pair.
    """
    for g in granularities:
        if g not in ("per_tensor_dynamic", "per_channel", "per_token", "per_token_block"):
            raise ConfigError(f"granularities: {g!r} is not valid; allowed values: per_tensor_dynamic, "
                              f"per_channel, per_token, per_token_block")
    caps = capture_mla(model, input_ids)
    r, d = caps[0].kv_lora_rank, caps[0].rope_dim
    block = math.gcd(block_size, r, d)
    pairs = quant_schemes(dtypes, granularities)
    full_schemes = [(f"{dt}/{g}", part_config(dt, "per_token" if g == "none" else g, block)) for dt, g in pairs]
    for s in schemes:
        cfg = resolve_config(s)
        full_schemes.append((cfg.label(), cfg))

    stat_rows, cerr_rows, lerr_rows, attn_rows = [], [], [], []
    for cap in caps:
        parts = {"nope": cap.latent, "rope": cap.rope}
        layer_stats = {}
        for part, x in parts.items():
            flat = x.reshape(-1, x.shape[-1])
            st = channel_statistics(flat, outlier_sigma)
            rms = flat.double().pow(2).mean().sqrt()
            layer_stats[part] = {"absmax": float(st["absmax"].max()),
                                 "outlier_share": float((flat.double().abs() > outlier_sigma * rms).double().mean())}
            stat_rows.append(pd.DataFrame({"layer": cap.layer_idx, "part": part, "channel": range(flat.shape[1]),
                                           **{k: v.numpy() for k, v in st.items()}}))
            sig = flat.double().pow(2)
            for dt, g in pairs:
                cfg = part_config(dt, "per_token" if g == "none" else g, block)
                xq = quantize_part(x, cfg, part).dequantize(torch.float64).reshape(-1, x.shape[-1])
                err = (xq - flat.double()).pow(2)
                mse_c, sq_c = err.mean(0), sqnr_db(sig.sum(0), err.sum(0))
                cerr_rows.append(pd.DataFrame({"layer": cap.layer_idx, "part": part, "dtype": dt, "granularity": g,
                                               "channel": range(flat.shape[1]), "mse": mse_c.numpy(),
                                               "sqnr_db": sq_c.numpy()}))
                lerr_rows.append({"layer": cap.layer_idx, "part": part, "dtype": dt, "granularity": g,
                                  "mse": float(err.mean()), "sqnr_db": float(sqnr_db(sig.sum(), err.sum())),
                                  **layer_stats[part]})
        if attention:
            exact = latent_terms(cap, cap.latent)
            ref = _attend(cap, exact, cap.rope)
            for label, cfg in full_schemes:
                lat_q, rope_q = quantize_kv(cap.latent, cap.rope, cfg).dequantize(torch.float64)
                quant = latent_terms(cap, lat_q)
                variants = {"nope": (quant, cap.rope), "rope": (exact, rope_q), "both": (quant, rope_q)}
                for mode, (terms, rp) in variants.items():
                    rel, worst = _rel_errors(ref, _attend(cap, terms, rp))
                    attn_rows.append({"layer": cap.layer_idx, "scheme": label, "mode": mode, "rel_l2": rel,
                                      "max_token_rel": worst})
    meta = {"model": model_name or type(model).__name__, "num_sequences": int(input_ids.shape[0]),
            "seq_len": int(input_ids.shape[1]), "tokens": int(input_ids.numel()), "layers": len(caps),
            "kv_lora_rank": r, "rope_dim": d, "block_size": block, "outlier_sigma": outlier_sigma,
            "dtypes": list(dtypes), "granularities": list(granularities),
            "schemes": [lbl for lbl, _ in full_schemes]}
    return SensitivityReport(pd.concat(stat_rows, ignore_index=True), pd.concat(cerr_rows, ignore_index=True),
                             pd.DataFrame(lerr_rows),
                             pd.DataFrame(attn_rows, columns=["layer", "scheme", "mode", "rel_l2", "max_token_rel"]),
                             meta)


def _md_frame(df: pd.DataFrame) -> str:
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, row in df.iterrows():
        cells = []
        for v in row:
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
