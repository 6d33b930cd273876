"""The side-by-side figure of a decode benchmark run (PNG + PDF).

Top: time per decode step of each shape for our BF16 kernel, FlashMLA BF16 (when installed), plain PyTorch, SnapMLA (fp8 query and
P) with default knobs and its fastest passing variant, and the fastest FP8-cache variant with bf16
query and P. Bottom: the same variants as speedup over our BF16 kernel (default knobs), with the
performance target of the shapes that have one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..atomic import atomic_save_figure
from .results import TARGETS, best, find

SERIES = (  # label, how to pick the row on a shape
    ("our BF16 kernel", {"variant": "bf16"}),
    ("FlashMLA BF16", {"variant": "flashmla"}),
    ("BF16 best knobs", {"family": "bf16", "_best": True}),
    ("PyTorch (bf16)", {"variant": "torch"}),
    ("SnapMLA FP8", {"variant": "snapmla"}),
    ("SnapMLA FP8 best", {"family": "fp8", "layout": "snapmla", "mode": "q8p8", "_best": True}),
    ("FP8 cache, bf16 q/P best", {"family": "fp8", "layout": "snapmla", "mode": "q16p16", "_best": True}),
)
COLORS = ("#4c72b0", "#222222", "#8fa8d4", "#999999", "#c44e52", "#e8938f", "#55a868")


def _pick(rows: list[dict[str, Any]], shape: str, how: dict[str, Any]) -> dict[str, Any] | None:
    how = dict(how)
    use_best = how.pop("_best", False)
    rs = [r for r in rows if r.get("op") == "decode" and r.get("shape") == shape]
    r = best(rs, **how) if use_best else find(rs, **how)
    return r if r is not None and r.get("status") == "ok" and r.get("us") else None


def plot_decode(rows: list[dict[str, Any]], png: Path, pdf: Path | None = None, title: str = "") -> list[Path]:
    """Draw the figure; returns the files written (none when no decode row has a time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes: list[str] = []
    labels: dict[str, str] = {}
    for r in rows:
        if r.get("op") == "decode" and r.get("shape") not in shapes:
            shapes.append(r["shape"])
            labels[r["shape"]] = (r.get("label") or r["shape"]).replace(" (mixed", "\n(mixed")
    shapes = [s for s in shapes if _pick(rows, s, SERIES[0][1]) is not None]
    if not shapes:
        return []
    fig, (ax_t, ax_s) = plt.subplots(2, 1, figsize=(max(8.0, 1.9 * len(shapes) + 2), 8.5), sharex=True)
    n = len(SERIES)
    width = 0.8 / n
    targets = {t.shape: t for t in TARGETS if t.metric == "speedup" or t.metric == "ratio"}
    for i, ((name, how), color) in enumerate(zip(SERIES, COLORS, strict=True)):
        xs, us, sp = [], [], []
        for j, s in enumerate(shapes):
            r = _pick(rows, s, how)
            base = _pick(rows, s, SERIES[0][1])
            if r is None or base is None:
                continue
            xs.append(j + (i - (n - 1) / 2) * width)
            us.append(r["us"])
            sp.append(base["us"] / r["us"])
        if xs:  # a series with no measurement gets no legend entry
            ax_t.bar(xs, us, width, label=name, color=color)
            ax_s.bar(xs, sp, width, color=color)
    for j, s in enumerate(shapes):
        t = targets.get(s)
        if t is None:
            continue
        y = t.threshold if t.metric == "speedup" else 1.0 / t.threshold
        ax_s.plot([j - 0.45, j + 0.45], [y, y], color="black", lw=1.5, ls="--")
        ax_s.annotate(f"target {y:.2g}x", (j, y), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    ax_s.axhline(1.0, color="black", lw=0.8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("us per decode step (log)")
    ax_t.legend(fontsize=8, ncol=3, loc="upper left")
    ax_t.set_title(title or "MLA decode: FP8 (SnapMLA) vs BF16, one layer")
    ax_s.set_ylabel("speedup over our BF16 kernel")
    ax_s.set_xticks(range(len(shapes)))
    ax_s.set_xticklabels([labels[s] for s in shapes], fontsize=8)
    for ax in (ax_t, ax_s):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    written = []
    for path in (png, pdf):
        if path is None:
            continue
        written.append(atomic_save_figure(fig, path, dpi=150))
    plt.close(fig)
    return written
