"""The default cell evaluator: patch the model with the cell's KV config, run lm-eval and fidelity.

Per worker: the model is loaded once (`setup`), the fidelity reference (the unpatched model's
next-token distributions on the fidelity text) is computed once, and each cell then
1. enters `snapquant.patched(model, config, backend=..., kernel_options=...)`,
2. runs lm-eval task by task (own limit / few-shot / metadata each) through snapquant's HFLM
   subclass with `log_samples=True`, keeping per-sample metrics for the paired tests,
3. runs the fidelity metrics (KL, top-1, perplexity delta; quantized prefill and step-by-step
   decode) against the cached reference,
and leaves the model unpatched again.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .grid import Cell
from .schema import SweepSpec, code_executing

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
SAMPLE_TEXT_CHARS = 200  # responses / targets kept per sample: enough to read, small enough to commit


# ---------------------------------------------------------------------- integration points (the patch API)
def default_patcher() -> Any:
    """`snapquant.patched(model, config, backend=...)`: a context manager that patches and unpatches."""
    try:
        from ..patching import patched
    except ImportError:
        raise ConfigError("sweeps need snapquant.patch.patched (model patching), which this install lacks") from None
    return patched


def default_lm_class() -> Any:
    """snapquant's lm-eval HFLM subclass (passes the quantized cache to generate)."""
    try:
        from .. import eval as sq_eval
    except ImportError:
        sq_eval = None
    for name in ("SnapquantLM", "SnapQuantLM", "SnapquantHFLM", "PatchedHFLM", "QuantizedHFLM"):
        cls = getattr(sq_eval, name, None) if sq_eval is not None else None
        if cls is not None:
            return cls
    from lm_eval.models.huggingface import HFLM

    return HFLM


# ---------------------------------------------------------------------- task catalogue
class TaskCatalog:
    """Task names lm-eval can run here: snapquant's (fast to index) and, only if needed, lm-eval's own."""

    def __init__(self, include_path: Sequence[str] = ()):
        self.include = [str(TASKS_DIR), *include_path] if TASKS_DIR.is_dir() else list(include_path)
        self._local = None
        self._full = None
        self._with_meta: dict[tuple, Any] = {}

    def local(self) -> Any:
        if self._local is None:
            from lm_eval.tasks import TaskManager

            self._local = TaskManager(include_path=self.include or None, include_defaults=False)
        return self._local

    def full(self) -> Any:
        if self._full is None:
            from lm_eval.tasks import TaskManager

            self._full = TaskManager(include_path=self.include or None)
        return self._full

    def manager_for(self, names: Sequence[str], metadata: dict[str, Any] | None = None) -> Any:
        """A TaskManager that knows `names`; with `metadata`, one that passes it to every task it loads
        (lm-eval ignores simple_evaluate's `metadata` when a task_manager is given)."""
        local = all(n in self.local().all_tasks for n in names)
        if not metadata:
            return self.local() if local else self.full()
        import json

        from lm_eval.tasks import TaskManager

        key = (local, json.dumps(metadata, sort_keys=True, default=str))
        if key not in self._with_meta:
            self._with_meta[key] = TaskManager(include_path=self.include or None, include_defaults=not local,
                                               metadata=metadata)
        return self._with_meta[key]

    def unsafe(self, name: str, tm: Any) -> bool:
        """Does running this task execute generated code? (lm-eval's `unsafe_code`, or a known family)."""
        if code_executing(name):
            return True
        entry = getattr(tm, "task_index", {}).get(name)
        cfg = getattr(entry, "cfg", None) if entry is not None else None
        if isinstance(cfg, dict) and cfg.get("unsafe_code"):
            return True
        path = getattr(entry, "yaml_path", None) if entry is not None else None
        try:
            return bool(path) and "unsafe_code: true" in Path(path).read_text()
        except OSError:
            return False

    def validate(self, spec: SweepSpec) -> list[str]:
        return self.check([t.name for t in spec.tasks], spec.allow_code_execution)

    def check(self, names: list[str], allow_code_execution: bool) -> list[str]:
        """Unknown task names (with the valid ones) and code-executing tasks without permission."""
        import difflib

        errs = []
        for n in names:  # known code-executing families: refuse without even indexing lm-eval's tasks
            if code_executing(n) and not allow_code_execution:
                errs.append(_refusal(n))
        names = [n for n in names if not code_executing(n) or allow_code_execution]
        if not names:
            return errs
        tm = self.manager_for(names)
        known = set(tm.all_tasks)
        for n in names:
            if n not in known:
                close = difflib.get_close_matches(n, sorted(known), n=3)
                hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
                local = sorted(self.local().all_tasks)
                errs.append(f"tasks: {n!r} is not a known task{hint}; snapquant tasks: {', '.join(local)}; "
                            f"plus {len(known) - len(local)} lm-eval tasks (`lm-eval ls tasks`)")
            elif self.unsafe(n, tm) and not allow_code_execution:
                errs.append(_refusal(n))
        return errs


