"""Figures of a `SensitivityReport`: layer x channel heatmaps and per-layer line plots (PNG + PDF)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .plots import plt, save_figure
from .sensitivity import SensitivityReport


def _matrix(df, value: str) -> np.ndarray:
    m = df.pivot(index="layer", columns="channel", values=value).sort_index()
    return m.to_numpy(dtype=float)


def plot_channel_heatmaps(rep: SensitivityReport, out_dir: str | Path, stem: str = "channel_heatmaps") -> list[Path]:
    """absmax, excess kurtosis and outlier share, layer x channel, NoPE latent and RoPE key side by side."""
    stats = [("absmax", "absmax", False), ("kurtosis", "excess kurtosis", False),
             ("outlier_share", f"outlier share (|x| > {rep.meta.get('outlier_sigma', 6)} RMS)", False)]
    fig, axes = plt.subplots(len(stats), 2, figsize=(12, 2.6 * len(stats)), squeeze=False,
                             gridspec_kw={"width_ratios": [max(1, rep.meta["kv_lora_rank"] // 4 or 1),
                                                           max(1, rep.meta["rope_dim"] // 4 or 1) + 4]})
    for i, (col, title, _) in enumerate(stats):
        for j, part in enumerate(("nope", "rope")):
            ax = axes[i][j]
            m = _matrix(rep.channel_stats[rep.channel_stats["part"] == part], col)
            im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma")
            ax.set_title(f"{'NoPE latent' if part == 'nope' else 'RoPE key'}: {title}", fontsize=9)
            ax.set_xlabel("channel")
            ax.set_ylabel("layer")
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem)


def plot_error_heatmaps(rep: SensitivityReport, out_dir: str | Path, dtype: str = "fp8_e4m3",
                        granularities: tuple[str, ...] | None = None, stem: str | None = None) -> list[Path]:
    """Per-channel SQNR (dB), layer x channel, for one dtype under each granularity."""
    ce = rep.channel_error[rep.channel_error["dtype"] == dtype]
    if ce.empty:
        raise ValueError(f"no quantization error for dtype {dtype!r}; have {sorted(set(rep.channel_error['dtype']))}")
    grans = list(granularities or dict.fromkeys(ce["granularity"]))
    fig, axes = plt.subplots(len(grans), 2, figsize=(12, 2.4 * len(grans)), squeeze=False)
    finite = ce["sqnr_db"].replace([np.inf, -np.inf], np.nan)
    vmin, vmax = float(np.nanmin(finite)), float(np.nanmax(finite))
    for i, g in enumerate(grans):
        for j, part in enumerate(("nope", "rope")):
            ax = axes[i][j]
            m = _matrix(ce[(ce["granularity"] == g) & (ce["part"] == part)], "sqnr_db")
            m = np.where(np.isfinite(m), m, vmax)
            im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=vmin, vmax=vmax)
            ax.set_title(f"{'NoPE' if part == 'nope' else 'RoPE'} SQNR dB, {dtype} {g}", fontsize=9)
            ax.set_xlabel("channel")
            ax.set_ylabel("layer")
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem or f"sqnr_heatmaps_{dtype}")


def plot_layer_lines(rep: SensitivityReport, out_dir: str | Path, stem: str = "layer_lines") -> list[Path]:
    """Per layer: SQNR of each part under each dtype/granularity, and attention-output error per mode."""
    le = rep.layer_error
    has_attn = not rep.attn_error.empty
    ncols = 2 + (3 if has_attn else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.8), squeeze=False)
    for j, part in enumerate(("nope", "rope")):
        ax = axes[0][j]
        sel = le[le["part"] == part]
        for (dt, g), grp in sel.groupby(["dtype", "granularity"], sort=False):
            y = grp.sort_values("layer")["sqnr_db"].replace(np.inf, np.nan)
            ax.plot(grp.sort_values("layer")["layer"], y, marker=".", label=f"{dt}/{g}")
        ax.set_title(f"{'NoPE latent' if part == 'nope' else 'RoPE key'}: SQNR per layer", fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("SQNR (dB)")
        ax.grid(alpha=0.3)
    if has_attn:
        ae = rep.attn_error
        for k, mode in enumerate(("nope", "rope", "both")):
            ax = axes[0][2 + k]
            for scheme, grp in ae[ae["mode"] == mode].groupby("scheme", sort=False):
                grp = grp.sort_values("layer")
                ax.plot(grp["layer"], grp["rel_l2"], marker=".", label=scheme)
            ax.set_yscale("log")
            ax.set_title({"nope": "attn-out error, only NoPE quantized", "rope": "only RoPE quantized",
                          "both": "both quantized"}[mode], fontsize=9)
            ax.set_xlabel("layer")
            ax.set_ylabel("relative L2")
            ax.grid(alpha=0.3, which="both")
    h1, l1 = axes[0][0].get_legend_handles_labels()
    fig.legend(h1, l1, loc="lower center", ncol=min(4, len(l1)), fontsize=7,
               bbox_to_anchor=(0.5, -0.05 - 0.05 * math.ceil(len(l1) / 4)))
    if has_attn:
        h2, l2 = axes[0][2].get_legend_handles_labels()
        extra = [x for x in zip(h2, l2, strict=True) if x[1] not in l1]
        if extra:
            fig.legend([h for h, _ in extra], [lbl for _, lbl in extra], loc="upper right", fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem)


def plot_sensitivity(rep: SensitivityReport, out_dir: str | Path, dtypes: tuple[str, ...] = ("fp8_e4m3",)) -> list[Path]:
    paths = plot_channel_heatmaps(rep, out_dir) + plot_layer_lines(rep, out_dir)
    for dt in dtypes:
        if dt in set(rep.channel_error["dtype"]):
            paths += plot_error_heatmaps(rep, out_dir, dt)
    return paths
