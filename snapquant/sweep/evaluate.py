"""The default cell evaluator: patch the model with the cell's KV config, run lm-eval and fidelity.

Per worker: the model is loaded once (`setup`), the fidelity reference (the unpatched model's
next-token distributions on the fidelity text) is computed once, and each cell then
1. enters `snapquant.patched(model, config, backend=..., kernel_options=...)`,
2. runs lm-eval task by task (own limit / few-shot / metadata each) through snapquant's HFLM
   subclass with `log_samples=True`, keeping per-sample metrics for the paired tests,
3. runs the fidelity metrics (KL, top-1, perplexity delta; quantized prefill and step-by-step
   decode) against the cached reference: the summary with intervals and the per-sequence sums go
   into the cell JSON, the per-position KL and top-1 tokens (and the scored token ids) into the
   cell's arrays file, for paired comparisons and the tail listing,
and leaves the model unpatched again. The evaluation itself lives in `snapquant.eval` (model
loading, task catalogue, lm-eval runs, fidelity); this module maps a sweep's spec and cells onto it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..errors import ConfigError
from ..eval.catalog import TaskCatalog
from ..eval.harness import default_lm_class, default_patcher, extract_results, run_task
from ..eval.model import checkpoint_mla_dims
from .grid import Cell
from .schema import SweepSpec


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
        self.fidelity_text: dict[str, Any] | None = None  # where the fidelity rows came from, in every cell
        self._sample: tuple[tuple, Any] | None = None  # (its arguments, TextSample) drawn by validate
        self.info: dict[str, Any] = {}

    # -------------------------------------------------------------- before compute
    def check_tasks(self, names: list[str], allow_code_execution: bool, include_path: list[str]) -> list[str]:
        """Task-name problems, reported with the sweep file's other problems (SweepSpec.from_yaml)."""
        self.catalog = TaskCatalog(include_path)
        return self.catalog.check(names, allow_code_execution)

    def validate(self, spec: SweepSpec, cells: Sequence[Cell]) -> list[str]:
        errs: list[str] = []
        if self.catalog is None or self.catalog.include != TaskCatalog(spec.include_path).include:
            self.catalog = TaskCatalog(spec.include_path)
        errs += self.catalog.check([t.name for t in spec.tasks], spec.allow_code_execution)
        try:
            r, d = checkpoint_mla_dims(spec.model)
        except ConfigError as e:
            errs.append(str(e))
        else:
            for c in cells:
                try:
                    c.config.check_dims(r, d)
                except ConfigError as e:
                    errs.append(f"cell {c.label!r}: {e} (model kv_lora_rank={r}, rope dim={d})")
            if spec.fidelity.enabled:  # a source too short for the rows fails here, before the model loads
                try:
                    self._fidelity_sample(spec, None)
                except ConfigError as e:
                    errs.append(f"fidelity: {e}")
        return errs

    def _fidelity_sample(self, spec: SweepSpec, tokenizer: Any) -> Any:
        """The fidelity rows of `spec` (tokenizer None: load it alone); drawn once per worker."""
        from ..eval.fidelity import fidelity_sample

        f = spec.fidelity
        key = (spec.model, spec.tokenizer, f.source, f.seq_len, f.num_sequences, f.seed)
        if self._sample is None or self._sample[0] != key:
            if tokenizer is None:
                from ..eval.model import load_tokenizer

                tokenizer = load_tokenizer(spec.model, spec.tokenizer)
            self._sample = (key, fidelity_sample(tokenizer, f.source, f.seq_len, f.num_sequences, seed=f.seed))
        return self._sample[1]

    # -------------------------------------------------------------- once per worker
    def setup(self, spec: SweepSpec) -> dict[str, Any]:
        from ..eval.model import load_model, model_info

        t0 = time.perf_counter()
        loader = self._loader or load_model
        self.model, self.tokenizer = loader(spec.model, dtype=spec.dtype, device=spec.device,
                                            device_map=spec.device_map, tokenizer=spec.tokenizer,
                                            model_kwargs=spec.model_kwargs)
        self.catalog = self.catalog or TaskCatalog(spec.include_path)
        self.info = {**model_info(self.model), "spec_model": spec.model, "load_s": time.perf_counter() - t0}
        if spec.fidelity.enabled:
            from ..eval.fidelity import fidelity_reference

            if self._loader is not None:  # an injected loader's tokenizer may not be the one validate loaded
                self._sample = None
            sample = self._fidelity_sample(spec, self.tokenizer)
            self.fidelity_text = sample.describe()
            self.reference = fidelity_reference(self.model, sample.input_ids)
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
                tasks, samples, raw = extract_results(res, task.name, task.metric)
                out["tasks"].update(tasks)
                out["samples"].update(samples)
                out["lm_eval"][task.name] = raw
        if spec.fidelity.enabled and self.reference is not None:
            from ..eval.fidelity import fidelity_metrics

            t0 = time.perf_counter()
            n_steps = (("prefill" in spec.fidelity.modes) +
                       ("decode" in spec.fidelity.modes) * (spec.fidelity.seq_len - spec.fidelity.prompt_len))
            progress.phase("fidelity (forward passes)", n_steps)
            fid = fidelity_metrics(self.model, self.reference, cell.config, modes=spec.fidelity.modes,
                                   prompt_len=spec.fidelity.prompt_len, backend=spec.backend,
                                   patcher=patcher, on_step=progress.advance, keep_positions=True, seed=spec.seed)
            out["fidelity"], out["arrays"] = fidelity_arrays(fid, self.reference.input_ids)
            if self.fidelity_text is not None:  # where each sequence came from (file, token offset, line)
                out["fidelity"]["text"] = self.fidelity_text
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
            if spec.loglikelihood != "forward" and "loglikelihood" in params:
                kw["loglikelihood"] = spec.loglikelihood
        return cls(**kw)

    def _run_task(self, lm: Any, task: Any, spec: SweepSpec, progress: Any) -> dict[str, Any]:
        metadata = dict(task.metadata or {})
        if spec.model != "embedded" and task.name in self.catalog.local().all_tasks:
            # snapquant's tasks measure context lengths with the tokenizer of the model under test
            metadata.setdefault("tokenizer", spec.tokenizer or spec.model)
        tm = self.catalog.manager_for([task.name], metadata)
        return run_task(lm, tm, task.name, limit=task.limit, num_fewshot=task.num_fewshot, gen_kwargs=task.gen_kwargs,
                        seed=spec.seed, bootstrap_iters=spec.bootstrap_iters,
                        allow_code_execution=spec.allow_code_execution, progress=progress,
                        batch_size=spec.batch_size)


