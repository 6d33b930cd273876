"""snapquant.kernels stands below the patch seam: it imports nothing from the attention seam, the cache,
patching or graphs, and its own modules import each other without a cycle (read from the sources, so a
lazy import inside a function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

import snapquant.kernels

KERNELS_DIR = Path(snapquant.kernels.__file__).parent
FORBIDDEN = ("snapquant.attention", "snapquant.cache", "snapquant.patching", "snapquant.graphs")


def _module_name(path: Path) -> str:
    rel = path.relative_to(KERNELS_DIR.parent.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the snapquant modules `path` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("snapquant"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("snapquant"):
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` imports module x
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the kernel modules it imports."""
    modules = {_module_name(p): p for p in KERNELS_DIR.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def test_kernels_import_nothing_from_the_seam_cache_patching_or_graphs():
    bad = []
    for path in KERNELS_DIR.rglob("*.py"):
        for mod in _imports(path):
            if mod.startswith(FORBIDDEN):
                bad.append(f"{_module_name(path)} imports {mod}")
    assert not bad, bad


def test_kernel_modules_import_each_other_without_a_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(n):], n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "snapquant.kernels.triton.append" in graph["snapquant.kernels.paged"]  # the walk sees real edges
