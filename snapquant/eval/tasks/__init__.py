"""snapquant's offline lm-eval task suite (YAMLs + `sq_utils.py` in this folder).

Tasks: sq_code_ppl, sq_code_completion, sq_code_completion_mc (its multiple-choice variant),
sq_kv_retrieval_{1k,2k,4k,8k,16k,32k} (groups sq_kv_retrieval, sq_kv_retrieval_long), sq_passkey,
sq_passkey_code, the RULER offline subset sq_niah_single_1, sq_niah_multikey_2, sq_niah_multikey_3,
sq_ruler_cwe, sq_ruler_fwe (group sq_ruler), and the group sq_offline. All documents are generated at run time from seeds or from the
held-out files shipped in `data/`; lengths are measured with the tokenizer given in the metadata
(default: the embedded model's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).resolve().parent

SQ_TASKS = (
    "sq_code_ppl", "sq_code_completion", "sq_code_completion_mc", "sq_kv_retrieval_1k", "sq_kv_retrieval_2k",
    "sq_kv_retrieval_4k", "sq_kv_retrieval_8k", "sq_kv_retrieval_16k", "sq_kv_retrieval_32k", "sq_passkey",
    "sq_passkey_code",
    "sq_niah_single_1", "sq_niah_multikey_2", "sq_niah_multikey_3", "sq_ruler_cwe", "sq_ruler_fwe",
)
SQ_GROUPS = ("sq_kv_retrieval", "sq_kv_retrieval_long", "sq_ruler", "sq_offline")


def task_manager(tokenizer: str | None = None, include_defaults: bool = True, **metadata: Any):
    """An lm-eval `TaskManager` that knows snapquant's tasks (and, by default, all of lm-eval's).

    `tokenizer` (a local path or a cached hub name) sizes the synthetic contexts; other keyword
    arguments go to every task's metadata, e.g. `num_samples=20`, `sq_seed=7`,
    `max_seq_lengths=[1024, 2048]` (pass-key and RULER tasks). `include_defaults=False` skips
    indexing lm-eval's ~15K built-in task files (seconds faster); snapquant's tasks need none of them.
    """
    from lm_eval.tasks import TaskManager

    if tokenizer is not None:
        metadata["tokenizer"] = str(tokenizer)
    return TaskManager(include_path=str(TASK_DIR), include_defaults=include_defaults, metadata=metadata or None)


__all__ = ["SQ_GROUPS", "SQ_TASKS", "TASK_DIR", "task_manager"]
