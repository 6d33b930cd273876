"""Benchmark tables from sweep results: a tidy DataFrame, and Markdown / LaTeX renderings.

Rows are cells (presets or grid points), columns are tasks. Each entry is the task's primary
metric as `value ± stderr`, followed by the delta to the baseline row (bf16 by default) with its
95% interval from the paired samples, and a `*` when the paired test on the same samples says the
difference is real (p < alpha, per task and cell, uncorrected for multiple comparisons: the
caption says so). The last row is each task's
minimum detectable effect (alpha, power 0.8) at its n, and the caption names each task's test and
n (`significance` has the tests and the MDE formulas). The last columns are the cache bytes per
token per layer and, when measured, decode fidelity (mean KL, top-1 agreement, each with its
cluster-bootstrap interval and n; the full fidelity tables are `fidelity_tables`).
Markdown and LaTeX are written here rather than through DataFrame.to_markdown/to_latex so the
output does not depend on the optional `tabulate` / `jinja2` packages.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ..atomic import atomic_write_csv, atomic_write_text
from ..errors import ConfigError
from ..results_io import from_json_number
from .results import baseline_of
from .significance import (
    DEFAULT_RESAMPLES,
    INTERVAL_WORDS,
    POWER,
    PairedTest,
    mde_paired_binary,
    mde_paired_continuous,
    pair_samples,
    paired_test,
)


@dataclass
class SweepTable:
    long: pd.DataFrame
    """One row per (cell, task): label, task, metric, value, stderr, delta, p_value, significant, ..."""
    cells: pd.DataFrame
    """One row per cell: label, cell_id, is_baseline, bytes per token, fidelity summary."""
    baseline: str | None
    alpha: float
    task_tests: pd.DataFrame | None = None
    """One row per task: metric, test, n, exact, pooled nuisance and the column's MDE."""

    # ------------------------------------------------------------------ views
    def wide(self, what: str = "value") -> pd.DataFrame:
        """Numeric cells x tasks frame of `what` (value, stderr, delta, p_value)."""
        if self.long.empty:
            return pd.DataFrame(index=self.cells["label"])
        w = self.long.pivot(index="label", columns="task", values=what)
        return w.reindex(index=list(self.cells["label"]), columns=self.tasks)

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(self.long["task"])) if not self.long.empty else []

    def headers(self) -> list[str]:
        metrics = dict(zip(self.long["task"], self.long["metric"], strict=False))
        cols = ["cell"] + [f"{t} ({metrics[t]})" for t in self.tasks] + ["B/token"]
        if self._has_fidelity():
            cols += ["KL mean [95% CI]", "top-1 [95% CI]", "fidelity n (seq / pos)"]
        return cols

    def rows(self, latex: bool = False) -> list[list[str]]:
        out = []
        for _, c in self.cells.iterrows():
            row = [str(c["label"]) + (" (baseline)" if c["is_baseline"] else "")]
            for t in self.tasks:
                sel = self.long[(self.long["label"] == c["label"]) & (self.long["task"] == t)]
                row.append(_entry(sel.iloc[0], self.alpha, latex) if len(sel) else "")
            row.append(_num(c["bytes_per_token"], 4))
            if self._has_fidelity():
                row += [_with_ci(c, "kl_mean", 3), _with_ci(c, "top1_agree", 4), _fidelity_n(c)]
            out.append(row)
        if self.tasks:
            mde = self._task_tests().set_index("task")["mde"]
            tail = [""] * (1 + 3 * self._has_fidelity())
            out.append([self.mde_label(), *[_mde(mde.get(t), latex) for t in self.tasks], *tail])
        return out

    def mde_label(self) -> str:
        return f"MDE (α={self.alpha:g}, power {POWER:g})"

    def _task_tests(self) -> pd.DataFrame:
        if self.task_tests is None:
            self.task_tests = task_tests(self.long, self.alpha)
        return self.task_tests

    def display(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows(), columns=self.headers())

    def _has_fidelity(self) -> bool:
        return "kl_mean" in self.cells and self.cells["kl_mean"].notna().any()

    def caption(self) -> str:
        base = f"delta vs {self.baseline!r}" if self.baseline else "no baseline row"
        per_task = "; ".join(_test_note(r) for _, r in self._task_tests().iterrows())
        return (f"value ± stderr ({base}) [95% interval of the delta]; * = paired test p < {self.alpha} on "
                f"the same samples, uncorrected for multiple comparisons. Tests: {per_task or 'none'}. "
                f"{self.mde_label()} = the smallest |delta| the test detects with probability {POWER:g} at "
                "that n (exact McNemar power at the pooled observed discordance for 0/1 metrics, "
                "(t_{1-α/2} + t_{power}) x pooled SE otherwise; ∞: no outcome reaches α at that n). "
                "B/token = cache bytes per token per layer at the model's dims."
                + (" Fidelity (decode, else prefill) vs the unquantized model: mean next-token KL and top-1 "
                   "agreement [95% cluster-bootstrap interval over sequences], n = sequences / positions; "
                   "fidelity.md has the distribution and the paired comparisons, fidelity_tail.md the "
                   "largest positions." if self._has_fidelity() else ""))

    # ------------------------------------------------------------------ renderings
    def to_markdown(self) -> str:
        head = self.headers()
        lines = ["| " + " | ".join(escape_md(h) for h in head) + " |",
                 "|" + "|".join(":---" if i == 0 else "---:" for i in range(len(head))) + "|"]
        lines += ["| " + " | ".join(escape_md(x) for x in r) + " |" for r in self.rows()]
        return "\n".join(lines) + "\n\n" + self.caption() + "\n"

    def to_latex(self) -> str:
        head = self.headers()
        spec = "l" + "r" * (len(head) - 1)
        body = [" & ".join(escape_tex(h) for h in head) + r" \\", r"\midrule"]
        for r in self.rows(latex=True):
            body.append(" & ".join([escape_tex(r[0]), *r[1:]]) + r" \\")
        return "\n".join([
            r"\begin{table}[t]", r"\centering", r"\small", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
            *body, r"\bottomrule", r"\end{tabular}", rf"\caption{{{escape_tex(self.caption())}}}", r"\end{table}",
        ]) + "\n"

    def save(self, out_dir: str | Path, stem: str = "table") -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = {
            "markdown": atomic_write_text(out / f"{stem}.md", self.to_markdown()),
            "latex": atomic_write_text(out / f"{stem}.tex", self.to_latex()),
            "csv": atomic_write_csv(out / f"{stem}.csv", self.long),
            "cells_csv": atomic_write_csv(out / f"{stem}_cells.csv", self.cells),
            "tasks_csv": atomic_write_csv(out / f"{stem}_tasks.csv", self._task_tests()),
        }
        return files


