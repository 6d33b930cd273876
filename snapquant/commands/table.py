"""`snapquant table RESULTS`: the benchmark table of a sweep (Markdown, LaTeX, CSV), printed and saved."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import app


@app.command("table")
def table(
    results: list[Path] = typer.Argument(..., help="Results directory (with cells/), directories of cell JSONs, or files."),
    baseline: str = typer.Option(None, help="Label of the baseline row (default: the sweep's baseline, bf16)."),
    alpha: float = typer.Option(0.05, help="Significance level of the paired tests."),
    metric: list[str] = typer.Option(None, "--metric", help="TASK=METRIC: the metric shown for a task."),
    out: Path = typer.Option(None, help="Directory for table.md/.tex/.csv (default: the first results dir)."),
    all_runs: bool = typer.Option(False, help="Include cells from earlier sweep settings (other eval keys)."),
    latex: bool = typer.Option(False, help="Print LaTeX instead of Markdown."),
) -> None:
    """Rows = cells, columns = tasks: value ± stderr, delta vs baseline (* = paired test p < alpha), bytes/token."""
    from ..analysis import build_table, load_results
    from ..errors import ConfigError

    try:
        metrics = _parse_metrics(metric)
        res = load_results(*results, all_runs=all_runs)
        tab = build_table(res, baseline, alpha=alpha, metrics=metrics)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    dest = out or (results[0] if results[0].is_dir() else results[0].parent)
    files = tab.save(dest)
    typer.echo(tab.to_latex() if latex else tab.to_markdown())
    typer.echo("wrote " + ", ".join(str(p) for p in files.values()), err=True)


def _parse_metrics(items: list[str] | None) -> dict[str, str]:
    from ..errors import ConfigError

    out = {}
    for it in items or []:
        task, sep, m = it.partition("=")
        if not sep or not task or not m:
            raise ConfigError(f"--metric {it!r}: expected TASK=METRIC")
        out[task] = m
    return out
