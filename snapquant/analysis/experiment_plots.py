"""Figures of the experiment scripts (experiments/*.py), drawn from their tables alone.

Each function takes the DataFrames the experiment writes as CSV, so a figure can be redrawn from a
committed table without rerunning the model (`python experiments/<name>.py --replot --out DIR`).
Where a table has an interval (columns `<metric>_ci_low` / `<metric>_ci_high`), the figure draws it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .plots import MARKERS, colors, plt, reference_line, save_figure


def _yerr(df: pd.DataFrame, col: str) -> np.ndarray | None:
    """Asymmetric error bars from `col`_ci_low / `col`_ci_high, or None when the table has no interval."""
    lo, hi = f"{col}_ci_low", f"{col}_ci_high"
    if lo not in df or hi not in df or df[[lo, hi]].isna().all().all():
        return None
    v = df[col].to_numpy(dtype=float)
    return np.vstack([v - df[lo].to_numpy(dtype=float), df[hi].to_numpy(dtype=float) - v])


def _points(ax, x: np.ndarray, table: pd.DataFrame, col: str, cs: list[str], fmt: str = "{:.2g}",
            scale: float = 1.0, skip: tuple[int, ...] = ()) -> None:
    """One marker per row with its interval (when the table has one), the numbers written beside it;
    values are divided by `scale` (the axis unit), rows in `skip` are left out."""
    err = _yerr(table, col)
    for i in range(len(table)):
        if i in skip:
            continue
        v = float(table[col].iloc[i])
        e = None if err is None else err[:, i:i + 1] / scale
        ax.errorbar([x[i]], [v / scale], yerr=e, fmt=MARKERS[i % len(MARKERS)], color=cs[i % len(cs)], ms=7,
                    capsize=5, elinewidth=1.3)
        txt = fmt.format(v / scale)
        if e is not None:
            txt += f"\n[{fmt.format(v / scale - e[0, 0])}, {fmt.format(v / scale + e[1, 0])}]"
        ax.annotate(txt, xy=(x[i], v / scale), xytext=(7, 0), textcoords="offset points", fontsize=6.5,
                    va="center", color=cs[i % len(cs)])


def plot_pv_pipeline(per_layer: pd.DataFrame, table: pd.DataFrame, out_dir: str | Path,
                     stem: str = "pv_pipeline") -> list[Path]:
    """Kernel-level error per layer, decode KL per pipeline (with its interval) and the paired KL ratio.

    Linear axes, KL from zero: the pipelines differ by factors of 1-3, which a log axis with a cut
    origin (bars) made look like orders of magnitude.
    """
    cs = colors()
    pipelines = list(table["pipeline"])
    has_ratio = "kl_ratio_vs_snapmla" in table
    fig, axes = plt.subplots(1, 3 if has_ratio else 2, figsize=(15 if has_ratio else 10.5, 3.9),
                             gridspec_kw={"width_ratios": [1.25, 1, 1] if has_ratio else [1.25, 1]})
    for i, name in enumerate(pipelines):
        s = per_layer[per_layer["pipeline"] == name].sort_values("layer")
        axes[0].plot(s["layer"], s["out_rel_l2"], marker=MARKERS[i % len(MARKERS)], color=cs[i % len(cs)],
                     ls=("-", "--")[i % 2], ms=5, label=name)
    axes[0].set(xlabel="layer", ylabel="output relative L2 (linear)",
                title="kernel level: reference decode vs float64")
    axes[0].xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    axes[0].legend(fontsize=7)
    x = np.arange(len(pipelines))
    top = float(np.nanmax(table.get("decode_kl_mean_ci_high", table["decode_kl_mean"])))
    exp = int(np.floor(np.log10(float(np.nanmax(table["decode_kl_mean"]))))) if top > 0 else 0
    _points(axes[1], x, table, "decode_kl_mean", cs, scale=10.0**exp)
    axes[1].set_ylim(0, top / 10.0**exp * 1.15)
    n, seqs = table.get("decode_kl_mean_n_positions"), table.get("decode_kl_mean_n_sequences")
    n_words = (f"{int(seqs.iloc[0])} sequences / " if seqs is not None else "") + (
        f"{int(n.iloc[0])} positions" if n is not None else "")
    axes[1].set(ylabel=f"mean KL ($10^{{{exp}}}$ nats), linear from 0",
                title="decode next-token KL vs unquantized" + ("\n95% CI" if _yerr(
                    table, "decode_kl_mean") is not None else "") + (f", n = {n_words}" if n_words else ""))
    if has_ratio:
        # a ratio reads on a log axis: x2 and /2 sit at the same distance from 1
        ref = tuple(i for i, p in enumerate(pipelines) if p == "snapmla")  # 1 by definition: the line below
        _points(axes[2], x, table, "kl_ratio_vs_snapmla", cs, fmt="{:.2f}", skip=ref)
        axes[2].set_yscale("log", base=2)
        lo = float(np.nanmin(table.get("kl_ratio_vs_snapmla_ci_low", table["kl_ratio_vs_snapmla"])))
        hi = float(np.nanmax(table.get("kl_ratio_vs_snapmla_ci_high", table["kl_ratio_vs_snapmla"])))
        axes[2].set_ylim(min(lo, 1.0) / 1.5, max(hi, 1.0) * 1.5)
        axes[2].yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        reference_line(axes[2], 1.0, "1 = scale-fused snapmla")
        axes[2].set(ylabel="KL / KL(snapmla), log\u2082 scale",
                    title="KL ratio to scale-fused snapmla\npaired on the same positions, 95% CI")
    for ax in axes[1:]:
        ax.set_xticks(x)
        ax.set_xticklabels(pipelines, rotation=20, fontsize=8, ha="right")
        ax.set_xlim(-0.4, len(pipelines) - 0.2)  # room for the last point's numbers
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem)


def plot_granularity(table: pd.DataFrame, grans: tuple[str, ...], out_dir: str | Path,
                     stem: str = "granularity") -> list[Path]:
    """SQNR, next-token KL (prefill and decode) and top-1 agreement per scale granularity."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    x = np.arange(len(grans))
    for scope, mk, c in (("latent", "o", "C0"), ("both", "s", "C3")):
        s = table[table["scope"] == scope].set_index("granularity").loc[list(grans)]
        if scope == "latent":
            axes[0].plot(x, s["nope_sqnr_db"], marker="o", color="C0", label="NoPE latent")
        else:
            axes[0].plot(x, s["rope_sqnr_db"], marker="s", color="C3", label="RoPE key")
        for mode, ls, dx in (("decode", "-", -0.06), ("prefill", "--", 0.06)):
            col = f"{mode}_kl_mean"
            axes[1].errorbar(x + dx, s[col], yerr=_yerr(s, col), marker=mk, ls=ls, color=c, capsize=3,
                             mfc=c if mode == "decode" else "white", label=f"{scope}: {mode}")
        axes[2].errorbar(x, s["decode_top1_agree"], yerr=_yerr(s, "decode_top1_agree"), marker=mk, color=c,
                         capsize=3, label=f"{scope}: decode")
    ci = "decode_kl_mean_ci_low" in table
    axes[0].set(ylabel="SQNR (dB)", title="FP8 quantization SQNR (mean over layers)")
    axes[1].set(ylabel="KL (nats, log scale)", yscale="log",
                title="next-token KL vs unquantized" + (" (95% CI)" if ci else ""))
    axes[2].set(ylabel="top-1 agreement", title="top-1 agreement, decode" + (" (95% CI)" if ci else ""))
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels([g.replace("per_", "").replace("_dynamic", "") for g in grans], fontsize=8)
        ax.set_xlabel("scale granularity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem)


def plot_rope_vs_nope(table: pd.DataFrame, out_dir: str | Path, stem: str = "rope_vs_nope") -> list[Path]:
    """Per layer: FP8 MSE of each part (per-token / per-tensor) and the attention-output error."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for part, c in (("nope", "C0"), ("rope", "C3")):
        axes[0].plot(table["layer"], table[f"{part}_fp8_per_token_mse"], marker="o", color=c, label=f"{part} per-token")
        axes[0].plot(table["layer"], table[f"{part}_fp8_per_tensor_dynamic_mse"], marker="s", ls="--", color=c,
                     label=f"{part} per-tensor")
        axes[1].plot(table["layer"], table[f"attn_err_fp8_only_{part}"], marker="o", color=c, label=f"only {part} in FP8")
    axes[1].plot(table["layer"], table["attn_err_snapmla_cache"], marker="^", ls=":", color="C2", label="SnapMLA cache")
    axes[0].set(yscale="log", xlabel="layer", ylabel="MSE (log scale)", title="FP8 e4m3 quantization MSE")
    axes[1].set(yscale="log", xlabel="layer", ylabel="relative L2 (log scale)", title="attention-output error")
    for ax in axes:
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem)


def plot_memory_throughput(memory: pd.DataFrame, throughput: pd.DataFrame, device: str, out_dir: str | Path,
                           stem: str = "memory_throughput") -> list[Path]:
    """Cache bytes per token per preset, and decode tokens/s against context length."""
    fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.9))
    m = memory.dropna(subset=["bytes_per_token_layer"])
    axes[0].barh(m["preset"], m["bytes_per_token_layer"], color="C0")  # bytes: a bar from zero is honest
    axes[0].invert_yaxis()
    axes[0].set(xlabel="cache bytes / token / layer", title="KV-cache size per preset")
    cs = colors()
    for i, (name, grp) in enumerate(throughput.groupby("config", sort=False)):
        axes[1].plot(grp["context"], grp["tokens_per_s"], marker=MARKERS[i % len(MARKERS)], color=cs[i % len(cs)],
                     ls=("-", "--")[i % 2], label=name)
    ctx = sorted(set(throughput["context"]))
    axes[1].set(xscale="log", xlabel="context (tokens, log scale)", ylabel="decode tokens / s",
                title=f"decode throughput ({device}), median of the timed steps")
    axes[1].set_xticks(ctx)
    axes[1].set_xticklabels([str(c) for c in ctx])
    axes[1].minorticks_off()
    axes[1].set_ylim(bottom=0)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, out_dir, stem)


def plot_long_context(table: pd.DataFrame, out_dir: str | Path, stem: str = "long_context") -> list[Path]:
    """Decode KL mean, KL p99 and top-1 flip rate of windows at increasing cache depth, one line per config,
    95% cluster-bootstrap intervals as error bars (experiments/long_context.py's table).

    x is the cache depth (tokens prefilled before the window) on a log2 axis, ticked at the measured
    depths; dashed lines are configs whose scales depend on other tokens (not causal-consistent).
    """
    from matplotlib.ticker import FixedLocator, NullLocator

    stats = [("kl_mean", "mean KL(ref || quant), nats (log)"), ("kl_p99", "KL p99, nats (log)"),
             ("flip_rate", "top-1 flip rate")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    labels = list(dict.fromkeys(table["config"]))
    cs = colors()
    depths = sorted(set(table["depth"].astype(int)))
    tiny = []  # configs whose KL is rounding noise (the identity): off the log KL axes, named in a note
    for i, label in enumerate(labels):
        s = table[table["config"] == label].sort_values("depth")
        x = s["depth"].to_numpy(float) * (1 + 0.025 * (i - (len(labels) - 1) / 2))  # dodge overlapping bars
        dashed = not bool(s["causal_consistent"].all()) if "causal_consistent" in s else False
        noise = bool((s["kl_p99"] < 1e-9).all()) and len(labels) > 1
        if noise:
            tiny.append(f"{label}: KL p99 < 1e-9 at every depth (max {s['kl_max'].max():.1g})")
        for ax, (col, _) in zip(axes, stats, strict=True):
            if noise and col.startswith("kl"):
                continue
            ax.errorbar(x, s[col], yerr=_yerr(s, col), marker=MARKERS[i % len(MARKERS)], ms=4, capsize=3,
                        color=cs[i % len(cs)], ls="--" if dashed else "-", lw=1.2, label=label)
    n_seq = int(table["n_sequences"].max())
    n_pos = int(table["n_positions"].max())
    for ax, (col, ylabel) in zip(axes, stats, strict=True):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(depths))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(d) for d in depths], fontsize=7)
        ax.set_xlabel("cache depth d (tokens prefilled before the window), log scale")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if col.startswith("kl"):
            pos = table[col][table[col] > 0]
            if len(pos):
                ax.set_yscale("log")
    axes[0].set_title(f"mean decode KL per window (95% CI; n = {n_seq} seq x {n_pos // max(n_seq, 1)} steps)",
                      fontsize=9)
    axes[1].set_title("KL p99 per window (95% CI)", fontsize=9)
    axes[2].set_title("top-1 flip rate per window (95% CI)", fontsize=9)
    axes[2].set_ylim(bottom=0)
    axes[2].legend(fontsize=7, loc="best")
    if tiny:
        axes[0].text(0.02, 0.02, "not drawn: " + "; ".join(tiny), transform=axes[0].transAxes, fontsize=6.5,
                     va="bottom")
    fig.tight_layout()
    return save_figure(fig, out_dir, stem)
