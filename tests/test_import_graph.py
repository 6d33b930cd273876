"""snapquant's import graph has no cycle, and the kernels import nothing from the layers above them.

The graph is read from the source (no module is imported): every `import` / `from ... import` of a
snapquant module anywhere in a file (module level, inside functions, methods and `try` blocks;
relative and absolute), except those under `if TYPE_CHECKING:`, which never run. A function-level
import counts: it hides a cycle from Python's partial-initialization error but not from the design
(the two modules still cannot be understood, tested or moved one without the other). Dynamic
imports (`importlib.import_module`, the backend registry's "module:attr" entries) are not edges:
they run on first use, after both modules are loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "snapquant"

# Layers above the kernels: the kernels are called by them and must not import them back.
ABOVE_KERNELS = ("snapquant.attention", "snapquant.cache", "snapquant.patching", "snapquant.graphs")



def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (packages by their __init__)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom in `tree`, skipping the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The snapquant module that defines dotted `name` (a module, or an attribute of one)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """The snapquant modules `module` imports (see the module docstring for what counts)."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: list[str] = []
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
            continue
        base = node.module or ""
        if node.level:
            up = package.split(".")
            up = up[: len(up) - (node.level - 1)]
            base = ".".join(up + ([base] if base else []))
        # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
        targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = {_owner(t, modules) for t in targets}
    return {m for m in found if m is not None and m != module}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root)
    return {m: imports_of(m, modules) for m in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _path_in(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One closed import path through the cycle `comp`, for the failure message (a -> b -> ... -> a)."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first from start back to start, inside the component
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [start]
                    while v != start:
                        path.append(v)
                        v = prev[v]
                    return " -> ".join([start, *reversed(path[1:]), start])
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return ", ".join(comp)


def kernel_seam_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(kernels module, module above the kernels) pairs the kernels import."""
    return {(m, t) for m, ts in graph.items() if m == "snapquant.kernels" or m.startswith("snapquant.kernels.")
            for t in ts if any(t == a or t.startswith(a + ".") for a in ABOVE_KERNELS)}


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
    assert _path_in(g, ["snapquant.c", "snapquant.sub.b"]) == "snapquant.c -> snapquant.sub.b -> snapquant.c"


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
        f"  {len(c)} modules {c}, e.g. {_path_in(graph, c)}" for c in new)


def test_kernels_import_nothing_from_the_layers_above_them(graph):
    bad = sorted(kernel_seam_imports(graph))
    assert not bad, "snapquant/kernels/ imports from the layers above it:\n" + "\n".join(
        f"  {m} imports {t}" for m, t in bad)


def test_the_runtime_guards_are_a_leaf(graph):
    """snapquant.runtime is what the kernels, the seam, the cache and the graph step share: it imports none."""
    assert graph["snapquant.runtime"] <= {"snapquant.errors"}
