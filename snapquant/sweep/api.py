"""`execute`: what `snapquant sweep CONFIG` does, as a function.

validate everything -> expand cells -> skip finished ones -> run the rest (inline, or as submitit
jobs) -> build the table and plots from every finished cell in the results directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..results_io import ResultStore
from .launcher import JobOutcome, launch
from .runner import CellEvaluator, SweepReport, load_evaluator, manifest, prepare, progress_display, run_sweep
from .schema import SweepSpec


@dataclass
class ExecuteResult:
    report: SweepReport
    jobs: list[JobOutcome] = field(default_factory=list)
    table: Any = None
    fidelity: Any = None
    files: dict[str, Path] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)


def load_spec(path: str | Path, evaluator: CellEvaluator | None = None,
              overrides: dict[str, Any] | None = None) -> SweepSpec:
    """Parse and validate a sweep file; task names are checked by the evaluator's own checker."""
    checker = getattr(evaluator, "check_tasks", None)
    return SweepSpec.from_yaml(path, overrides=overrides, task_checker=checker)


def execute(
    spec: SweepSpec,
    evaluator: CellEvaluator | None = None,
    *,
    evaluator_path: str | None = None,
    dry_run: bool = False,
    show_progress: bool = True,
    report: bool = True,
    wait: bool = True,
    console: Any = None,
) -> ExecuteResult:
    """Run a sweep end to end. `evaluator_path` ('module:Class') is what submitit jobs re-create."""
    ev = evaluator or load_evaluator(evaluator_path)
    if dry_run or spec.launcher.executor == "inline":
        rep = run_sweep(spec, ev, dry_run=dry_run, show_progress=show_progress, console=console)
        res = ExecuteResult(rep)
    else:
        expansion = prepare(spec, ev)
        store = ResultStore(spec.out_dir)
        store.root.mkdir(parents=True, exist_ok=True)
        store.clean_temp()
        store.write_manifest(manifest(spec, expansion))
        done = [c.cell_id for c in expansion.cells if store.is_done(c.cell_id)]
        todo = [c for c in expansion.cells if c.cell_id not in set(done)]
        rep = SweepReport(str(store.root), list(expansion.cells), list(expansion.skipped), already_done=done)
        jobs = _launch_with_progress(spec, todo, evaluator_path if evaluator is None else evaluator,
                                     wait, show_progress, console, len(expansion.cells), len(done))
        for j in jobs:
            rep.ran += j.ran
            rep.failed.update(j.failed)
            rep.jobs.append(j.job_id)
            if j.error:
                for cid in j.cell_ids:
                    rep.failed.setdefault(cid, f"job {j.job_id} failed: {j.error}")
        res = ExecuteResult(rep, jobs)
    if report and not dry_run and (wait or spec.launcher.executor == "inline"):
        _report(spec, res, ev)
    return res


def _launch_with_progress(spec, todo, evaluator, wait, show_progress, console, total, done) -> list[JobOutcome]:
    with progress_display(show_progress and wait, console) as prog:
        bar = prog.add_task(f"cells ({spec.launcher.executor} jobs)", total=total, completed=done)

        def on_done(out: JobOutcome) -> None:
            prog.advance(bar, len(out.cell_ids))

        return launch(spec, todo, evaluator, wait=wait, on_done=on_done)


def _report(spec: SweepSpec, res: ExecuteResult, evaluator: Any = None) -> None:
    """Table (md/tex/csv), fidelity tables and figures from every finished cell of this sweep, if any finished.

    The tail listing decodes tokens with the evaluator's tokenizer when it loaded one, else with
    the sweep model's.
    """
    from ..analysis import build_fidelity_table, build_table, has_fidelity, load_results
    from ..errors import ConfigError

    try:
        results = load_results(spec.out_dir)
    except ConfigError:
        return
    baseline = spec.baseline if any(r["label"] == spec.baseline for r in results) else None
    table = build_table(results, baseline)
    res.table = table
    res.files = table.save(spec.out_dir)
    if has_fidelity(results):
        from ..eval.model import token_decoder

        decode = token_decoder(spec.model, spec.tokenizer, getattr(evaluator, "tokenizer", None))
        res.fidelity = build_fidelity_table(results, baseline, decode=decode)
        res.files.update(res.fidelity.save(spec.out_dir))
    if len(table.tasks):
        from ..analysis.plots import plot_all

        res.plots = plot_all(table, Path(spec.out_dir) / "plots")
