"""Running one lm-eval task on a patched model and turning lm-eval's results into result records.

    default_patcher()    `snapquant.patched`: the context manager that patches a model and unpatches it
    default_lm_class()   `SnapquantLM`, lm-eval's HFLM over the quantized latent cache
    run_task(...)        `lm_eval.simple_evaluate` for one task, seeded, with per-sample logs kept
    extract_results(...) lm-eval's results dict -> (scores, per-sample metrics, the raw record to keep)

`snapquant.sweep` drives these per cell; they know nothing of sweeps.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError
from ..results_io import to_jsonable

SAMPLE_TEXT_CHARS = 200  # responses / targets kept per sample: enough to read, small enough to commit


def default_patcher() -> Any:
    """`snapquant.patched(model, config, backend=...)`: a context manager that patches and unpatches."""
    from ..patching import patched

    return patched


def default_lm_class() -> Any:
    """snapquant's lm-eval HFLM subclass (passes the quantized cache to generate)."""
    from .lm import SnapquantLM

    return SnapquantLM


def run_task(lm: Any, task_manager: Any, name: str, *, limit: int | float | None = None,
             num_fewshot: int | None = None, gen_kwargs: Any = None, seed: int = 0, bootstrap_iters: int = 100000,
             allow_code_execution: bool = False, progress: Any = None, batch_size: int = 1) -> dict[str, Any]:
    """lm-eval's results for task `name` on `lm`, with `log_samples=True` (the paired tests need the samples).

    Every lm-eval seed is `seed`. `progress` (an object with `phase(description, total)` and
    `advance(n)`) sees the requests go by; HF `evaluate`'s code_eval metric runs only with
    `allow_code_execution`.
    """
    import lm_eval

    with _ProgressWrapped(lm, progress, name, batch_size), _CodeEvalEnv(allow_code_execution):
        res = lm_eval.simple_evaluate(
            model=lm, tasks=[name], task_manager=task_manager, limit=limit, num_fewshot=num_fewshot,
            log_samples=True, bootstrap_iters=bootstrap_iters, gen_kwargs=gen_kwargs,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, confirm_run_unsafe_code=allow_code_execution,
            verbosity="ERROR",
        )
    if res is None:  # non-zero rank in a distributed run
        raise RuntimeError("lm_eval.simple_evaluate returned no results (not rank 0?)")
    return res


class _CodeEvalEnv:
    """HF `evaluate`'s code_eval metric refuses to run unless HF_ALLOW_CODE_EVAL=1; set it only for runs
    that opted in (a sweep's `allow_code_execution: true`), and only while their tasks run."""

    def __init__(self, allow: bool):
        self.allow = allow
        self.prev: str | None = None

    def __enter__(self):
        if self.allow:
            self.prev = os.environ.get("HF_ALLOW_CODE_EVAL")
            os.environ["HF_ALLOW_CODE_EVAL"] = "1"
        return self

    def __exit__(self, *exc):
        if self.allow:
            if self.prev is None:
                os.environ.pop("HF_ALLOW_CODE_EVAL", None)
            else:
                os.environ["HF_ALLOW_CODE_EVAL"] = self.prev
        return False


class _ProgressWrapped:
    """Feed lm-eval's requests to the LM in chunks so the samples bar moves (results are unchanged:
    every request type returns one result per request, in order)."""

    METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")

    def __init__(self, lm: Any, progress: Any, task: str, batch_size: int):
        self.lm, self.progress, self.task = lm, progress, task
        self.chunk = max(4 * batch_size, 32)

    def __enter__(self):
        if self.progress is None:
            return self
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


def extract_results(res: dict[str, Any], task: str, metric: str | None = None) -> tuple[dict, dict, dict]:
    """lm-eval's results dict -> (tasks record, per-sample metrics, the raw lm-eval record to keep).

    `metric` names the primary metric of task `task` (default: the first one lm-eval reports).
    """
    tasks: dict[str, Any] = {}
    samples: dict[str, list] = {}
    hib_all = res.get("higher_is_better", {})
    configs = res.get("configs", {})
    for name, vals in res.get("results", {}).items():
        metrics: dict[str, Any] = {}
        for key, v in vals.items():
            if "," not in key or "_stderr," in key:
                continue
            m, flt = key.split(",", 1)
            se = vals.get(f"{m}_stderr,{flt}")
            metrics[_metric_key(m, flt)] = {
                "value": v, "stderr": se if isinstance(se, (int, float)) else None,
                "higher_is_better": hib_all.get(name, {}).get(m),
                "aggregation": _aggregation_name(configs.get(name, {}), m),
            }
        if not metrics:
            continue  # a group header without scores of its own
        primary = metric if metric and name == task else None
        if primary is not None and primary not in metrics:
            raise ConfigError(f"tasks: {name!r} has no metric {primary!r}; it reports {', '.join(metrics)}")
        n = res.get("n-samples", {}).get(name, {})
        tasks[name] = {"metrics": metrics, "primary_metric": primary or next(iter(metrics)),
                       "n_samples": n.get("effective") if isinstance(n, dict) else n,
                       "alias": vals.get("alias", name), "version": res.get("versions", {}).get(name)}
    for name, rows in (res.get("samples") or {}).items():
        out = []
        for s in rows:
            flt = s.get("filter", "none")
            mets = {_metric_key(m, flt): to_jsonable(s.get(m)) for m in s.get("metrics", [])}
            out.append({"doc_id": s.get("doc_id"), "doc_hash": s.get("doc_hash"),
                        "prompt_hash": s.get("prompt_hash"), "filter": flt, "metrics": mets,
                        "target": _short(s.get("target")), "response": _short(s.get("filtered_resps"))})
        samples[name] = _merge_filters(out)
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
