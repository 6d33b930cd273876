"""Running a sweep: expand cells, skip finished ones, evaluate the rest, write one JSON per cell.

The evaluation itself is pluggable (`CellEvaluator`): the default `LmEvalEvaluator` loads the model
once, patches it per cell and runs lm-eval plus the fidelity metrics; tests and users can pass
another evaluator object (or `--evaluator module:Class` on the command line). The runner owns
everything that must hold whatever the evaluator does: validation before compute, resume, atomic
result files, timing, seeds, environment records and the progress display.
"""

from __future__ import annotations

import importlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol, runtime_checkable

from ..environment import environment
from ..errors import ConfigError
from ..presets import PRESETS
from ..quant.layout import bytes_per_token
from ..results_io import CELL_SCHEMA, ResultStore
from .grid import Cell, Expansion, expand
from .quiet import quiet_libraries
from .schema import SweepSpec

ARRAYS = "arrays"
"""Payload (and unwritten result) key of a cell's per-position arrays."""


class CellProgress(Protocol):
    def phase(self, description: str, total: int | None) -> None: ...
    def advance(self, n: int = 1) -> None: ...


@runtime_checkable
class CellEvaluator(Protocol):
    """What the runner needs from an evaluator. `evaluate` returns the cell's measured payload:

    {"tasks": {task: {"metrics": {metric: {"value", "stderr"}}, "primary_metric", "n_samples", ...}},
     "samples": {task: [{"doc_id", "metrics": {metric: value}}]},   # per-sample, for paired tests
     "lm_eval": {...}, "fidelity": {...} | None, "timing": {phase: seconds},
     "arrays": {name: numpy array}}   # optional: written beside the cell JSON as <cell_id>.npz
    """

    def validate(self, spec: SweepSpec, cells: Sequence[Cell]) -> list[str]: ...
    def setup(self, spec: SweepSpec) -> dict[str, Any]: ...
    def evaluate(self, cell: Cell, spec: SweepSpec, progress: CellProgress) -> dict[str, Any]: ...


@dataclass
class SweepReport:
    out_dir: str
    cells: list[Cell]
    skipped: list[tuple[str, str]]
    already_done: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)


def load_evaluator(path: str | None) -> CellEvaluator:
    """`module:Class` (or `module:factory`) -> an evaluator instance; None -> the lm-eval evaluator."""
    if path is None:
        from .evaluate import LmEvalEvaluator

        return LmEvalEvaluator()
    mod, _, attr = path.partition(":")
    if not attr:
        raise ConfigError(f"evaluator={path!r}: expected 'module:Class'")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"evaluator={path!r} cannot be imported: {e}") from None
    ev = obj()
    if not isinstance(ev, CellEvaluator):
        raise ConfigError(f"evaluator={path!r} lacks validate/setup/evaluate")
    return ev


def prepare(spec: SweepSpec, evaluator: CellEvaluator) -> Expansion:
    """Expand and validate everything a run needs before any compute; raises one ConfigError."""
    expansion = expand(spec)
    errs = evaluator.validate(spec, expansion.cells)
    if errs:
        lines = "\n".join(f"  - {e}" for e in errs)
        where = f" in {spec.source_path}" if spec.source_path else ""
        raise ConfigError(f"{len(errs)} problem(s) in sweep config{where}:\n{lines}")
    return expansion


def manifest(spec: SweepSpec, expansion: Expansion) -> dict[str, Any]:
    return {
        "schema": "snapquant.sweep/1", "name": spec.name, "eval_key": spec.eval_key(),
        "baseline": spec.baseline, "spec": spec.to_dict(),
        "cells": [{"cell_id": c.cell_id, "label": c.label, "source": c.source, "axes": c.axes,
                   "is_baseline": c.is_baseline} for c in expansion.cells],
        "skipped": [{"label": lbl, "reason": why} for lbl, why in expansion.skipped],
    }


