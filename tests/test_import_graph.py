"""snapquant's import graph has no cycle, the kernels import nothing from the layers above them, and no
module reaches into another's private names.

The graph is read from the sources by `tests.support.import_graph` (what counts as an edge is said
there: function-level imports count, `if TYPE_CHECKING:` imports do not).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.import_graph import (
    cycle_path,
    cycle_report,
    cycles,
    edges_of,
    import_graph,
    module_files,
    private_attribute_uses,
    private_imports,
    within,
)

# Layers above the kernels: the kernels are called by them (the benchmark times them) and must not import
# them back.
ABOVE_KERNELS = ("snapquant.attention", "snapquant.cache", "snapquant.patching", "snapquant.graphs",
                 "snapquant.bench")
TESTS = Path(__file__).resolve().parent


def kernel_seam_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(kernels module, module above the kernels) pairs the kernels import."""
    return {(m, t) for m, ts in graph.items() if within(m, "snapquant.kernels") for t in ts if within(t, ABOVE_KERNELS)}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


# ---------------------------------------------------------------------------------------------- the walker
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "snapquant"


def test_walker_sees_function_level_relative_and_absolute_imports_but_not_type_checking(tmp_path):
    pkg = _write(tmp_path, {
        "snapquant/__init__.py": "",
        "snapquant/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
                          "def f():\n    from .sub import b\n",
        "snapquant/sub/__init__.py": "",
        "snapquant/sub/b.py": "class K:\n    def m(self):\n        import snapquant.c\n",
        "snapquant/c.py": "try:\n    from .sub.b import K\nexcept ImportError:\n    pass\nfrom .. import os\n",
        "snapquant/d.py": "import typing\nif typing.TYPE_CHECKING:\n    from .a import x\nelse:\n    from .c import y\n",
    })
    g = import_graph(pkg)
    assert g["snapquant.a"] == {"snapquant.sub.b"}  # the TYPE_CHECKING import of c is not an edge
    assert g["snapquant.sub.b"] == {"snapquant.c"}
    assert g["snapquant.c"] == {"snapquant.sub.b"}
    assert g["snapquant.d"] == {"snapquant.c"}  # the else branch runs
    assert cycles(g) == [["snapquant.c", "snapquant.sub.b"]]
    assert cycle_path(g, ["snapquant.c", "snapquant.sub.b"]) == "snapquant.c -> snapquant.sub.b -> snapquant.c"
    assert cycle_report(g) == "cycle of 2 modules: snapquant.c -> snapquant.sub.b -> snapquant.c"
    modules = module_files(pkg)
    [a_edge] = edges_of("snapquant.a", modules)
    assert (a_edge.target, a_edge.lazy, a_edge.relative) == ("snapquant.sub.b", True, True)
    [b_edge] = edges_of("snapquant.sub.b", modules)
    assert (b_edge.lazy, b_edge.relative, b_edge.names) == (True, False, ())
    c_edge = edges_of("snapquant.c", modules)[0]
    assert (c_edge.target, c_edge.lazy, c_edge.relative, c_edge.names) == ("snapquant.sub.b", False, True, ("K",))


def test_walker_reports_private_names_taken_from_another_module(tmp_path):
    pkg = _write(tmp_path, {
        "snapquant/__init__.py": "",
        "snapquant/a.py": "def _helper():\n    pass\nclass L:\n    def _room(self):\n        self._n = 1\n",
        "snapquant/b.py": "from .a import _helper, L\ndef f(layer: L):\n    layer._room()\n    return layer._n\n",
        "snapquant/c.py": "import torch\ndef g(x):\n    return torch.ops.aten._to_copy(x)\n",
    })
    assert private_imports(pkg) == ["snapquant.b:1 imports _helper from snapquant.a"]
    assert [u.split(" (")[0] for u in private_attribute_uses(pkg)] == [
        "snapquant.b:3 reads layer._room", "snapquant.b:4 reads layer._n"]


def test_walker_finds_a_long_cycle_and_the_kernels_importing_upward(tmp_path):
    pkg = _write(tmp_path, {
        "snapquant/__init__.py": "",
        "snapquant/x.py": "from .y import f\n",
        "snapquant/y.py": "def f():\n    from snapquant.z import g\n",
        "snapquant/z.py": "from . import x\n",
        "snapquant/kernels/__init__.py": "from .k import run\n",
        "snapquant/kernels/k.py": "from ..cache import C\nfrom ..config import D\n",
        "snapquant/cache.py": "", "snapquant/config.py": "",
    })
    g = import_graph(pkg)
    assert cycles(g) == [["snapquant.x", "snapquant.y", "snapquant.z"]]
    assert kernel_seam_imports(g) == {("snapquant.kernels.k", "snapquant.cache")}


# ---------------------------------------------------------------------------------------------- snapquant
def test_no_import_cycle(graph):
    new = cycles(graph)
    assert not new, "import cycles in snapquant/:\n" + "\n".join(
        f"  {len(c)} modules {c}, e.g. {cycle_path(graph, c)}" for c in new)


def test_kernels_import_nothing_from_the_layers_above_them(graph):
    bad = sorted(kernel_seam_imports(graph))
    assert not bad, "snapquant/kernels/ imports from the layers above it:\n" + "\n".join(
        f"  {m} imports {t}" for m, t in bad)


def test_the_walk_sees_real_edges(graph):
    assert "snapquant.kernels.triton.append" in graph["snapquant.kernels.paged"]
    assert {"snapquant.cache", "snapquant.patching", "snapquant.runtime"} <= graph["snapquant.graphs"]


def test_the_runtime_guards_are_a_leaf(graph):
    """snapquant.runtime is what the kernels, the seam, the cache and the graph step share: it imports none."""
    assert graph["snapquant.runtime"] <= {"snapquant.errors"}


def test_no_module_takes_another_modules_private_names():
    """A name shared between modules is their API: it is public. Private names stay in their module (the
    walker's own check above shows this can fail)."""
    assert private_imports() == []
    assert private_attribute_uses() == []


def test_the_layering_of_evaluation_sweeps_and_analysis(graph):
    """sweep -> eval -> analysis -> results_io only go one way: analysis reads results through results_io and
    imports nothing from sweep or eval, eval nothing from sweep, and the results layer none of the three."""
    bad = [f"{m} imports {i}" for m, deps in graph.items() for i in deps
           if (within(m, "snapquant.analysis") and within(i, ("snapquant.sweep", "snapquant.eval")))
           or (within(m, "snapquant.eval") and within(i, "snapquant.sweep"))
           or (m in ("snapquant.results_io", "snapquant.environment")
               and within(i, ("snapquant.sweep", "snapquant.eval", "snapquant.analysis")))]
    assert bad == []
    assert "snapquant.results_io" in graph["snapquant.analysis.results"]  # the walk sees real edges


def test_kernel_tests_do_not_depend_on_the_benchmark():
    """The kernel tests spell their shapes and knobs themselves (tests/support/kernel_cases.py): a benchmark
    change must not change what they check."""
    import ast

    bad = []
    for f in [*sorted(TESTS.glob("test_kernels_*.py")), TESTS / "support" / "kernel_cases.py"]:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.name}:{node.lineno} imports {n}" for n in names if within(n, "snapquant.bench")]
    assert not bad, bad
