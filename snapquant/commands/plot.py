"""`snapquant plot RESULTS`: score vs bytes/token and per-task deltas, PNG and PDF."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import app
from .table import SKIP_CORRUPT_HELP


@app.command("plot")
def plot(
    results: list[Path] = typer.Argument(..., help="Results directory (with cells/), directories of cell JSONs, or files."),
    baseline: str = typer.Option(None, help="Label of the baseline row (default: the sweep's baseline)."),
    metric: list[str] = typer.Option(None, "--metric", help="TASK=METRIC: the metric plotted for a task."),
    out: Path = typer.Option(None, help="Output directory (default: <first results dir>/plots)."),
    all_runs: bool = typer.Option(False, help="Include cells from earlier sweep settings."),
    skip_corrupt: bool = typer.Option(False, "--skip-corrupt", help=SKIP_CORRUPT_HELP),
) -> None:
    """Figures of a sweep: accuracy vs bytes/token per task, and deltas vs baseline with paired CIs."""
    from ..analysis import build_table
    from ..analysis.plots import plot_all
    from ..errors import ConfigError
    from .table import load_cells, parse_metrics

    try:
        res = load_cells(results, all_runs, skip_corrupt)
        tab = build_table(res, baseline, metrics=parse_metrics(metric))
        dest = out or ((results[0] if results[0].is_dir() else results[0].parent) / "plots")
        paths = plot_all(tab, dest)
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    for p in paths:
        typer.echo(str(p))
