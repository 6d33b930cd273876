"""Which lm-eval task names can run here: snapquant's offline tasks (fast to index) and lm-eval's own.

`TaskCatalog` holds lm-eval `TaskManager`s over snapquant's task folder (`snapquant.eval.tasks`) plus
any extra `include_path`; lm-eval's ~15K built-in task files are indexed only when a name needs them.
`check_tasks` reports unknown names (with the close ones) and code-executing tasks that were not
allowed, in words, before anything loads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .tasks import TASK_DIR

# Tasks whose scoring runs model-generated code. They are refused unless the caller allows code
# execution (a sweep's `allow_code_execution: true`); lm-eval marks them `unsafe_code`, and these
# names catch forks of them.
CODE_EXEC_PATTERNS = (r"^humaneval", r"^mbpp", r"^ds1000", r"^cruxeval", r"^pseudo_to_code", r"^apps")


def code_executing(task_name: str) -> bool:
    """True when a task name matches a known code-executing benchmark family."""
    return any(re.search(p, task_name) for p in CODE_EXEC_PATTERNS)


class TaskCatalog:
    """Task names lm-eval can run here: snapquant's (fast to index) and, only if needed, lm-eval's own."""

    def __init__(self, include_path: Sequence[str] = ()):
        self.include = [str(TASK_DIR), *include_path] if TASK_DIR.is_dir() else list(include_path)
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
