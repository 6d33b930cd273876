"""`snapquant table RESULTS`: the benchmark table of a sweep (Markdown, LaTeX, CSV), printed and saved."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import app

SKIP_CORRUPT_HELP = "Leave out unreadable cell result files (each named in a warning) instead of stopping."


@app.command("table")
def table(
    results: list[Path] = typer.Argument(..., help="Results directory (with cells/), directories of cell JSONs, or files."),
    baseline: str = typer.Option(None, help="Label of the baseline row (default: the sweep's baseline, bf16)."),
    alpha: float = typer.Option(0.05, help="Significance level of the paired tests, 0 < alpha < 1."),
    metric: list[str] = typer.Option(None, "--metric", help="TASK=METRIC: the metric shown for a task."),
    out: Path = typer.Option(None, help="Directory for table.md/.tex/.csv (default: the first results dir)."),
    all_runs: bool = typer.Option(False, help="Include cells from earlier sweep settings (other eval keys)."),
    skip_corrupt: bool = typer.Option(False, "--skip-corrupt", help=SKIP_CORRUPT_HELP),
    latex: bool = typer.Option(False, help="Print LaTeX instead of Markdown."),
    tail_threshold: float = typer.Option(0.1, help="fidelity_tail.md lists every position with KL above this (nats)."),
    tail_top: int = typer.Option(10, help="... and at least this many of each cell's largest-KL positions."),
) -> None:
    """Rows = cells, columns = tasks: value ± stderr, delta vs baseline (* = paired test p < alpha), bytes/token.

    With fidelity measured: also fidelity.md/.tex/.csv (KL distribution with intervals, paired
    comparisons with the baseline) and fidelity_tail.md (the largest-KL positions with their text).
    """
    from ..analysis import build_fidelity_table, build_table, has_fidelity
    from ..errors import ConfigError

    try:
        check_tail(tail_threshold, tail_top)
        metrics = parse_metrics(metric)
        res = load_cells(results, all_runs, skip_corrupt)
        tab = build_table(res, baseline, alpha=alpha, metrics=metrics)
        fid = build_fidelity_table(res, baseline, decode=cell_decoder(res), tail_threshold=tail_threshold,
                                   tail_top=tail_top) if has_fidelity(res) else None
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    dest = out or (results[0] if results[0].is_dir() else results[0].parent)
    files = tab.save(dest)
    typer.echo(tab.to_latex() if latex else tab.to_markdown())
    if fid is not None:
        files.update(fid.save(dest))
        typer.echo(fid.to_latex() if latex else fid.to_markdown())
        for note in fid.notes:
            typer.secho(f"note: {note}", err=True, fg="yellow")
    typer.echo("wrote " + ", ".join(str(p) for p in files.values()), err=True)


def check_tail(threshold: float, top: int) -> None:
    import math

    from ..errors import ConfigError

    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise ConfigError(f"--tail-threshold={threshold!r}: expected a KL in nats >= 0 (e.g. 0.1)")
    if top < 0:
        raise ConfigError(f"--tail-top={top}: expected an integer >= 0")


def cell_decoder(results: list[dict]):
    """`ids -> text` with the tokenizer of the sweep that wrote these cells (None when it is not here)."""
    from ..eval.model import token_decoder

    for r in results:
        spec = (r.get("sweep") or {}).get("spec") or {}
        if r.get("fidelity") and spec.get("model"):
            return token_decoder(spec["model"], spec.get("tokenizer"))
    return None


def parse_metrics(items: list[str] | None) -> dict[str, str]:
    """`--metric TASK=METRIC` options (of `table` and `plot`) -> {task: metric}."""
    from ..errors import ConfigError

    out = {}
    for it in items or []:
        task, sep, m = it.partition("=")
        if not sep or not task or not m:
            raise ConfigError(f"--metric {it!r}: expected TASK=METRIC")
        if task in out and out[task] != m:
            raise ConfigError(f"--metric given twice for task {task!r} ({out[task]}, {m}): one metric per task")
        out[task] = m
    return out


def load_cells(results: list[Path], all_runs: bool, skip_corrupt: bool) -> list[dict]:
    """`load_results`, with each left-out corrupt file shown as a warning on stderr."""
    import warnings

    from ..analysis.results import CorruptResultWarning, load_results

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CorruptResultWarning)
        try:
            return load_results(*results, all_runs=all_runs, skip_corrupt=skip_corrupt)
        finally:
            skipped = [w for w in caught if issubclass(w.category, CorruptResultWarning)]
            for w in skipped:
                typer.secho(f"warning: {w.message}", err=True, fg="yellow", bold=True)
            if skipped:
                typer.secho(f"warning: {len(skipped)} cell result file(s) left out (--skip-corrupt): "
                            "fewer rows than the sweep has cells", err=True, fg="yellow", bold=True)