def build_table(
    results: list[dict[str, Any]],
    baseline: str | None = None,
    *,
    alpha: float = 0.05,
    metrics: dict[str, str] | None = None,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> SweepTable:
    """Tidy frames of a sweep's results with deltas, paired tests and MDEs against the baseline cell.

    `metrics` overrides the primary metric per task (default: what the cell records as primary).
    Raises ConfigError for an `alpha` outside (0, 1) and for a task or metric in `metrics` that
    no cell records, naming the valid ones.
    """
    check_alpha(alpha)
    check_metrics(results, metrics or {})
    base = baseline_of(results, baseline)
    rows, cell_rows = [], []
    for r in results:
        cell_rows.append(_cell_row(r))
        for task, tres in r.get("tasks", {}).items():
            metric = (metrics or {}).get(task) or tres.get("primary_metric") or next(iter(tres.get("metrics", {})), None)
            if metric is None or metric not in tres.get("metrics", {}):
                continue
            m = tres["metrics"][metric]
            row = {"label": r["label"], "cell_id": r["cell_id"], "task": task, "metric": metric,
                   "value": from_json_number(m.get("value")), "stderr": from_json_number(m.get("stderr")),
                   "higher_is_better": m.get("higher_is_better"), "n_samples": tres.get("n_samples"),
                   "is_baseline": base is not None and r["cell_id"] == base["cell_id"]}
            row.update(_compare(r, base, task, metric, m.get("aggregation"), row["value"], n_resamples, seed,
                                alpha))
            rows.append(row)
    long = pd.DataFrame(rows, columns=[
        "label", "cell_id", "task", "metric", "value", "stderr", "delta", "p_value", "significant", "test",
        "exact", "n_paired", "ci_low", "ci_high", "interval", "discordant", "se", "mde", "higher_is_better",
        "n_samples", "is_baseline"])
    cells = pd.DataFrame(cell_rows)
    if base is not None:  # baseline first, then the sweep's order
        cells = pd.concat([cells[cells["cell_id"] == base["cell_id"]], cells[cells["cell_id"] != base["cell_id"]]])
        cells["is_baseline"] = cells["cell_id"] == base["cell_id"]
    cells = cells.reset_index(drop=True)
    return SweepTable(long, cells, base["label"] if base else None, alpha, task_tests(long, alpha))


def task_tests(long: pd.DataFrame, alpha: float) -> pd.DataFrame:
    """One row per task: its test, n and the column's minimum detectable effect.

    The MDE pools the nuisance parameter over the task's comparisons with the baseline: the
    discordance rate (all discordant pairs / all pairs) for exact McNemar, the root mean square of
    the deltas' standard errors otherwise; n is the smallest paired n of the column.
    """
    out = []
    for task in dict.fromkeys(long["task"]) if not long.empty else []:
        sel = long[(long["task"] == task) & long["test"].notna() & (long["n_paired"] > 0)]
        row = {"task": task, "metric": long.loc[long["task"] == task, "metric"].iloc[0], "test": None,
               "exact": None, "interval": None, "n": 0, "comparisons": len(sel), "discordance": math.nan,
               "se": math.nan, "mde": math.nan}
        if len(sel):
            n = int(sel["n_paired"].min())
            row.update(test=sel["test"].iloc[0], exact=bool(sel["exact"].all()), interval=sel["interval"].iloc[0],
                       n=n)
            if row["test"] == "mcnemar_exact":
                row["discordance"] = float(sel["discordant"].sum() / sel["n_paired"].sum())
                row["mde"] = mde_paired_binary(n, row["discordance"], alpha=alpha)
            else:
                row["se"] = float(math.sqrt((sel["se"] ** 2).mean()))
                row["mde"] = mde_paired_continuous(row["se"], n, alpha=alpha)
        out.append(row)
    return pd.DataFrame(out, columns=["task", "metric", "test", "exact", "interval", "n", "comparisons",
                                      "discordance", "se", "mde"])


def check_alpha(alpha: float) -> None:
    """A significance level is a probability strictly between 0 and 1."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ConfigError(f"alpha={alpha!r} is not a significance level: expected 0 < alpha < 1 (e.g. 0.05)")


def recorded_metrics(results: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Task -> the metrics any cell records for it, in first-seen order."""
    out: dict[str, dict[str, None]] = {}
    for r in results:
        for task, tres in r.get("tasks", {}).items():
            out.setdefault(task, {}).update(dict.fromkeys(tres.get("metrics", {})))
    return {t: list(ms) for t, ms in out.items()}


def check_metrics(results: list[dict[str, Any]], metrics: dict[str, str]) -> None:
    """Every TASK=METRIC choice names a task of these results and a metric recorded for it."""
    known = recorded_metrics(results)
    for task, metric in metrics.items():
        if task not in known:
            raise ConfigError(f"metric {task}={metric}: no task {task!r} in these results{_close(task, known)}; "
                              f"tasks: {', '.join(known) or '(none)'}")
        if metric not in known[task]:
            raise ConfigError(f"metric {task}={metric}: {task} records no metric {metric!r}"
                              f"{_close(metric, known[task])}; its metrics: {', '.join(known[task]) or '(none)'}")


def _close(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _compare(r: dict, base: dict | None, task: str, metric: str, aggregation: str | None, value: float,
             n_resamples: int, seed: int, alpha: float) -> dict[str, Any]:
    empty = {"delta": math.nan, "p_value": math.nan, "significant": False, "test": None, "exact": None,
             "n_paired": 0, "ci_low": math.nan, "ci_high": math.nan, "interval": None, "discordant": math.nan,
             "se": math.nan, "mde": math.nan}
    if base is None or r["cell_id"] == base["cell_id"] or task not in base.get("tasks", {}):
        return empty
    bm = base["tasks"][task].get("metrics", {}).get(metric)
    if bm is None:
        return empty
    out = dict(empty, delta=value - from_json_number(bm.get("value")))
    a, b = pair_samples(base.get("samples", {}).get(task, []), r.get("samples", {}).get(task, []), metric)
    if a:
        t: PairedTest = paired_test(a, b, aggregation, n_resamples=n_resamples, seed=seed, alpha=alpha)
        out.update(p_value=t.p_value, significant=bool(t.significant(alpha)), test=t.test, exact=t.exact,
                   n_paired=t.n, ci_low=t.ci_low, ci_high=t.ci_high, interval=t.interval, se=t.se, mde=t.mde,
                   discordant=sum(t.discordant) if t.discordant else math.nan)
    return out


def _cell_row(r: dict[str, Any]) -> dict[str, Any]:
    bpt = r.get("bytes_per_token", {})
    row = {"label": r["label"], "cell_id": r["cell_id"], "source": r.get("source"),
           "is_baseline": bool(r.get("is_baseline")),
           "bytes_per_token": bpt.get("per_layer", bpt.get("deepseek_per_layer")),
           "ratio_vs_bf16": bpt.get("ratio_vs_bf16", bpt.get("deepseek_ratio_vs_bf16")),
           "deepseek_bytes_per_token": bpt.get("deepseek_per_layer"),
           "kv": r.get("kv_description"), "total_s": r.get("timing", {}).get("total_s")}
    fid = r.get("fidelity") or {}
    mode = fid.get("decode") or fid.get("prefill")
    if isinstance(mode, dict):  # the table's fidelity columns: decode when measured, else prefill
        row.update(fidelity_mode="decode" if fid.get("decode") else "prefill",
                   kl_mean=from_json_number(mode.get("kl_mean")), kl_p99=from_json_number(mode.get("kl_p99")),
                   top1_agree=from_json_number(mode.get("top1_agree")),
                   ppl_delta=from_json_number(mode.get("ppl_delta")),
                   fidelity_n_sequences=mode.get("n_sequences", fid.get("num_sequences")),
                   fidelity_n_positions=mode.get("n_positions"))
        summ = mode.get("summary")
        if isinstance(summ, dict):  # cells written with intervals (a top-1 interval is the flip rate's, mirrored)
            kl, flip = summ.get("kl_mean", {}), summ.get("flip_rate", {})
            row.update(kl_mean_ci_low=from_json_number(kl.get("ci_low")),
                       kl_mean_ci_high=from_json_number(kl.get("ci_high")),
                       top1_agree_ci_low=1.0 - from_json_number(flip.get("ci_high")),
                       top1_agree_ci_high=1.0 - from_json_number(flip.get("ci_low")))
        for m in ("prefill", "decode"):
            if isinstance(fid.get(m), dict):
                row.update({f"{m}_{k}": from_json_number(fid[m].get(k))
                            for k in ("kl_mean", "kl_p99", "top1_agree", "ppl_rel_delta")})
    return row


# ---------------------------------------------------------------------- formatting
def _decimals(stderr: float, value: float) -> int:
    if stderr and math.isfinite(stderr) and stderr > 0:
        return int(min(6, max(1, 1 - math.floor(math.log10(stderr)))))
    if value and math.isfinite(value):
        return int(min(6, max(1, 3 - math.floor(math.log10(abs(value))))))
    return 3


def _entry(row: pd.Series, alpha: float, latex: bool) -> str:
    v, se = row["value"], row["stderr"]
    if not math.isfinite(v):
        return "n/a"
    k = _decimals(se, v)
    pm = r" $\pm$ " if latex else " ± "
    s = f"{v:.{k}f}" + (f"{pm}{se:.{k}f}" if math.isfinite(se) else "")
    d = row["delta"]
    if not row["is_baseline"] and d is not None and math.isfinite(d):
        star = ("$^{*}$" if latex else "*") if row["significant"] else ""
        ds = f"{d:+.{k}f}"
        lo, hi = row.get("ci_low"), row.get("ci_high")
        if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
            ds += f" [{lo:.{k}f}, {hi:.{k}f}]"
        if latex:
            ds = ds.replace("-", "$-$")
        s += f" ({ds}{star})"
    return s


_TEST_WORDS = {"mcnemar_exact": "exact McNemar", "sign_flip_permutation": "sign-flip permutation"}


def _test_note(r: pd.Series) -> str:
    head = f"{r['task']} ({r['metric']})"
    if not r["test"]:
        return f"{head}: no paired per-sample outputs, no test"
    words = _TEST_WORDS.get(r["test"], r["test"])
    if r["test"] == "sign_flip_permutation":
        words += " (exact, all 2^n sign patterns)" if r["exact"] else " (randomized sign patterns)"
    return f"{head}: {words}, n = {r['n']} paired samples, {INTERVAL_WORDS.get(r['interval'], r['interval'])} interval"


def _mde(v: Any, latex: bool) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if math.isinf(v):
        return r"$\infty$" if latex else "∞"
    return f"{v:.3g}"


def _num(v: Any, sig: int) -> str:
    if v is None:
        return ""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(f):
        return ""
    return f"{f:.0f}" if f.is_integer() and abs(f) >= 1 else f"{f:.{sig}g}"


def _with_ci(c: pd.Series, key: str, sig: int) -> str:
    """`value [low, high]`, or the value alone for a cell written without intervals."""
    v = _num(c.get(key), sig)
    lo, hi = c.get(f"{key}_ci_low"), c.get(f"{key}_ci_high")
    if v and lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
        v += f" [{lo:.{sig}g}, {hi:.{sig}g}]"
    return v


def _fidelity_n(c: pd.Series) -> str:
    n_seq, n_pos = c.get("fidelity_n_sequences"), c.get("fidelity_n_positions")
    known = [x is not None and not (isinstance(x, float) and math.isnan(x)) for x in (n_seq, n_pos)]
    return f"{int(n_seq)} / {int(n_pos)}" if all(known) else ""


def escape_md(s: str) -> str:
    """Text for a Markdown table cell (pipes escaped)."""
    return str(s).replace("|", r"\|")


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$",
        "α": r"$\alpha$", "∞": r"$\infty$"}


def escape_tex(s: str) -> str:
    """Text for LaTeX (its special characters escaped; ±, α, ∞ as math)."""
    return "".join(_TEX.get(ch, ch) for ch in str(s))