def _refusal(name: str) -> str:
    return (f"tasks: {name!r} executes model-generated code to score it; refused unless the sweep sets "
            f"`allow_code_execution: true` (run such sweeps only in a sandbox)")


def check_tasks(names: list[str], allow_code_execution: bool, include_path: list[str]) -> list[str]:
    """A `SweepSpec` task checker backed by lm-eval's task index (see SweepSpec.from_dict)."""
    return TaskCatalog(include_path).check(names, allow_code_execution)


# ---------------------------------------------------------------------- the evaluator
class LmEvalEvaluator:
    """lm-eval + fidelity per cell on one model loaded once per worker. Injectable parts for tests."""

    def __init__(self, patcher: Any = None, lm_class: Any = None, model_loader: Any = None):
        self._patcher = patcher
        self._lm_class = lm_class
        self._loader = model_loader
        self.model = self.tokenizer = None
        self.catalog: TaskCatalog | None = None
        self.reference = None  # fidelity reference, computed once per worker
        self.info: dict[str, Any] = {}

    # -------------------------------------------------------------- before compute
    def check_tasks(self, names: list[str], allow_code_execution: bool, include_path: list[str]) -> list[str]:
        """Task-name problems, reported with the sweep file's other problems (SweepSpec.from_yaml)."""
        self.catalog = TaskCatalog(include_path)
        return self.catalog.check(names, allow_code_execution)

    def validate(self, spec: SweepSpec, cells: Sequence[Cell]) -> list[str]:
        errs: list[str] = []
        if self._patcher is None:
            try:
                default_patcher()
            except ConfigError as e:
                errs.append(str(e))
        if self.catalog is None or self.catalog.include != TaskCatalog(spec.include_path).include:
            self.catalog = TaskCatalog(spec.include_path)
        errs += self.catalog.validate(spec)
        dims = _model_dims(spec)
        if isinstance(dims, str):
            errs.append(dims)
        elif dims is not None:
            r, d = dims
            for c in cells:
                try:
                    c.config.check_dims(r, d)
                except ConfigError as e:
                    errs.append(f"cell {c.label!r}: {e} (model kv_lora_rank={r}, rope dim={d})")
        return errs

    # -------------------------------------------------------------- once per worker
    def setup(self, spec: SweepSpec) -> dict[str, Any]:
        from .model import load_model, model_info

        t0 = time.perf_counter()
        loader = self._loader or load_model
        self.model, self.tokenizer = loader(spec.model, dtype=spec.dtype, device=spec.device,
                                            device_map=spec.device_map, tokenizer=spec.tokenizer,
                                            model_kwargs=spec.model_kwargs)
        self.catalog = self.catalog or TaskCatalog(spec.include_path)
        self.info = {**model_info(self.model), "spec_model": spec.model, "load_s": time.perf_counter() - t0}
        if spec.fidelity.enabled:
            from ..fidelity import fidelity_reference, fidelity_tokens

            ids = fidelity_tokens(self.tokenizer, spec.fidelity.source, spec.fidelity.seq_len,
                                  spec.fidelity.num_sequences)
            self.reference = fidelity_reference(self.model, ids)
        return self.info

    # -------------------------------------------------------------- per cell
    def evaluate(self, cell: Cell, spec: SweepSpec, progress: Any) -> dict[str, Any]:
        patcher = self._patcher or default_patcher()
        if spec.kernel_options:  # every patch of this cell (tasks and fidelity) runs with the kernel options
            patcher = functools.partial(patcher, kernel_options=spec.kernel_options)
        timing: dict[str, float] = {}
        out: dict[str, Any] = {"tasks": {}, "samples": {}, "lm_eval": {}, "fidelity": None}
        with _patch(patcher, self.model, cell.config, spec.backend):
            lm = self._make_lm(spec, cell)
            for task in spec.tasks:
                t0 = time.perf_counter()
                res = self._run_task(lm, task, spec, progress)
                timing[f"task:{task.name}"] = time.perf_counter() - t0
                tasks, samples, raw = extract_results(res, task)
                out["tasks"].update(tasks)
                out["samples"].update(samples)
                out["lm_eval"][task.name] = raw
        if spec.fidelity.enabled and self.reference is not None:
            from ..fidelity import fidelity_metrics

            t0 = time.perf_counter()
            n_steps = (("prefill" in spec.fidelity.modes) +
                       ("decode" in spec.fidelity.modes) * (spec.fidelity.seq_len - spec.fidelity.prompt_len))
            progress.phase("fidelity (forward passes)", n_steps)
            out["fidelity"] = fidelity_metrics(self.model, self.reference, cell.config, modes=spec.fidelity.modes,
                                               prompt_len=spec.fidelity.prompt_len, backend=spec.backend,
                                               patcher=patcher, on_step=progress.advance)
            timing["fidelity"] = time.perf_counter() - t0
        out["timing"] = timing
        return out

    def _make_lm(self, spec: SweepSpec, cell: Cell) -> Any:
        import inspect

        cls = self._lm_class or default_lm_class()
        kw: dict[str, Any] = {"pretrained": self.model, "tokenizer": self.tokenizer, "batch_size": spec.batch_size}
        if spec.max_length:
            kw["max_length"] = spec.max_length
        params = inspect.signature(cls.__init__).parameters
        if "kv_config" in params:  # SnapquantLM: (re)patches to this config and gives generate a LatentCache
            kw["kv_config"] = cell.config
            if spec.backend is not None:
                kw["backend"] = spec.backend
            if spec.kernel_options and "kernel_options" in params:
                kw["kernel_options"] = spec.kernel_options
        return cls(**kw)

    def _run_task(self, lm: Any, task: Any, spec: SweepSpec, progress: Any) -> dict[str, Any]:
        import lm_eval

        metadata = dict(task.metadata or {})
        if spec.model != "embedded" and task.name in self.catalog.local().all_tasks:
            # snapquant's tasks measure context lengths with the tokenizer of the model under test
            metadata.setdefault("tokenizer", spec.tokenizer or spec.model)
        tm = self.catalog.manager_for([task.name], metadata)
        with _progress_wrapped(lm, progress, task.name, spec.batch_size), _code_eval_env(spec.allow_code_execution):
            res = lm_eval.simple_evaluate(
                model=lm, tasks=[task.name], task_manager=tm, limit=task.limit, num_fewshot=task.num_fewshot,
                log_samples=True, bootstrap_iters=spec.bootstrap_iters, gen_kwargs=task.gen_kwargs,
                random_seed=spec.seed, numpy_random_seed=spec.seed, torch_random_seed=spec.seed,
                fewshot_random_seed=spec.seed, confirm_run_unsafe_code=spec.allow_code_execution,
                verbosity="ERROR",
            )
        if res is None:  # non-zero rank in a distributed run
            raise RuntimeError("lm_eval.simple_evaluate returned no results (not rank 0?)")
        return res


