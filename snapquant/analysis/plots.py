"""Figures from sweep results (matplotlib, Agg backend, each saved as PNG and PDF).

- `plot_accuracy_vs_bytes`: one panel per task, primary metric (± stderr) against cache bytes per
  token per layer; the baseline is drawn as a horizontal reference line.
- `plot_task_deltas`: per task, each cell's delta to the baseline with its paired-bootstrap 95% CI;
  filled markers are significant under the paired test, hollow ones are not.
- `plot_fidelity_vs_bytes`: next-token KL and top-1 agreement vs bytes/token (decode and prefill).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: CI and clusters have no display
import matplotlib.pyplot as plt

from ..atomic import atomic_save_figure, atomic_write_csv
from .tables import SweepTable


def save_figure(fig, out_dir: str | Path, stem: str, points: list[dict] | None = None) -> list[Path]:
    """Write `stem`.png and `stem`.pdf (atomically), plus `stem`.csv of the plotted numbers."""
    import pandas as pd

    out = Path(out_dir)
    paths = []
    if points is not None:
        paths.append(atomic_write_csv(out / f"{stem}.csv", pd.DataFrame(points)))
    for ext in ("png", "pdf"):
        paths.append(atomic_save_figure(fig, out / f"{stem}.{ext}", format=ext, dpi=150, bbox_inches="tight"))
    plt.close(fig)
    return paths


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, max(1, n))
    return math.ceil(n / cols), cols


def plot_accuracy_vs_bytes(table: SweepTable, out_dir: str | Path, stem: str = "accuracy_vs_bytes") -> list[Path]:
    tasks = table.tasks
    if not tasks:
        raise ValueError("no task scores in these results: nothing to plot")
    nr, nc = _grid(len(tasks))
    fig, axes = plt.subplots(nr, nc, figsize=(4.6 * nc, 3.6 * nr), squeeze=False)
    bpt = dict(zip(table.cells["label"], table.cells["bytes_per_token"], strict=True))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    points = []
    for ax, task in zip(axes.flat, tasks, strict=False):
        sel = table.long[table.long["task"] == task]
        for i, (_, row) in enumerate(sel.iterrows()):
            x = bpt.get(row["label"])
            if x is None or not math.isfinite(row["value"]):
                continue
            points.append({"task": task, "label": row["label"], "metric": row["metric"], "bytes_per_token": x,
                           "value": row["value"], "stderr": row["stderr"]})
            se = row["stderr"] if math.isfinite(row["stderr"]) else 0.0
            marker = "s" if row["is_baseline"] else "o"
            ax.errorbar([x], [row["value"]], yerr=[se], fmt=marker, color=colors[i % len(colors)], capsize=3,
                        label=row["label"])
            if row["is_baseline"]:
                ax.axhline(row["value"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{task}")
        ax.set_xlabel("cache bytes / token / layer")
        ax.set_ylabel(sel["metric"].iloc[0] if len(sel) else "")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8,
               bbox_to_anchor=(0.5, -0.02 - 0.04 * math.ceil(len(labels) / 4)))
    fig.suptitle("Score vs KV-cache size (square = baseline)")
    fig.tight_layout()
    return save_figure(fig, out_dir, stem, points)


def plot_task_deltas(table: SweepTable, out_dir: str | Path, stem: str = "task_deltas") -> list[Path]:
    if table.baseline is None:
        raise ValueError("per-task deltas need a baseline cell (bf16) in the results")
    tasks = table.tasks
    variants = [lbl for lbl, b in zip(table.cells["label"], table.cells["is_baseline"], strict=True) if not b]
    if not tasks or not variants:
        raise ValueError("need at least one task and one non-baseline cell to plot deltas")
    nr, nc = _grid(len(tasks))
    fig, axes = plt.subplots(nr, nc, figsize=(4.6 * nc, 0.45 * len(variants) * nr + 1.6 * nr), squeeze=False)
    points = []
    for ax, task in zip(axes.flat, tasks, strict=False):
        sel = table.long[(table.long["task"] == task) & (~table.long["is_baseline"])].set_index("label")
        for y, lbl in enumerate(variants):
            if lbl not in sel.index:
                continue
            row = sel.loc[lbl]
            d, lo, hi = row["delta"], row["ci_low"], row["ci_high"]
            if not math.isfinite(d):
                continue
            points.append({"task": task, "label": lbl, "metric": row["metric"], "delta": d, "ci_low": lo,
                           "ci_high": hi, "p_value": row["p_value"], "significant": bool(row["significant"])})
            xerr = [[d - lo], [hi - d]] if math.isfinite(lo) and math.isfinite(hi) else None
            face = "C3" if row["significant"] else "white"
            ax.errorbar([d], [y], xerr=xerr, fmt="o", color="C3", mfc=face, capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        ax.xaxis.set_major_locator(plt.MaxNLocator(5))
        ax.set_yticks(range(len(variants)))
        ax.set_yticklabels(variants, fontsize=8)
        ax.invert_yaxis()
        metric = sel["metric"].iloc[0] if len(sel) else ""
        ax.set_title(f"{task}: delta {metric} vs {table.baseline}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.suptitle("Delta vs baseline, 95% paired-bootstrap CI (filled = significant)")
    fig.tight_layout()
    return save_figure(fig, out_dir, stem, points)


def plot_fidelity_vs_bytes(table: SweepTable, out_dir: str | Path, stem: str = "fidelity_vs_bytes") -> list[Path]:
    """Next-token KL (mean and p99) and top-1 agreement vs the unquantized model, against bytes/token."""
    c = table.cells
    modes = [m for m in ("decode", "prefill") if f"{m}_kl_mean" in c and c[f"{m}_kl_mean"].notna().any()]
    if not modes:
        raise ValueError("no fidelity metrics in these results")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    points = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (_, row) in enumerate(c.iterrows()):
        for mode, mk in zip(modes, ("o", "^"), strict=False):
            kl, top1 = row.get(f"{mode}_kl_mean"), row.get(f"{mode}_top1_agree")
            if kl is None or not math.isfinite(kl):
                continue
            x = row["bytes_per_token"]
            points.append({"label": row["label"], "mode": mode, "bytes_per_token": x, "kl_mean": kl,
                           "kl_p99": row.get(f"{mode}_kl_p99"), "top1_agree": top1})
            lbl = f"{row['label']} ({mode})"
            axes[0].plot([x], [max(kl, 1e-12)], mk, color=colors[i % len(colors)], label=lbl)
            axes[1].plot([x], [top1], mk, color=colors[i % len(colors)], label=lbl)
    axes[0].set(yscale="log", xlabel="cache bytes / token / layer", ylabel="mean KL (nats)",
                title="next-token KL vs unquantized")
    axes[1].set(xlabel="cache bytes / token / layer", ylabel="top-1 agreement", title="top-1 agreement")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="best")
    fig.suptitle("Model-level fidelity (o = step-by-step decode, ^ = quantized prefill)")
    fig.tight_layout()
    return save_figure(fig, out_dir, stem, points)


def plot_all(table: SweepTable, out_dir: str | Path) -> list[Path]:
    """Every sweep figure that the results support."""
    paths = plot_accuracy_vs_bytes(table, out_dir)
    if table.baseline is not None and len(table.cells) > 1:
        paths += plot_task_deltas(table, out_dir)
    if any(col.endswith("_kl_mean") for col in table.cells.columns):
        paths += plot_fidelity_vs_bytes(table, out_dir)
    return paths
