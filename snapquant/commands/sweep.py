"""`snapquant sweep CONFIG`: run an ablation sweep (resumable), then print its table."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import app


@app.command("sweep")
def sweep(
    config: Path = typer.Argument(..., help="Sweep YAML (see configs/quickstart.yaml)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and list the cells; run nothing."),
    out: Path = typer.Option(None, help="Results directory (overrides output_dir)."),
    model: str = typer.Option(None, help="Model to use instead of the file's `model` ('embedded' or a checkpoint dir)."),
    executor: str = typer.Option(None, help="inline | local | slurm (overrides launcher.executor)."),
    evaluator: str = typer.Option(None, help="Custom cell evaluator 'module:Class' (default: lm-eval + fidelity)."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Slurm: submit and return; `snapquant table` merges later."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars (logs, CI)."),
) -> None:
    """Evaluate every cell (preset or grid point) not finished yet; one JSON per cell; table + plots at the end."""
    from rich.console import Console

    from ..errors import ConfigError
    from ..sweep.api import execute, load_spec
    from ..sweep.runner import load_evaluator

    console = Console(stderr=True)
    overrides = {}
    if out is not None:
        overrides["output_dir"] = str(out)
    if model is not None:
        overrides["model"] = model
    try:
        if executor is not None:  # keep the file's other launcher settings
            overrides["launcher"] = {**_file_launcher(config), "executor": executor}
        ev = load_evaluator(evaluator)
        spec = load_spec(config, ev, overrides)
        res = execute(spec, ev, evaluator_path=evaluator, dry_run=dry_run, show_progress=not no_progress,
                      wait=not no_wait, console=console)
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    rep = res.report
    if dry_run:
        done = set(rep.already_done)
        typer.echo(f"{len(rep.cells)} cells in {rep.out_dir} ({len(done)} finished):")
        for c in rep.cells:
            mark = "done" if c.cell_id in done else "todo"
            typer.echo(f"  [{mark}] {c.cell_id:48s} {c.config.short_description()}"
                       + ("  (baseline)" if c.is_baseline else ""))
        for label, why in rep.skipped:
            typer.echo(f"  [skip] {label}: {why}")
        return
    console.print(f"{len(rep.ran)} cells run, {len(rep.already_done)} already finished, "
                  f"{len(rep.failed)} failed; results in {rep.out_dir}")
    if res.table is not None:
        typer.echo(res.table.to_markdown())
    if res.fidelity is not None:
        typer.echo(res.fidelity.to_markdown())
        console.print("wrote " + ", ".join(str(p) for p in [*res.files.values(), *res.plots]))
    if rep.failed:
        for cid, why in rep.failed.items():
            console.print(f"[red]failed[/red] {cid}: {why}", highlight=False)
        raise typer.Exit(1)


def _file_launcher(config: Path) -> dict:
    import yaml

    from ..errors import ConfigError

    try:
        raw = (yaml.safe_load(config.read_text()) or {}).get("launcher") or {}
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise ConfigError(f"cannot read {config}: {e}") from None
    return {"executor": raw} if isinstance(raw, str) else dict(raw)