# ---------------------------------------------------------------------- helpers
def _patch(patcher: Any, model: Any, cfg: Any, backend: str | None) -> AbstractContextManager:
    return patcher(model, cfg) if backend is None else patcher(model, cfg, backend=backend)


def _model_dims(spec: SweepSpec) -> tuple[int, int] | str | None:
    """(kv_lora_rank, qk_rope_head_dim) from the checkpoint's config.json, without loading weights."""
    import json

    if spec.model == "embedded":
        from ..embedded import EMBEDDED_PATH, has_weights

        if not has_weights(EMBEDDED_PATH):
            return (f"model: 'embedded': no weights in {EMBEDDED_PATH} yet (train them with "
                    f"scripts/train_embedded_model.py)")
        path = EMBEDDED_PATH
    else:
        path = Path(spec.model)
        if not (path / "config.json").is_file():
            return f"model={spec.model!r}: not 'embedded' and not a checkpoint directory with config.json"
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    r, d = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if not r or not d:
        return (f"model={spec.model!r} ({cfg.get('model_type')}): config.json has no kv_lora_rank / "
                f"qk_rope_head_dim; snapquant needs an MLA (DeepSeek-family) model")
    return int(r), int(d)


class _code_eval_env:
    """HF `evaluate`'s code_eval metric refuses to run unless HF_ALLOW_CODE_EVAL=1; set it only for sweeps
    that opted in with `allow_code_execution: true`, and only while their tasks run."""

    def __init__(self, allow: bool):
        self.allow = allow
        self.prev: str | None = None

    def __enter__(self):
        import os

        if self.allow:
            self.prev = os.environ.get("HF_ALLOW_CODE_EVAL")
            os.environ["HF_ALLOW_CODE_EVAL"] = "1"
        return self

    def __exit__(self, *exc):
        import os

        if self.allow:
            if self.prev is None:
                os.environ.pop("HF_ALLOW_CODE_EVAL", None)
            else:
                os.environ["HF_ALLOW_CODE_EVAL"] = self.prev
        return False


