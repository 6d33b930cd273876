"""Figures from sweep results (matplotlib, Agg backend, each saved as PNG and PDF).

- `plot_accuracy_vs_bytes`: one panel per task, primary metric (± stderr) against cache bytes per
  token per layer; the baseline is drawn as a horizontal reference line; zero stderrs, whose bars
  cannot be seen, are listed in the panel ("stderr 0: bf16 (n=8), ...").
- `plot_task_deltas`: per task, each cell's delta to the baseline with its paired 95% CI (the
  table caption names the interval);
  filled markers are significant under the paired test, hollow ones are not. A delta that is
  exactly zero with a zero-width interval (no discordant sample) is labelled "0 (exact)".
- `plot_fidelity_vs_bytes`: next-token KL and top-1 agreement vs bytes/token (decode and prefill);
  the baseline is an annotated reference line, not a point, so its near-zero KL (~1e-12) does not
  stretch the log axis over ten decades.

Shared helpers for every figure of the package: `robust_limits` (percentile colour limits with the
colorbar's extend side), `factor_styles` (colour x line style x marker, unique per line),
`reference_line` (a baseline drawn as a line, annotated at the edge when it lies off scale).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: CI and clusters have no display
import matplotlib.pyplot as plt

from ..atomic import atomic_save_figure, atomic_write_csv
from .tables import SweepTable

LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def colors() -> list[str]:
    return list(plt.rcParams["axes.prop_cycle"].by_key()["color"])


def robust_limits(values, percentiles: tuple[float, float] = (1.0, 99.0)) -> tuple[float, float, str]:
    """Colour limits at percentiles of the finite values, and the colorbar `extend` that flags clipping.

    A few near-exact channels (SQNR ~160 dB, or +inf for an exact one) otherwise set the colour
    scale and flatten the 25-45 dB range where the comparison is. Infinite values count as beyond
    the limit on their side; NaN is ignored.
    """
    import numpy as np

    v = np.asarray(values, dtype=float).ravel()
    v = v[~np.isnan(v)]
    finite = v[np.isfinite(v)]
    if finite.size == 0:
        raise ValueError("no finite values to set colour limits from")
    lo, hi = (float(x) for x in np.percentile(finite, percentiles))
    if hi <= lo:  # constant data: a non-degenerate range around it
        lo, hi = lo - 0.5, hi + 0.5
    below, above = bool((v < lo).any()), bool((v > hi).any())
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}
    return lo, hi, extend[(below, above)]


def factor_styles(keys: list[tuple[str, str]]) -> dict[tuple[str, str], dict]:
    """A distinct (colour, line style, marker) per (primary, secondary) key.

    Colour encodes the first factor, line style and marker the second, so 16 dtype x granularity
    lines stay readable where matplotlib's 10-colour cycle repeats. Past the palette the colours
    come back with the next shapes; a taken combination moves to the next free one, so the styles
    are unique for up to colours x 32 keys.
    """
    cs = colors()
    shapes = [(LINESTYLES[j % len(LINESTYLES)], MARKERS[j % len(MARKERS)]) for j in range(len(MARKERS))]
    shapes += [(ls, mk) for mk in MARKERS for ls in LINESTYLES if (ls, mk) not in shapes]
    combos = [(c, ls, mk) for c in cs for ls, mk in shapes]
    prim = list(dict.fromkeys(k[0] for k in keys))
    sec = list(dict.fromkeys(k[1] for k in keys))
    out: dict[tuple[str, str], dict] = {}
    used: set[tuple[str, str, str]] = set()
    for key in dict.fromkeys(keys):
        i, j = prim.index(key[0]), sec.index(key[1])
        ls, mk = shapes[(j + (i // len(cs)) * len(sec)) % len(shapes)]
        start = combos.index((cs[i % len(cs)], ls, mk))
        free = next((c for k in range(len(combos)) if (c := combos[(start + k) % len(combos)]) not in used), None)
        if free is None:
            raise ValueError(f"{len(out) + 1} lines exceed the {len(combos)} distinct line styles")
        used.add(free)
        out[key] = {"color": free[0], "ls": free[1], "marker": free[2]}
    return out


def reference_line(ax, y: float | list[float], label: str, *, color: str = "0.35") -> None:
    """Draw a baseline (one value, or one per mode) as dashed horizontal lines with one label.

    Set the axis limits from the data first: the lines never widen them. A baseline outside them
    stays off scale, and the label, with an arrow at that edge, gives its value instead.
    """
    ys = sorted(set(y if isinstance(y, list) else [y]))
    lim = ax.get_ylim()
    for v in ys:
        ax.axhline(v, color=color, ls="--", lw=1.0, gid="reference")
    ax.set_ylim(lim)  # axhline would otherwise widen the axis to include the baseline
    lo, hi = min(lim), max(lim)
    off = [v for v in ys if not lo <= v <= hi]
    if not off:
        ax.annotate(label, xy=(0.01, ys[-1]), xycoords=("axes fraction", "data"), xytext=(0, 2),
                    textcoords="offset points", fontsize=7, color=color, va="bottom", gid="reference_label")
        return
    low = (off[0] < lo) != (lim[0] > lim[1])  # below the visible range (an inverted axis swaps the edge)
    arrow = "\u2193" if low else "\u2191"
    ax.annotate(f"{arrow} {label} (off scale)", xy=(0.01, 0.02 if low else 0.98),
                xycoords="axes fraction", fontsize=7, color=color, va="bottom" if low else "top",
                gid="reference_label")


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
    cs = colors()
    points = []
    for ax, task in zip(axes.flat, tasks, strict=False):
        sel = table.long[table.long["task"] == task]
        zero: list[str] = []
        for i, (_, row) in enumerate(sel.iterrows()):
            x = bpt.get(row["label"])
            if x is None or not math.isfinite(row["value"]):
                continue
            points.append({"task": task, "label": row["label"], "metric": row["metric"], "bytes_per_token": x,
                           "value": row["value"], "stderr": row["stderr"]})
            se = row["stderr"] if math.isfinite(row["stderr"]) else 0.0
            marker = "s" if row["is_baseline"] else "o"
            ax.errorbar([x], [row["value"]], yerr=[se], fmt=marker, color=cs[i % len(cs)], capsize=4,
                        label=row["label"])
            if se == 0 and math.isfinite(row["stderr"]):
                n = row.get("n_samples")
                zero.append(f"{row['label']}" + (f" (n={int(n)})" if _finite(n) else ""))
            if row["is_baseline"]:
                ax.axhline(row["value"], color="grey", lw=0.8, ls="--")
        if zero:  # a zero-width error bar cannot be seen: say it
            ax.annotate("stderr 0: " + ", ".join(zero), xy=(0.01, 0.02), xycoords="axes fraction", fontsize=7,
                        color="0.3", gid="exact")
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
            has_ci = math.isfinite(lo) and math.isfinite(hi)
            xerr = [[d - lo], [hi - d]] if has_ci else None
            face = "C3" if row["significant"] else "white"
            ax.errorbar([d], [y], xerr=xerr, fmt="o", color="C3", mfc=face, ms=6, capsize=5, capthick=1.2,
                        elinewidth=1.2, zorder=3)
            if has_ci and hi - lo == 0:
                # a zero-width interval is invisible under its marker: say what it means in words
                n = row.get("n_paired")
                txt = ("0 (exact)" if d == 0 else f"{d:+.3g} (exact)") + (f", n={int(n)}" if _finite(n) else "")
                ax.annotate(txt, xy=(d, y), xytext=(9, 0), textcoords="offset points", va="center", fontsize=7,
                            color="C3", gid="exact")
        ax.axvline(0, color="grey", lw=0.8, zorder=1)
        ax.xaxis.set_major_locator(plt.MaxNLocator(5))
        ax.set_yticks(range(len(variants)))
        ax.set_yticklabels(variants, fontsize=8)
        ax.invert_yaxis()
        metric = sel["metric"].iloc[0] if len(sel) else ""
        ax.set_title(f"{task}: delta {metric} vs {table.baseline}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.suptitle("Delta vs baseline, 95% paired CI (filled = significant; "
                 "exact = every paired sample agrees)")
    fig.tight_layout()
    return save_figure(fig, out_dir, stem, points)


def plot_fidelity_vs_bytes(table: SweepTable, out_dir: str | Path, stem: str = "fidelity_vs_bytes") -> list[Path]:
    """Next-token KL (mean) and top-1 agreement vs the unquantized model, against bytes/token.

    The baseline cell (bf16: KL ~1e-12, top-1 = 1) is a labelled reference line, not a point: as a
    point it would stretch the log KL axis over ten decades and squeeze the quantized cells into
    its top. The KL axis is set from the quantized cells alone; an off-scale baseline gets an arrow.
    The sweep records no interval for these means, so none is drawn (`kl_p99` is in the CSV).
    """
    c = table.cells
    modes = [m for m in ("decode", "prefill") if f"{m}_kl_mean" in c and c[f"{m}_kl_mean"].notna().any()]
    if not modes:
        raise ValueError("no fidelity metrics in these results")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    points = []
    cs = colors()
    base_rows = []
    for i, (_, row) in enumerate(c.iterrows()):
        for mode, mk in zip(modes, ("o", "^"), strict=False):
            kl, top1 = row.get(f"{mode}_kl_mean"), row.get(f"{mode}_top1_agree")
            if kl is None or not math.isfinite(kl):
                continue
            x = row["bytes_per_token"]
            points.append({"label": row["label"], "mode": mode, "bytes_per_token": x, "kl_mean": kl,
                           "kl_p99": row.get(f"{mode}_kl_p99"), "top1_agree": top1,
                           "is_baseline": bool(row["is_baseline"])})
            if row["is_baseline"]:
                base_rows.append((row["label"], mode, kl, top1))
                continue
            lbl = f"{row['label']} ({mode})"
            axes[0].plot([x], [kl], mk, color=cs[i % len(cs)], label=lbl)
            axes[1].plot([x], [top1], mk, color=cs[i % len(cs)], label=lbl)
    axes[0].set(yscale="log", xlabel="cache bytes / token / layer", ylabel="mean KL (nats)",
                title="next-token KL vs unquantized")
    axes[1].set(xlabel="cache bytes / token / layer", ylabel="top-1 agreement", title="top-1 agreement")
    if any(not p["is_baseline"] for p in points):
        kls = [p["kl_mean"] for p in points if not p["is_baseline"] and p["kl_mean"] > 0]
        if kls:  # a decade of room around the quantized cells, whatever the baseline's KL is
            axes[0].set_ylim(min(kls) / 3, max(kls) * 3)
        # top-1 is a share near 1: the baseline (1.0) belongs on the same axis as the cells
        t1 = [p["top1_agree"] for p in points if p["top1_agree"] is not None and math.isfinite(p["top1_agree"])]
        pad = max(0.1 * (max(t1) - min(t1)), 0.005)
        axes[1].set_ylim(min(t1) - pad, max(t1) + pad)
    for label in dict.fromkeys(lbl for lbl, *_ in base_rows):
        rows = [r for r in base_rows if r[0] == label]
        kls = [(mode, kl) for _, mode, kl, _ in rows]
        if all(kl > 0 for _, kl in kls):
            reference_line(axes[0], [kl for _, kl in kls],
                           f"{label} baseline: KL " + ", ".join(f"{kl:.1e} ({mode})" for mode, kl in kls))
        else:
            axes[0].annotate(f"\u2193 {label} baseline: KL 0 (off the log scale)", xy=(0.01, 0.02),
                             xycoords="axes fraction", fontsize=7, color="0.35", gid="reference_label")
        tops = [(mode, t) for _, mode, _, t in rows if t is not None and math.isfinite(t)]
        if tops:
            same = len({t for _, t in tops}) == 1
            reference_line(axes[1], [t for _, t in tops], f"{label} baseline: " + (
                f"{tops[0][1]:.4g}" if same else ", ".join(f"{t:.4g} ({mode})" for mode, t in tops)))
    for ax in axes:
        ax.grid(alpha=0.3)
    handles, labels = axes[1].get_legend_handles_labels()
    keep = [(h, lbl) for h, lbl in zip(handles, labels, strict=True) if "baseline" not in lbl]
    if keep:
        axes[1].legend([h for h, _ in keep], [lbl for _, lbl in keep], fontsize=7, loc="center left",
                       bbox_to_anchor=(1.02, 0.5))
    fig.suptitle("Model-level fidelity (o = step-by-step decode, ^ = quantized prefill; dashed = baseline)")
    fig.tight_layout()
    return save_figure(fig, out_dir, stem, points)


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def plot_all(table: SweepTable, out_dir: str | Path) -> list[Path]:
    """Every sweep figure that the results support."""
    paths = plot_accuracy_vs_bytes(table, out_dir)
    if table.baseline is not None and len(table.cells) > 1:
        paths += plot_task_deltas(table, out_dir)
    if any(col.endswith("_kl_mean") for col in table.cells.columns):
        paths += plot_fidelity_vs_bytes(table, out_dir)
    return paths
