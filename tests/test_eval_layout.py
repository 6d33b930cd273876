"""Evaluation lives in snapquant.eval (its offline tasks included), where lm-eval finds it.

The layering (sweep -> eval -> analysis -> results_io, one way) is checked with the rest of the import
graph in tests/test_import_graph.py."""

from __future__ import annotations

from pathlib import Path

import snapquant

PKG = Path(snapquant.__file__).parent


def test_lm_eval_finds_the_offline_tasks_where_they_live():
    from snapquant.eval.tasks import SQ_GROUPS, SQ_TASKS, TASK_DIR

    assert TASK_DIR == PKG / "eval" / "tasks"
    names = {p.stem for p in TASK_DIR.glob("sq_*.yaml")}
    assert set(SQ_TASKS) | set(SQ_GROUPS) <= names
    assert not (PKG / "tasks").exists() and not (PKG / "fidelity.py").exists()
