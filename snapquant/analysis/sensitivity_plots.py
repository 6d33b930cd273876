"""Figures of a `SensitivityReport`: layer x channel heatmaps and per-layer line plots (PNG + PDF).

The SQNR heatmaps take their colour limits from percentiles of the data (a few near-exact channels
at ~160 dB would otherwise flatten the 25-45 dB range), with the colorbar's arrow marking clipped
values; the line plots give each dtype x granularity its own colour x line style x marker and keep
the legend in a panel of its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .plots import factor_styles, plt, robust_limits, save_figure
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
                        granularities: tuple[str, ...] | None = None, stem: str | None = None,
                        percentiles: tuple[float, float] = (1.0, 99.0)) -> list[Path]:
    """Per-channel SQNR (dB), layer x channel, for one dtype under each granularity.

    One colour scale for all panels, from the `percentiles` of every panel's values; channels
    beyond it (near-exact ones, +inf for an exactly representable channel) take the end colour and
    the colorbar gets an arrow on that side; the title says how many there are.
    """
    ce = rep.channel_error[rep.channel_error["dtype"] == dtype]
    if ce.empty:
        raise ValueError(f"no quantization error for dtype {dtype!r}; have {sorted(set(rep.channel_error['dtype']))}")
    grans = list(granularities or dict.fromkeys(ce["granularity"]))
    ce = ce[ce["granularity"].isin(grans)]
    vals = ce["sqnr_db"].to_numpy(dtype=float)
    vmin, vmax, extend = robust_limits(vals, percentiles)
    n_hi, n_lo = int((vals > vmax).sum()), int((vals < vmin).sum())
    fig, axes = plt.subplots(len(grans), 2, figsize=(12, 2.4 * len(grans) + 0.5), squeeze=False)
    for i, g in enumerate(grans):
        for j, part in enumerate(("nope", "rope")):
            ax = axes[i][j]
            m = _matrix(ce[(ce["granularity"] == g) & (ce["part"] == part)], "sqnr_db")
            m = np.where(np.isposinf(m), vmax + 1.0, m)  # exact channels: the "above" colour, not a hole
            im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=vmin, vmax=vmax)
            ax.set_title(f"{'NoPE' if part == 'nope' else 'RoPE'} SQNR dB, {dtype} {g}", fontsize=9)
            ax.set_xlabel("channel")
            ax.set_ylabel("layer")
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, extend=extend)
    clipped = []
    if n_hi:
        clipped.append(f"{n_hi} above {vmax:.1f} dB (max {np.max(vals):.0f})")
    if n_lo:
        clipped.append(f"{n_lo} below {vmin:.1f} dB (min {np.min(vals):.1f})")
    fig.suptitle(f"Per-channel SQNR, {dtype}: colour scale = percentiles {percentiles[0]:g}-{percentiles[1]:g} of the "
                 f"{vals.size} channel values" + (f"; {', '.join(clipped)}, in the end colours" if clipped else ""),
                 fontsize=9)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem or f"sqnr_heatmaps_{dtype}")


def _scheme_key(scheme: str) -> tuple[str, str]:
    """'fp8_e4m3/per_token' -> ('fp8_e4m3', 'per_token'); a full preset -> ('preset:<name>', 'preset')."""
    dt, sep, g = scheme.partition("/")
    return (dt, g) if sep else (f"preset:{scheme}", "preset")


def plot_layer_lines(rep: SensitivityReport, out_dir: str | Path, stem: str = "layer_lines") -> list[Path]:
    """Per layer: SQNR of each part under each dtype/granularity, and attention-output error per mode.

    Colour = element format, line style and marker = granularity (full presets: their own colours),
    every line a distinct style; one legend for all panels in a panel of its own.
    """
    le = rep.layer_error
    ae = rep.attn_error
    has_attn = not ae.empty
    keys = [(str(dt), str(g)) for dt, g in dict.fromkeys(zip(le["dtype"], le["granularity"], strict=True))]
    if has_attn:
        keys += [k for k in dict.fromkeys(_scheme_key(s) for s in ae["scheme"]) if k not in keys]
    styles = factor_styles(keys)
    nrows = 2 if has_attn else 1
    fig, axes = plt.subplots(nrows, 3, figsize=(13.5, 3.7 * nrows), squeeze=False)
    for j, part in enumerate(("nope", "rope")):
        ax = axes[0][j]
        sel = le[le["part"] == part]
        for (dt, g), grp in sel.groupby(["dtype", "granularity"], sort=False):
            grp = grp.sort_values("layer")
            ax.plot(grp["layer"], grp["sqnr_db"].replace(np.inf, np.nan), lw=1.2, ms=4,
                    label=f"{dt} / {g}", **styles[(str(dt), str(g))])
        ax.set_title(f"{'NoPE latent' if part == 'nope' else 'RoPE key'}: SQNR per layer", fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("SQNR (dB)")
        ax.grid(alpha=0.3)
    if has_attn:
        for k, mode in enumerate(("nope", "rope", "both")):
            ax = axes[1][k]
            for scheme, grp in ae[ae["mode"] == mode].groupby("scheme", sort=False):
                grp = grp.sort_values("layer")
                key = _scheme_key(str(scheme))
                # a full preset can equal one dtype/granularity pair: drawn wide and pale underneath,
                # so the coinciding thin line stays visible on top of it
                wide = {"lw": 3.2, "alpha": 0.45, "zorder": 1.5, "ms": 6} if key[1] == "preset" else {"lw": 1.2, "ms": 4}
                ax.plot(grp["layer"], grp["rel_l2"], label=f"{key[0]} / {key[1]}" if key[1] != "preset"
                        else f"preset {scheme}", **wide, **styles[key])
            ax.set_yscale("log")
            ax.set_title({"nope": "attention-output error, only NoPE quantized", "rope": "only RoPE quantized",
                          "both": "both quantized"}[mode], fontsize=9)
            ax.set_xlabel("layer")
            ax.set_ylabel("relative L2")
            ax.grid(alpha=0.3, which="both")
    # the legend gets a panel of its own: no line, title or tick under it
    leg_ax = axes[0][2]
    leg_ax.axis("off")
    entries: dict[str, object] = {}
    for ax in axes.flat:
        for h, lbl in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(lbl, h)
    leg_ax.legend(list(entries.values()), list(entries.keys()), loc="center", fontsize=7,
                  ncol=2 if len(entries) > 10 else 1, title="colour = format, line + marker = granularity",
                  title_fontsize=7, frameon=False)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem)


def plot_sensitivity(rep: SensitivityReport, out_dir: str | Path, dtypes: tuple[str, ...] = ("fp8_e4m3",)) -> list[Path]:
    paths = plot_channel_heatmaps(rep, out_dir) + plot_layer_lines(rep, out_dir)
    for dt in dtypes:
        if dt in set(rep.channel_error["dtype"]):
            paths += plot_error_heatmaps(rep, out_dir, dt)
    return paths