# ---------------------------------------------------------------------- helpers
def fidelity_arrays(fid: dict[str, Any], input_ids: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`fidelity_metrics(..., keep_positions=True)` -> (the JSON part, the arrays file's part).

    Arrays: "input_ids" [N, T] (the scored tokens) and per mode "<mode>_kl" (float64),
    "<mode>_ref_top1" / "<mode>_quant_top1" (int32 token ids), each [N, positions]; the flips are
    ref_top1 != quant_top1.
    """
    import numpy as np

    arrays: dict[str, Any] = {"input_ids": np.asarray(input_ids, dtype=np.int32)}
    out = dict(fid)
    for mode in ("prefill", "decode"):
        if isinstance(out.get(mode), dict) and "positions" in out[mode]:
            res = dict(out[mode])
            pos = res.pop("positions")
            arrays[f"{mode}_kl"] = np.asarray(pos["kl"], dtype=np.float64)
            for k in ("ref_top1", "quant_top1"):
                arrays[f"{mode}_{k}"] = np.asarray(pos[k], dtype=np.int32)
            out[mode] = res
    return out, arrays


def _patch(patcher: Any, model: Any, cfg: Any, backend: str | None) -> AbstractContextManager:
    return patcher(model, cfg) if backend is None else patcher(model, cfg, backend=backend)
