"""Evaluation of a model through a quantized latent cache: lm-eval, offline tasks, fidelity, model loading.

    lm.py        `SnapquantLM`: lm-eval's HFLM over a patched model (registers model type `snapquant`)
    tasks/       snapquant's offline lm-eval task suite (YAMLs, document builders, scorers, held-out
                 code); `task_manager()` gives lm-eval a TaskManager that finds them
    catalog.py   `TaskCatalog`, `check_tasks`: which task names can run, code-executing tasks refused
    harness.py   `run_task`, `extract_results`: one lm-eval task on a patched model -> result records
    fidelity.py  next-token KL, top-1 agreement and perplexity vs the unpatched model
    model.py     `load_model`: `embedded` or a checkpoint directory; `model_info`, `checkpoint_mla_dims`

`snapquant.sweep` drives these over a grid of configs. Names here are imported on first use: lm-eval
(and through it torch / transformers) is heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SnapquantLM": "lm",
    "task_manager": "tasks", "SQ_TASKS": "tasks", "SQ_GROUPS": "tasks", "TASK_DIR": "tasks",
    "TaskCatalog": "catalog", "check_tasks": "catalog",
    "run_task": "harness", "extract_results": "harness",
    "FidelityReference": "fidelity", "compare_logprobs": "fidelity", "fidelity_metrics": "fidelity",
    "fidelity_reference": "fidelity", "fidelity_table": "fidelity", "fidelity_tokens": "fidelity",
    "fidelity_sample": "fidelity",
    "load_model": "model", "model_info": "model", "checkpoint_mla_dims": "model",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
