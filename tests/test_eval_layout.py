"""Evaluation lives in snapquant.eval, sweeps drive it, analyses read results through snapquant.results_io.

Read from the sources (a lazy import inside a function counts too): analysis imports nothing from
sweep or eval, and eval nothing from sweep, so sweep -> eval -> analysis -> results_io only go one way."""

from __future__ import annotations

import ast
from pathlib import Path

import snapquant

PKG = Path(snapquant.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` imports module x
        graph[name] = {m for m in out if m in modules and m != name}
    return graph


def test_analysis_reads_results_through_results_io_and_eval_does_not_import_sweep():
    graph = _graph()
    bad = [f"{m} imports {i}" for m, deps in graph.items() for i in deps
           if (m.startswith("snapquant.analysis") and i.startswith(("snapquant.sweep", "snapquant.eval")))
           or (m.startswith("snapquant.eval") and i.startswith("snapquant.sweep"))
           or (m in ("snapquant.results_io", "snapquant.environment")
               and i.startswith(("snapquant.sweep", "snapquant.eval", "snapquant.analysis")))]
    assert bad == []
    assert "snapquant.results_io" in graph["snapquant.analysis.results"]  # the walk sees real edges


def test_lm_eval_finds_the_offline_tasks_where_they_live():
    from snapquant.eval.tasks import SQ_GROUPS, SQ_TASKS, TASK_DIR

    assert TASK_DIR == PKG / "eval" / "tasks"
    names = {p.stem for p in TASK_DIR.glob("sq_*.yaml")}
    assert set(SQ_TASKS) | set(SQ_GROUPS) <= names
    assert not (PKG / "tasks").exists() and not (PKG / "fidelity.py").exists()
