"""Figures of the research-model study and analyses (PNG + PDF), read back from the result files."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd


def _save(fig, out: Path, stem: str) -> None:
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(out / f"{stem}.{ext}", dpi=120)
    plt.close(fig)


def plot_study(out: Path, models: list[str]) -> None:
    out = Path(out)
    fig, ax = plt.subplots(2, 2, figsize=(10, 7))
    for name in models:
        lay = pd.read_csv(out / f"study_cache_layers_{name}.csv")
        for j, part in enumerate(("nope", "rope")):
            d = lay[lay.part == part]
            ax[0, j].plot(d.layer, d.absmax_over_rms, marker="o", label=f"{name}")
            ax[1, j].plot(d.layer, d.kurtosis_max, marker="o", label=f"{name}")
            ax[0, j].set_title(f"{'latent (after norm)' if part == 'nope' else 'RoPE key'}: absmax / RMS")
            ax[1, j].set_title(f"{'latent' if part == 'nope' else 'RoPE key'}: max channel excess kurtosis")
    for i, a in enumerate(ax.flat):
        a.set_xlabel("layer")
        # Excess kurtosis can be negative (lighter tails than a Gaussian): symlog keeps those points.
        a.set_yscale("log" if i < 2 else "symlog", **({} if i < 2 else {"linthresh": 1.0}))
        a.legend()
    _save(fig, out, "study_cache_outliers")

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in models:
        ma = pd.read_csv(out / f"study_massive_{name}.csv")
        ax[0].plot(ma.layer, ma.max_over_median, marker="o", label=name)
        s = pd.read_csv(out / f"study_sinks_{name}.csv").groupby("layer").mass_first.agg(["mean", "max"]).reset_index()
        ax[1].plot(s.layer, s["mean"], marker="o", label=f"{name} (mean over heads)")
        ax[1].plot(s.layer, s["max"], ls="--", label=f"{name} (max head)")
    ax[0].axhline(1e4, color="grey", ls=":", label="10^4 (order of real LLMs, Sun et al. 2024)")
    ax[0].set_yscale("log")
    ax[0].set_title("residual stream max|h| / median|h|")
    ax[1].set_title("attention mass on position 0")
    for a in ax:
        a.set_xlabel("layer")
        a.legend(fontsize=7)
    _save(fig, out, "study_massive_and_sinks")


def plot_analyses(out: Path) -> None:
    out = Path(out)
    res = json.loads((out / "analyses.json").read_text())
    parts = [p for p in ("rope_vs_nope", "granularity", "pv_pipeline") if p in res["parts"]]
    if parts:
        fig, axes = plt.subplots(len(parts), 1, figsize=(8, 2.4 * len(parts) + 0.6), squeeze=False)
        for ax, part in zip(axes[:, 0], parts, strict=True):
            d = pd.DataFrame(res["parts"][part]["summary"])
            d = d[d.statistic == "kl_mean"].reset_index(drop=True)
            y = range(len(d))
            ax.errorbar(d.value, y, xerr=[d.value - d.ci_low, d.ci_high - d.value], fmt="o", capsize=3)
            ax.set_yticks(list(y), [f"{c} [{b}]" for c, b in zip(d.config, d.backend, strict=True)], fontsize=7)
            ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
            ax.set_title(f"{part}: decode KL vs unpatched BF16 (mean, 95% cluster-bootstrap CI)", fontsize=9)
        axes[-1, 0].set_xlabel("KL (nats / position)")
        _save(fig, out, "analyses_kl")
    lc = res["parts"].get("long_context", {}).get("rows")
    if lc:
        d = pd.DataFrame(lc)
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
        for j, stat in enumerate(("kl_mean", "flip_rate")):
            for cfg, g in d[d.statistic == stat].groupby("config"):
                ax[j].errorbar(g.depth, g.value, yerr=[g.value - g.ci_low, g.ci_high - g.value], marker="o",
                               capsize=3, label=cfg)
            ax[j].set_xscale("log", base=2)
            ax[j].set_xlabel("decode position (tokens of context)")
            ax[j].set_title(stat)
            ax[j].legend(fontsize=7)
        _save(fig, out, "analyses_long_context")
