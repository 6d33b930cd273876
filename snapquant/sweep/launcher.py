"""Running cells as independent submitit jobs: Slurm on a cluster, submitit's local executor here.

Each job gets `cells_per_job` unfinished cells, loads the model once, runs them through the same
`run_sweep(..., only=ids)` as an inline run, and writes its cell files into the shared results
directory; nothing else needs merging. One GPU per job (`gpus_per_node`); a model too big for one
GPU sets `device_map: auto` in the sweep and asks for more GPUs per job.

Local executor: every job is a subprocess started at once, so we keep at most `max_parallel` of
them running (default: one per visible GPU, or one on a CPU-only machine) and pin each to its own
GPU through `visible_gpus`. Slurm: all jobs are submitted as one array, with
`slurm_array_parallelism = max_parallel` when given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .grid import Cell
from .runner import CellEvaluator, load_evaluator, run_sweep
from .schema import SweepSpec


@dataclass
class JobOutcome:
    job_id: str
    cell_ids: list[str]
    ran: list[str]
    failed: dict[str, str]
    error: str | None = None


def run_job(spec: SweepSpec, evaluator: str | CellEvaluator | None, cell_ids: list[str]) -> dict[str, Any]:
    """Body of one submitit job (module-level so it pickles by reference)."""
    ev = evaluator if not isinstance(evaluator, (str, type(None))) else load_evaluator(evaluator)
    rep = run_sweep(spec, ev, only=cell_ids, write_manifest=False, show_progress=False)
    return {"ran": rep.ran, "failed": rep.failed, "already_done": rep.already_done}


def _import_submitit():
    try:
        import submitit
    except ImportError:  # pragma: no cover - submitit is an optional extra
        raise ConfigError("launcher.executor local/slurm needs submitit: pip install 'snapquant[cluster]'") from None
    return submitit


def make_executor(spec: SweepSpec, folder: Path) -> Any:
    submitit = _import_submitit()
    la = spec.launcher
    if la.executor == "local":
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=la.timeout_min)
        return ex
    if la.executor == "slurm":
        ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
        params: dict[str, Any] = {"timeout_min": la.timeout_min, "gpus_per_node": la.gpus_per_node,
                                  "name": f"snapquant-{spec.name}", "tasks_per_node": 1, "nodes": 1}
        if la.cpus_per_task:
            params["cpus_per_task"] = la.cpus_per_task
        if la.mem_gb:
            params["mem_gb"] = la.mem_gb
        if la.max_parallel:
            params["slurm_array_parallelism"] = la.max_parallel
        params.update({f"slurm_{k}": v for k, v in la.slurm.items()})
        ex.update_parameters(**params)
        return ex
    raise ConfigError(f"launcher.executor={la.executor!r} does not submit jobs")


def chunk(cells: Sequence[Cell], size: int) -> list[list[str]]:
    ids = [c.cell_id for c in cells]
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def launch(
    spec: SweepSpec,
    cells: Sequence[Cell],
    evaluator: str | CellEvaluator | None = None,
    *,
    wait: bool = True,
    poll_s: float = 1.0,
    on_done: Any = None,
) -> list[JobOutcome]:
    """Submit `cells` (unfinished ones) as jobs; with `wait`, block until all end and collect outcomes.

    `on_done(outcome)` is called as each job finishes (the CLI advances its progress bar there).
    """
    folder = Path(spec.out_dir) / "submitit"
    ex = make_executor(spec, folder)
    groups = chunk(cells, spec.launcher.cells_per_job)
    if not groups:
        return []
    if spec.launcher.executor == "slurm":
        with ex.batch():
            jobs = [ex.submit(run_job, spec, evaluator, g) for g in groups]
        pending = list(zip(jobs, groups, strict=True))
        return _wait(pending, poll_s, on_done) if wait else [JobOutcome(j.job_id, g, [], {}) for j, g in pending]
    return _run_local(ex, spec, groups, evaluator, poll_s, on_done)


def _local_slots(spec: SweepSpec) -> list[list[int]]:
    """GPU sets for concurrently running local jobs: one GPU each, or CPU-only slots."""
    import torch

    la = spec.launcher
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per = la.gpus_per_node if n_gpu else 0
    if per:
        slots = [list(range(i, i + per)) for i in range(0, n_gpu - per + 1, per)]
    else:
        slots = [[] for _ in range(la.max_parallel or 1)]
    if la.max_parallel:
        slots = slots[: la.max_parallel]
    return slots or [[]]


def _run_local(ex: Any, spec: SweepSpec, groups: list[list[str]], evaluator: Any, poll_s: float,
               on_done: Any) -> list[JobOutcome]:
    free = _local_slots(spec)
    queue = list(groups)
    running: list[tuple[Any, list[str], list[int]]] = []
    outcomes: list[JobOutcome] = []
    while queue or running:
        while queue and free:
            gpus = free.pop(0)
            g = queue.pop(0)
            ex.update_parameters(gpus_per_node=len(gpus), visible_gpus=tuple(gpus))
            running.append((ex.submit(run_job, spec, evaluator, g), g, gpus))
        still = []
        for job, g, gpus in running:
            if job.done():
                out = _outcome(job, g)
                outcomes.append(out)
                free.append(gpus)
                if on_done:
                    on_done(out)
            else:
                still.append((job, g, gpus))
        running = still
        if running:
            time.sleep(poll_s)
    return outcomes


def _wait(pending: list[tuple[Any, list[str]]], poll_s: float, on_done: Any) -> list[JobOutcome]:
    outcomes = []
    while pending:
        still = []
        for job, g in pending:
            if job.done():
                out = _outcome(job, g)
                outcomes.append(out)
                if on_done:
                    on_done(out)
            else:
                still.append((job, g))
        pending = still
        if pending:
            time.sleep(poll_s)
    return outcomes


def _outcome(job: Any, group: list[str]) -> JobOutcome:
    try:
        res = job.result()
        return JobOutcome(str(job.job_id), group, res["ran"], res["failed"])
    except Exception as e:  # the job crashed (OOM, node failure, ...): its cells stay unfinished
        return JobOutcome(str(job.job_id), group, [], {}, error=f"{type(e).__name__}: {str(e)[-2000:]}")
