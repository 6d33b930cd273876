"""snapquant's import graph, read from the sources (no module is imported): the one walker every
layering test (and `scripts/print_tree.py`) uses.

An edge is every `import` / `from ... import` of a snapquant module anywhere in a file: module level,
inside functions, methods and `try` blocks, relative and absolute; each edge is flagged `relative`
and `lazy` (inside a function: it runs on first call, not at import). Imports under
`if TYPE_CHECKING:` are not edges (they never run; the `else:` branch does). A lazy import counts: it
hides a cycle from Python's partial-initialization error but not from the design (the two modules
still cannot be understood, tested or moved one without the other). Dynamic imports
(`importlib.import_module`, the backend registry's "module:attr" entries) are not edges.

`from pkg import name` is an edge to the submodule `pkg.name` when there is one, else to `pkg`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "snapquant"


@dataclass(frozen=True)
class Edge:
    """One import statement's reference from `source` to the snapquant module `target`."""

    source: str
    target: str
    names: tuple[str, ...]  # what `from ... import` takes from the target (empty for `import x`)
    line: int
    relative: bool  # `from .x import y`
    lazy: bool  # inside a function or method body


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


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(node, lazy) for every Import / ImportFrom in `tree`, skipping `if TYPE_CHECKING:` bodies."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, lazy = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((n, lazy) for n in node.orelse)
            continue
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((n, inner) for n in ast.iter_child_nodes(node))


def owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of `modules` that defines dotted `name` (a module, or an attribute of one)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def edges_of(module: str, modules: dict[str, Path]) -> list[Edge]:
    """The import edges of `module` to other modules of `modules`, in source order."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[Edge] = []
    for node, lazy in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            hits = [(owner(a.name, modules), ()) for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            hits = []
            for a in node.names:
                sub = f"{base}.{a.name}"
                hits.append((sub, ()) if sub in modules else (owner(base, modules), (a.name,)))
        by_target: dict[str, tuple[str, ...]] = {}
        for target, names in hits:
            if target is not None and target != module:
                by_target[target] = by_target.get(target, ()) + names
        out += [Edge(module, t, names, node.lineno, bool(getattr(node, "level", 0)), lazy)
                for t, names in by_target.items()]
    return sorted(out, key=lambda e: (e.line, e.target))


def import_edges(root: Path = PACKAGE) -> list[Edge]:
    modules = module_files(root)
    return [e for m in modules for e in edges_of(m, modules)]


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the snapquant modules it imports (every module of `root` is a key)."""
    graph: dict[str, set[str]] = {m: set() for m in module_files(root)}
    for e in import_edges(root):
        graph[e.source].add(e.target)
    return graph


def within(module: str, prefixes: tuple[str, ...] | str) -> bool:
    """`module` is one of `prefixes` or inside one of them (a package prefix, not a string prefix)."""
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(module == p or module.startswith(p + ".") for p in prefixes)


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


def cycle_path(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One closed import path through the cycle `comp`, for a message (a -> b -> ... -> a)."""
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


def cycle_report(graph: dict[str, set[str]]) -> str:
    """'no cycle', or one line per cycle with an example path (what print_tree.py and the tests print)."""
    found = cycles(graph)
    if not found:
        return "no cycle"
    return "\n".join(f"cycle of {len(c)} modules: {cycle_path(graph, c)}" for c in found)


def private_imports(root: Path = PACKAGE) -> list[str]:
    """`module:line imports _name from target` for every private name one module imports from another."""
    return [f"{e.source}:{e.line} imports {n} from {e.target}" for e in import_edges(root)
            for n in e.names if n.startswith("_") and not n.startswith("__")]


def _defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes, assigned names and attributes, arguments."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


def private_attribute_uses(root: Path = PACKAGE) -> list[str]:
    """`module:line reads obj._name` where `_name` is private to another snapquant module: defined there,
    not in the reading module (private names of third-party objects, e.g. torch's aten._to_copy, are
    defined in no snapquant module and not reported)."""
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in module_files(root).items()}
    defined = {m: _defined_names(t) for m, t in trees.items()}
    private_elsewhere: dict[str, set[str]] = {}
    for m, names in defined.items():
        for n in names:
            if n.startswith("_") and not n.startswith("__"):
                private_elsewhere.setdefault(n, set()).add(m)
    out = []
    for m, tree in trees.items():
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.attr in private_elsewhere
                    and n.attr not in defined[m]):
                out.append(f"{m}:{n.lineno} reads {ast.unparse(n)} ({n.attr} is private to "
                           f"{', '.join(sorted(private_elsewhere[n.attr]))})")
    return sorted(out)
