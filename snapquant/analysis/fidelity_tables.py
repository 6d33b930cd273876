"""Fidelity tables of a sweep: every cell's KL distribution with intervals, paired comparisons, the tail.

From the cell JSONs (`fidelity.<mode>.summary` and `per_sequence`, written by
`snapquant.eval.fidelity`) and, for the tail, the cells' arrays files (`<cell_id>.npz`):

- summary: per cell and mode, mean / median / p90 / p99 / max KL, share of positions above each KL
  threshold, top-1 flip rate and perplexity delta, each `value [95% CI]` (cluster bootstrap over
  sequences), with n sequences / positions;
- comparisons: each cell vs the baseline on the same positions: KL mean difference [CI] and its
  sign-flip p-value over sequences, KL ratio [CI], flip-rate difference [CI] and p (and `pairs`:
  every pair of cells, for the CSV);
- tail: every position with KL above a threshold (at least the `top` largest per cell and mode,
  among positions with KL > 0),
  with its sequence, position, KL, share of the cell's summed KL, the reference's and the quantized
  model's top-1 tokens, the true next token and the text before it. A mean can rest on one
  position; the tail says which.
Cells written before per-sequence sums were recorded still get their point values (no intervals,
no comparisons); cells without an arrays file get no tail rows, and the notes say so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..atomic import atomic_write_csv, atomic_write_text
from ..results_io import from_json_number, read_arrays
from .results import baseline_of
from .significance import DEFAULT_RESAMPLES
from .uncertainty import BOOTSTRAP_RESAMPLES, KL_THRESHOLDS, compare_fidelity, statistic_names, threshold_key

MODES = ("decode", "prefill")
TAIL_THRESHOLD = 0.1
TAIL_TOP = 10
TAIL_MARKDOWN_ROWS = 100
"""Rows per cell and mode in fidelity_tail.md (all of them are in fidelity_tail.csv)."""
FEW_SEQUENCES = 8
CONTEXT_CHARS = 40
CONTEXT_TOKENS = 32

STAT_LABELS = {"kl_mean": "KL mean", "kl_median": "KL median", "kl_p90": "KL p90", "kl_p99": "KL p99",
               "kl_max": "KL max", "flip_rate": "flip rate", "ppl_delta": "ppl Δ",
               **{f"share_{threshold_key(t)}": f"KL>{t:g}" for t in KL_THRESHOLDS}}


@dataclass
class FidelityTable:
    summary: pd.DataFrame
    """One row per (cell, mode, statistic): label, mode, statistic, value, ci_low, ci_high, n_sequences, n_positions."""
    comparisons: pd.DataFrame
    """One row per (cell, mode) vs the baseline: deltas, ratio, intervals, p-values, n."""
    pairs: pd.DataFrame
    """The same for every pair of cells (b vs a, a before b in the sweep's order)."""
    tail: pd.DataFrame
    """One row per listed position: label, mode, sequence, position, kl, kl_share, tokens, context."""
    baseline: str | None
    notes: list[str] = field(default_factory=list)
    tail_threshold: float = TAIL_THRESHOLD
    tail_top: int = TAIL_TOP

    # ------------------------------------------------------------------ renderings
    def summary_rows(self, mode: str) -> tuple[list[str], list[list[str]]]:
        s = self.summary[self.summary["mode"] == mode]
        stats_ = [k for k in STAT_LABELS if k in set(s["statistic"])]
        head = ["cell", "n (seq / pos)", *(STAT_LABELS[k] for k in stats_)]
        rows = []
        for label in dict.fromkeys(s["label"]):
            c = s[s["label"] == label].set_index("statistic")
            first = c.iloc[0]
            rows.append([label, _n(first["n_sequences"], first["n_positions"]),
                         *(_ci(c.loc[k, "value"], c.loc[k, "ci_low"], c.loc[k, "ci_high"]) if k in c.index else ""
                           for k in stats_)])
        return head, rows

    def comparison_rows(self, mode: str) -> tuple[list[str], list[list[str]]]:
        c = self.comparisons[self.comparisons["mode"] == mode] if len(self.comparisons) else self.comparisons
        head = ["cell", "n (seq / pos)", "ΔKL mean [CI]", "p", "KL ratio [CI]", "Δ flip rate [CI]", "p"]
        rows = [[r["label"], _n(r["n_sequences"], r["n_positions"]),
                 _ci(r["kl_delta"], r["kl_delta_ci_low"], r["kl_delta_ci_high"], signed=True), _p(r["kl_delta_p"]),
                 _ci(r["kl_ratio"], r["kl_ratio_ci_low"], r["kl_ratio_ci_high"]),
                 _ci(r["flip_delta"], r["flip_delta_ci_low"], r["flip_delta_ci_high"], signed=True),
                 _p(r["flip_delta_p"])] for _, r in c.iterrows()]
        return head, rows

    def modes(self) -> list[str]:
        return [m for m in MODES if m in set(self.summary["mode"])]

    def caption(self) -> str:
        return ("value [95% interval] from a cluster bootstrap over sequences (whole sequences resampled, percentile "
                "interval); n = sequences / positions. The maximum's interval cannot exceed the observed maximum "
                "(see fidelity_tail.md for the positions behind it). Comparisons pair the same positions: ΔKL "
                "mean and Δ flip rate = cell - baseline, jackknife t interval over sequences and two-sided "
                "sign-flip permutation p-value over sequences (uncorrected for multiple comparisons); KL "
                "ratio = mean KL of the cell / mean KL of the baseline, paired percentile cluster-bootstrap "
                "interval, n/a against an unquantized baseline (whose KL is rounding noise).")

    def to_markdown(self) -> str:
        out = ["# Fidelity vs the unquantized model", ""]
        for mode in self.modes():
            head, rows = self.summary_rows(mode)
            out += [f"## {mode}: distribution of next-token KL", "", *_md_table(head, rows), ""]
            if self.baseline is not None:
                head, rows = self.comparison_rows(mode)
                if rows:
                    out += [f"## {mode}: paired comparison with {self.baseline!r}", "", *_md_table(head, rows), ""]
        out += [self.caption(), ""]
        out += [f"- {n}" for n in self.notes]
        return "\n".join(out).rstrip() + "\n"

    def to_latex(self) -> str:
        from .tables import escape_tex

        parts = []
        for mode in self.modes():
            tabs = [(f"{mode}: next-token KL vs the unquantized model", *self.summary_rows(mode))]
            if self.baseline is not None:
                tabs.append((f"{mode}: paired comparison with {self.baseline}", *self.comparison_rows(mode)))
            for title, head, rows in tabs:
                if not rows:
                    continue
                body = [" & ".join(escape_tex(h) for h in head) + r" \\", r"\midrule"]
                body += [" & ".join(escape_tex(x) for x in r) + r" \\" for r in rows]
                parts += [r"\begin{table}[t]", r"\centering", r"\small",
                          rf"\begin{{tabular}}{{l{'r' * (len(head) - 1)}}}", r"\toprule", *body, r"\bottomrule",
                          r"\end{tabular}", rf"\caption{{{escape_tex(title + '. ' + self.caption())}}}", r"\end{table}", ""]
        return "\n".join(parts)

    def tail_markdown(self) -> str:
        out = [f"# Largest next-token KL positions (KL > {self.tail_threshold:g}, at least the top {self.tail_top} "
               "per cell and mode)", "",
               "pos = index of the predicted token in its sequence; context = the text before it (the model saw "
               "it, then predicted); share = the position's part of the cell's summed KL; ref / quant top-1 = "
               "each model's most likely next token.", ""]
        if self.tail.empty:
            out.append("No position of any cell moved (or no cell has per-position arrays).")
        for (label, mode), g in self.tail.groupby(["label", "mode"], sort=False):
            above = int((g["kl"] > self.tail_threshold).sum())
            total, n_pos = g["kl_total"].iloc[0], int(g["n_positions"].iloc[0])
            share = float(g.loc[g["kl"] > self.tail_threshold, "kl"].sum() / total) if total > 0 else math.nan
            out += [f"## {label} ({mode}): {above} of {n_pos} positions above {self.tail_threshold:g}"
                    + (f", carrying {share:.0%} of the summed KL" if above and math.isfinite(share) else ""), ""]
            rows = [[str(r["sequence"]), str(r["position"]), f"{r['kl']:.4g}", _share(r["kl_share"]),
                     _code(r["ref_top1"]), _code(r["quant_top1"]), _code(r["next_token"]), _code(r["context"])]
                    for _, r in g.head(TAIL_MARKDOWN_ROWS).iterrows()]
            out += _md_table(["seq", "pos", "KL", "share", "ref top-1", "quant top-1", "next token", "context"], rows,
                             numeric=4)
            if len(g) > TAIL_MARKDOWN_ROWS:
                out.append(f"\n{len(g) - TAIL_MARKDOWN_ROWS} more in fidelity_tail.csv")
            out.append("")
        out += [f"- {n}" for n in self.notes if "arrays" in n]
        return "\n".join(out).rstrip() + "\n"

    def save(self, out_dir: str | Path, stem: str = "fidelity") -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        return {
            "fidelity_markdown": atomic_write_text(out / f"{stem}.md", self.to_markdown()),
            "fidelity_latex": atomic_write_text(out / f"{stem}.tex", self.to_latex()),
            "fidelity_csv": atomic_write_csv(out / f"{stem}.csv", self.comparisons, index=False),
            "fidelity_summary_csv": atomic_write_csv(out / f"{stem}_summary.csv", self.summary, index=False),
            "fidelity_pairs_csv": atomic_write_csv(out / f"{stem}_pairs.csv", self.pairs, index=False),
            "fidelity_tail_markdown": atomic_write_text(out / f"{stem}_tail.md", self.tail_markdown()),
            "fidelity_tail_csv": atomic_write_csv(out / f"{stem}_tail.csv", self.tail, index=False),
        }


# ---------------------------------------------------------------------- building
def has_fidelity(results: Sequence[dict[str, Any]]) -> bool:
    return any(isinstance(r.get("fidelity"), dict) and any(isinstance(r["fidelity"].get(m), dict) for m in MODES)
               for r in results)


def build_fidelity_table(
    results: Sequence[dict[str, Any]],
    baseline: str | None = None,
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
    tail_threshold: float = TAIL_THRESHOLD,
    tail_top: int = TAIL_TOP,
    n_resamples: int = DEFAULT_RESAMPLES,
    bootstrap_resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> FidelityTable:
    """The fidelity tables of these cell results (see the module docstring).

    `decode(token_ids) -> str` turns the fidelity tokens into text for the tail (the sweep's
    tokenizer); without it tokens show as `<id>`. Cells are read back from where `load_results`
    found them (their "_file"), which is where their arrays files are.
    """
    base = baseline_of(list(results), baseline)
    notes: list[str] = []
    summary, comps, pairs, tail = [], [], [], []
    with_fid = [r for r in results if isinstance(r.get("fidelity"), dict)]
    for r in with_fid:
        for mode in MODES:
            res = r["fidelity"].get(mode)
            if isinstance(res, dict):
                summary += _summary_rows(r["label"], mode, res)
        if not any("per_sequence" in (r["fidelity"].get(m) or {}) for m in MODES):
            notes.append(f"{r['label']}: written before per-sequence sums were recorded: point values only, "
                         "no intervals or comparisons")
    for mode in MODES:
        cells = [r for r in with_fid if "per_sequence" in (r["fidelity"].get(mode) or {})]
        for i, a in enumerate(cells):
            for b in cells[i + 1:]:
                row = _compare(a, b, mode, n_resamples, bootstrap_resamples, seed, notes=None)
                if row:
                    pairs.append(row)
        if base is not None and base in cells:
            for r in cells:
                if r is not base:
                    row = _compare(base, r, mode, n_resamples, bootstrap_resamples, seed, notes)
                    if row:
                        comps.append(row)
    for r in with_fid:
        tail += _tail_rows(r, decode, tail_threshold, tail_top, notes)
    few = sorted({int(n) for n in (x["n_sequences"] for x in summary) if n is not None and n < FEW_SEQUENCES})
    if few:
        notes.append(f"intervals over {', '.join(map(str, few))} sequence(s) are rough: a bootstrap of n < "
                     f"{FEW_SEQUENCES} sequences has few distinct resamples and covers well below 95%, and the "
                     "sign-flip test cannot reach p < 0.05 below 6 sequences (its smallest p is 2 / 2^n)")
    comp_cols = ["label", "mode", "baseline", "n_sequences", "n_positions", "kl_delta", "kl_delta_ci_low",
                 "kl_delta_ci_high", "kl_delta_p", "kl_ratio", "kl_ratio_ci_low", "kl_ratio_ci_high", "kl_ratio_method",
                 "flip_delta", "flip_delta_ci_low", "flip_delta_ci_high", "flip_delta_p"]
    return FidelityTable(
        pd.DataFrame(summary, columns=["label", "mode", "statistic", "value", "ci_low", "ci_high", "n_sequences",
                                       "n_positions", "interval"]),
        pd.DataFrame(comps, columns=comp_cols), pd.DataFrame(pairs, columns=comp_cols),
        pd.DataFrame(tail, columns=["label", "mode", "sequence", "position", "kl", "kl_share", "ref_top1",
                                    "quant_top1", "next_token", "context", "kl_total", "n_positions"]),
        base["label"] if base is not None else None, notes, tail_threshold, tail_top)


def _summary_rows(label: str, mode: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    n_seq = res.get("n_sequences")
    n_pos = res.get("n_positions")
    if isinstance(res.get("summary"), dict):
        how = (res.get("interval") or {}).get("method", "")
        return [{"label": label, "mode": mode, "statistic": k, "value": from_json_number(v.get("value")),
                 "ci_low": from_json_number(v.get("ci_low")), "ci_high": from_json_number(v.get("ci_high")),
                 "n_sequences": n_seq, "n_positions": n_pos, "interval": how}
                for k, v in res["summary"].items() if k in statistic_names()]
    # a cell written before intervals were recorded: its point values
    top1 = from_json_number(res.get("top1_agree"))
    old = {"kl_mean": res.get("kl_mean"), "kl_p99": res.get("kl_p99"), "kl_max": res.get("kl_max"),
           "flip_rate": 1.0 - top1 if math.isfinite(top1) else None, "ppl_delta": res.get("ppl_delta")}
    return [{"label": label, "mode": mode, "statistic": k, "value": from_json_number(v), "ci_low": math.nan,
             "ci_high": math.nan, "n_sequences": n_seq, "n_positions": n_pos, "interval": "none"}
            for k, v in old.items() if v is not None]


def _is_identity(r: dict[str, Any]) -> bool:
    from ..config import KVQuantConfig

    try:
        return KVQuantConfig.from_dict(r["kv_config"]).is_identity
    except Exception:  # a config this version cannot read: assume quantized, the ratio is then shown
        return False


def _compare(a: dict[str, Any], b: dict[str, Any], mode: str, n_resamples: int, bootstrap_resamples: int, seed: int,
             notes: list[str] | None) -> dict[str, Any] | None:
    fa, fb = a["fidelity"], b["fidelity"]
    why = None
    if fa.get("tokens_sha256") and fb.get("tokens_sha256") and fa["tokens_sha256"] != fb["tokens_sha256"]:
        why = "scored on other tokens"
    elif fa[mode].get("first_position") != fb[mode].get("first_position"):
        why = "other positions (prompt length)"
    if why is None:
        try:
            c = compare_fidelity(fa[mode]["per_sequence"], fb[mode]["per_sequence"], n_resamples=n_resamples,
                                 bootstrap_resamples=bootstrap_resamples, seed=seed)
        except ValueError as e:
            why = str(e)
    if why is not None:
        if notes is not None:
            notes.append(f"{b['label']} ({mode}) not compared with {a['label']}: {why}")
        return None
    row = {"label": b["label"], "mode": mode, "baseline": a["label"], **c.to_dict()}
    if _is_identity(a):  # KL of an unquantized cache vs the unpatched model is rounding noise: no ratio
        row.update(kl_ratio=math.nan, kl_ratio_ci_low=math.nan, kl_ratio_ci_high=math.nan,
                   kl_ratio_method="undefined: the baseline is unquantized")
    return row


def _tail_rows(r: dict[str, Any], decode: Callable[[Sequence[int]], str] | None, threshold: float, top: int,
               notes: list[str]) -> list[dict[str, Any]]:
    modes = [m for m in MODES if isinstance(r["fidelity"].get(m), dict)]
    if not modes:
        return []
    try:
        arrays = read_arrays(r, r["_file"]) if "_file" in r else None
    except (OSError, ValueError) as e:
        notes.append(f"{r['label']}: per-position arrays unreadable ({e}): no tail listing")
        return []
    if arrays is None:
        notes.append(f"{r['label']}: no per-position arrays file: no tail listing")
        return []
    dec = decode or _ids_text
    ids = arrays["input_ids"]
    rows = []
    for mode in modes:
        if f"{mode}_kl" not in arrays:
            continue
        kl = arrays[f"{mode}_kl"]
        first = int(r["fidelity"][mode].get("first_position", 0))
        total = float(kl.sum())
        flat = kl.ravel()
        order = np.argsort(-flat, kind="stable")
        # every position above the threshold, filled up to `top` with the next largest that moved at all
        chosen = order[: max(min(top, int((flat > 0).sum())), int((flat > threshold).sum()))]
        for k in chosen:
            seq, j = divmod(int(k), kl.shape[1])
            t = first + j + 1  # the predicted token's index in the sequence
            ctx = dec([int(x) for x in ids[seq, max(0, t - CONTEXT_TOKENS):t]])[-CONTEXT_CHARS:]
            rows.append({"label": r["label"], "mode": mode, "sequence": seq, "position": t, "kl": float(flat[k]),
                         "kl_share": float(flat[k]) / total if total > 0 else math.nan,
                         "ref_top1": dec([int(arrays[f"{mode}_ref_top1"][seq, j])]),
                         "quant_top1": dec([int(arrays[f"{mode}_quant_top1"][seq, j])]),
                         "next_token": dec([int(ids[seq, t])]) if t < ids.shape[1] else "", "context": ctx,
                         "kl_total": total, "n_positions": int(kl.size)})
    return rows


# ---------------------------------------------------------------------- formatting
def _ids_text(ids: Sequence[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def _fmt(v: float, signed: bool = False) -> str:
    if v == 0:
        return "0"
    return f"{v:+.3g}" if signed else f"{v:.3g}"


def _ci(v: Any, lo: Any, hi: Any, signed: bool = False) -> str:
    v, lo, hi = (from_json_number(x) for x in (v, lo, hi))
    if not math.isfinite(v):
        return "n/a"
    s = _fmt(v, signed)
    if math.isfinite(lo) and math.isfinite(hi):
        s += f" [{_fmt(lo)}, {_fmt(hi)}]"
    return s


def _p(p: Any) -> str:
    p = from_json_number(p)
    return "n/a" if not math.isfinite(p) else (f"{p:.2g}" if p >= 0.001 else "<0.001")


def _n(n_seq: Any, n_pos: Any) -> str:
    ok = [x is not None and not (isinstance(x, float) and math.isnan(x)) for x in (n_seq, n_pos)]
    return f"{int(n_seq) if ok[0] else '?'} / {int(n_pos) if ok[1] else '?'}"


def _share(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.1%}"


def _code(text: str) -> str:
    """A token or context in a Markdown table cell: visible whitespace, no table-breaking pipes."""
    t = str(text).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return "`" + t.replace("`", "'").replace("|", "\\|") + "`" if t else "``"


def _md_table(head: list[str], rows: list[list[str]], numeric: int | None = None) -> list[str]:
    """Markdown rows; columns 1 .. `numeric`-1 (default all but the first) right-aligned, the rest left."""
    from .tables import escape_md

    last = len(head) if numeric is None else numeric
    lines = ["| " + " | ".join(escape_md(h) for h in head) + " |",
             "|" + "|".join("---:" if 0 < i < last else ":---" for i in range(len(head))) + "|"]
    return lines + ["| " + " | ".join(x if x.startswith("`") else escape_md(x) for x in r) + " |" for r in rows]
