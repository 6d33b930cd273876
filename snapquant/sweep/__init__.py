"""Ablation sweeps: YAML spec -> cells -> one atomic JSON result per cell -> tables and plots.

- `SweepSpec.from_yaml` / `load_spec`: schema and validation (one error listing every problem).
- `expand`: presets + grid -> `Cell`s with stable ids (the resume key).
- `run_sweep` (inline) / `launch` (submitit local or Slurm) / `execute` (both, plus the report).
- `ResultStore`, `atomic_write_json`: the kill -9 safe result directory (`snapquant.results_io`).
- `CellEvaluator`: the pluggable per-cell evaluation; `LmEvalEvaluator` (lm-eval and fidelity from
  `snapquant.eval`) is the default.
"""

from ..atomic import atomic_write_text
from ..results_io import ResultStore, atomic_write_json
from .api import ExecuteResult, execute, load_spec
from .grid import Cell, Expansion, expand
from .launcher import launch
from .runner import CellEvaluator, SweepReport, load_evaluator, run_sweep
from .schema import FidelitySpec, GridSpec, LauncherSpec, SweepSpec, TaskSpec

__all__ = [
    "Cell", "CellEvaluator", "ExecuteResult", "Expansion", "FidelitySpec", "GridSpec", "LauncherSpec",
    "ResultStore", "SweepReport", "SweepSpec", "TaskSpec", "atomic_write_json", "atomic_write_text", "execute",
    "expand", "launch", "load_evaluator", "load_spec", "run_sweep",
]