class _progress_wrapped:
    """Feed lm-eval's requests to the LM in chunks so the samples bar moves (results are unchanged:
    every request type returns one result per request, in order)."""

    METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")

    def __init__(self, lm: Any, progress: Any, task: str, batch_size: int):
        self.lm, self.progress, self.task = lm, progress, task
        self.chunk = max(4 * batch_size, 32)

    def __enter__(self):
        for name in self.METHODS:
            orig = getattr(self.lm, name)

            def wrapped(requests, *a, _orig=orig, _name=name, **k):
                k["disable_tqdm"] = True  # our bar replaces lm-eval's per-call tqdm
                self.progress.phase(f"{self.task} ({_name})", len(requests))
                out = []
                for i in range(0, len(requests), self.chunk):
                    part = requests[i:i + self.chunk]
                    out.extend(_orig(part, *a, **k))
                    self.progress.advance(len(part))
                return out

            setattr(self.lm, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name in self.METHODS:
            self.lm.__dict__.pop(name, None)
        return False


def _metric_key(metric: str, flt: str) -> str:
    return metric if flt == "none" else f"{metric},{flt}"


def extract_results(res: dict[str, Any], task_spec: Any) -> tuple[dict, dict, dict]:
    """lm-eval's results dict -> (tasks record, per-sample metrics, the raw lm-eval record to keep)."""
    from ..sweep.store import to_jsonable

    tasks: dict[str, Any] = {}
    samples: dict[str, list] = {}
    hib_all = res.get("higher_is_better", {})
    configs = res.get("configs", {})
    for task, vals in res.get("results", {}).items():
        metrics: dict[str, Any] = {}
        for key, v in vals.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, flt = key.split(",", 1)
            se = vals.get(f"{metric}_stderr,{flt}")
            metrics[_metric_key(metric, flt)] = {
                "value": v, "stderr": se if isinstance(se, (int, float)) else None,
                "higher_is_better": hib_all.get(task, {}).get(metric),
                "aggregation": _aggregation_name(configs.get(task, {}), metric),
            }
        if not metrics:
            continue  # a group header without scores of its own
        primary = task_spec.metric if task_spec.metric and task == task_spec.name else None
        if primary is not None and primary not in metrics:
            raise ConfigError(f"tasks: {task!r} has no metric {primary!r}; it reports {', '.join(metrics)}")
        n = res.get("n-samples", {}).get(task, {})
        tasks[task] = {"metrics": metrics, "primary_metric": primary or next(iter(metrics)),
                       "n_samples": n.get("effective") if isinstance(n, dict) else n,
                       "alias": vals.get("alias", task), "version": res.get("versions", {}).get(task)}
    for task, rows in (res.get("samples") or {}).items():
        out = []
        for s in rows:
            flt = s.get("filter", "none")
            mets = {_metric_key(m, flt): to_jsonable(s.get(m)) for m in s.get("metrics", [])}
            out.append({"doc_id": s.get("doc_id"), "doc_hash": s.get("doc_hash"),
                        "prompt_hash": s.get("prompt_hash"), "filter": flt, "metrics": mets,
                        "target": _short(s.get("target")), "response": _short(s.get("filtered_resps"))})
        samples[task] = _merge_filters(out)
    raw = {k: to_jsonable(res.get(k)) for k in ("results", "groups", "versions", "n-samples", "higher_is_better",
                                                 "date", "total_evaluation_time_seconds") if k in res}
    raw["configs"] = to_jsonable(configs)
    raw["config"] = {k: to_jsonable(v) for k, v in (res.get("config") or {}).items() if k != "model_args"}
    return tasks, samples, raw


def _merge_filters(rows: list[dict]) -> list[dict]:
    """One record per document: lm-eval logs a document once per filter."""
    by_doc: dict[Any, dict] = {}
    for r in rows:
        k = (r["doc_id"], r["doc_hash"])
        if k in by_doc:
            by_doc[k]["metrics"].update(r["metrics"])
        else:
            by_doc[k] = r
    return list(by_doc.values())


def _aggregation_name(task_cfg: dict, metric: str) -> str | None:
    for m in task_cfg.get("metric_list") or []:
        if isinstance(m, dict) and m.get("metric") == metric:
            agg = m.get("aggregation")
            if isinstance(agg, str):
                return agg
            if agg is not None:
                return getattr(agg, "__name__", str(agg))
    try:
        from lm_eval.api.registry import get_metric_aggregation

        fn = get_metric_aggregation(metric)
        return getattr(fn, "__name__", None) if fn else None
    except Exception:
        return None


def _short(x: Any) -> Any:
    if isinstance(x, str):
        return x[:SAMPLE_TEXT_CHARS]
    if isinstance(x, (list, tuple)):
        return [_short(v) for v in x[:8]]
    if isinstance(x, (int, float, bool)) or x is None:
        return x
    return str(x)[:SAMPLE_TEXT_CHARS]