def run_sweep(
    spec: SweepSpec,
    evaluator: CellEvaluator | None = None,
    *,
    dry_run: bool = False,
    show_progress: bool = True,
    only: Sequence[str] | None = None,
    write_manifest: bool = True,
    fail_fast: bool = False,
    console: Any = None,
) -> SweepReport:
    """Run (or, with `dry_run`, list) the cells of a sweep in this process; finished cells are skipped.

    `only` restricts the run to these cell ids (how submitit jobs get their share). A cell whose
    evaluation raises is recorded in the report (and its traceback printed), the rest still run,
    unless `fail_fast`.
    """
    evaluator = evaluator or load_evaluator(None)
    expansion = prepare(spec, evaluator)
    store = ResultStore(spec.out_dir)
    cells = [c for c in expansion.cells if only is None or c.cell_id in set(only)]
    if only is not None and len(cells) != len(set(only)):
        unknown = sorted(set(only) - {c.cell_id for c in cells})
        raise ConfigError(f"cell ids not in this sweep: {', '.join(unknown)}")
    report = SweepReport(str(store.root), cells, list(expansion.skipped))
    report.already_done = [c.cell_id for c in cells if store.is_done(c.cell_id)]
    if dry_run:
        return report
    store.root.mkdir(parents=True, exist_ok=True)
    if write_manifest:  # the launching process only: jobs must not delete each other's temp files
        store.clean_temp()
        store.write_manifest(manifest(spec, expansion))
    todo = [c for c in cells if c.cell_id not in set(report.already_done)]
    if not todo:
        return report

    with quiet_libraries():  # our display only: no lm-eval chatter, no tqdm bars (also with --no-progress)
        model_info = evaluator.setup(spec)
    env = environment()
    with progress_display(show_progress, console) as prog, quiet_libraries():
        cell_bar = prog.add_task("cells", total=len(cells), completed=len(report.already_done))
        sample_bar = _CellBar(prog)  # one row, reset per phase of each cell
        for cell in todo:
            prog.update(cell_bar, description=f"cell {cell.label}")
            try:
                result = run_cell(cell, spec, evaluator, model_info, env, sample_bar)
            except Exception as e:
                if fail_fast:
                    raise
                import traceback

                report.failed[cell.cell_id] = f"{type(e).__name__}: {e}"
                (console or _console()).print(f"[red]cell {cell.label} failed:[/red]\n{traceback.format_exc()}")
                prog.advance(cell_bar)
                continue
            store.write(result, result.pop(ARRAYS, None))
            report.ran.append(cell.cell_id)
            prog.advance(cell_bar)
    return report


def run_cell(cell: Cell, spec: SweepSpec, evaluator: CellEvaluator, model_info: dict[str, Any],
             env: dict[str, Any], progress: CellProgress) -> dict[str, Any]:
    """Evaluate one cell and assemble its full result record (not yet written).

    The evaluator's per-position arrays, if any, ride along under `ARRAYS` (not JSON: the store
    writes them to their own file).
    """
    seed_everything(spec.seed)
    started = datetime.now(timezone.utc).isoformat()
    t0 = time.perf_counter()
    payload = evaluator.evaluate(cell, spec, progress)
    total = time.perf_counter() - t0
    timing = {"started": started, "finished": datetime.now(timezone.utc).isoformat(), "total_s": total,
              **payload.get("timing", {})}
    return {
        "schema": CELL_SCHEMA,
        "cell_id": cell.cell_id,
        "label": cell.label,
        "source": cell.source,
        "axes": cell.axes,
        "is_baseline": cell.is_baseline,
        "sweep": {"name": spec.name, "eval_key": spec.eval_key(), "baseline": spec.baseline,
                  "spec": spec.to_dict()},
        "kv_config": cell.config.to_dict(),
        "kv_description": cell.config.short_description(),
        "model": model_info,
        "tasks": payload.get("tasks", {}),
        "samples": payload.get("samples", {}),
        "lm_eval": payload.get("lm_eval", {}),
        "fidelity": payload.get("fidelity"),
        "bytes_per_token": bytes_record(cell, model_info),
        "timing": timing,
        "env": env,
        "seed": spec.seed,
        **({ARRAYS: payload["arrays"]} if payload.get("arrays") else {}),
    }


def bytes_record(cell: Cell, model_info: dict[str, Any]) -> dict[str, Any]:
    """Cache bytes per token: per layer at the model's dims, whole model, and at DeepSeek dims."""
    r, d = model_info.get("kv_lora_rank"), model_info.get("qk_rope_head_dim")
    rec: dict[str, Any] = {"deepseek_per_layer": _bpt(cell, 512, 64)}
    rec["deepseek_ratio_vs_bf16"] = rec["deepseek_per_layer"] / 1152 if rec["deepseek_per_layer"] else None
    if r and d:
        per_layer = _bpt(cell, r, d)
        bf16 = bytes_per_token(PRESETS["bf16"], r, d)
        layers = model_info.get("num_mla_layers") or 0
        rec.update(per_layer=per_layer, model_total=per_layer * layers if per_layer is not None else None,
                   ratio_vs_bf16=per_layer / bf16 if per_layer is not None else None,
                   kv_lora_rank=r, rope_dim=d, num_mla_layers=layers)
    return rec


def _bpt(cell: Cell, r: int, d: int) -> float | None:
    try:
        return bytes_per_token(cell.config, r, d)
    except ConfigError:  # e.g. a block size that does not divide DeepSeek's widths
        return None


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------- progress display
def _console():
    from rich.console import Console

    return Console(stderr=True)


class _NullProgress:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass

    def advance(self, *a, **k):
        pass

    def reset(self, *a, **k):
        pass


def progress_display(enabled: bool, console: Any = None) -> Any:
    """The rich progress display of a sweep (cells, then samples), or a no-op one when disabled."""
    if not enabled:
        return _NullProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console or _console(), transient=False)


class _CellBar:
    """The second progress bar: samples (requests) of the phase the current cell is in."""

    def __init__(self, prog: Any):
        self.prog = prog
        self.task = None

    def phase(self, description: str, total: int | None) -> None:
        if self.task is None:
            self.task = self.prog.add_task(description, total=total)
        else:
            self.prog.reset(self.task, total=total, description=description)

    def advance(self, n: int = 1) -> None:
        if self.task is not None:
            self.prog.advance(self.task, n)
