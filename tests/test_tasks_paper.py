"""configs/paper names resolve in lm-eval's registry; snapquant's tasks resolve through task_manager()."""

from pathlib import Path

import yaml

from snapquant.eval.tasks import SQ_GROUPS, SQ_TASKS, task_manager

PAPER = Path(__file__).resolve().parents[1] / "configs" / "paper" / "benchmarks.yaml"


def test_paper_benchmarks_resolve_offline():
    from lm_eval.tasks import TaskManager

    cfg = yaml.safe_load(PAPER.read_text())
    names = cfg["reasoning"] + cfg["code"]
    assert {"gsm8k", "minerva_math500", "humaneval", "mbpp"} <= set(names)
    known = set(TaskManager().all_tasks)
    assert [n for n in names if n not in known] == []


def test_snapquant_tasks_are_registered():
    tm = task_manager(include_defaults=False)
    known = set(tm.all_tasks)
    assert set(SQ_TASKS) <= known and set(SQ_GROUPS) <= known
