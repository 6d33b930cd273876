"""Print snapquant's package tree, one line per module with its docstring's first sentence, and the import
graph check ("no cycle", or each cycle); `--write` puts the same text into docs/architecture.md.

    python scripts/print_tree.py            # print the tree
    python scripts/print_tree.py --write    # regenerate the tree in docs/architecture.md
    python scripts/print_tree.py --check    # exit 1 when docs/architecture.md's tree is out of date

The tree in docs/architecture.md sits between the BEGIN / END markers below and is only ever written by
this script (tests/test_architecture_tree.py checks it is current). The import graph is the one the
layering tests read (tests/support/import_graph.py: every import of a snapquant module, lazy ones too).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the import-graph helper lives with the tests it serves
    sys.path.insert(0, str(ROOT))

from snapquant.atomic import atomic_write_text  # noqa: E402
from tests.support.import_graph import cycle_report, import_graph  # noqa: E402

DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- BEGIN generated tree: python scripts/print_tree.py --write -->"
END = "<!-- END generated tree -->"


def summary(path: Path) -> str:
    """The first sentence of the module docstring's first paragraph, on one line ("" without a docstring)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.search(r"(?<=[.!?])\s(?=[A-Z`(])", para)
    return para[: m.start()] if m else para


def tree_lines(package: Path) -> list[str]:
    """One line per package (its __init__'s summary) and module, depth-first, packages after modules."""
    rows: list[tuple[str, str]] = []

    def walk(folder: Path, depth: int) -> None:
        pad = "  " * depth
        for f in sorted(p for p in folder.glob("*.py") if p.name != "__init__.py"):
            rows.append((f"{pad}{f.name}", summary(f)))
        for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
            rows.append((f"{pad}{sub.name}/", summary(sub / "__init__.py")))
            walk(sub, depth + 1)

    rows.append((f"{package.name}/", summary(package / "__init__.py")))
    walk(package, 1)
    width = max(len(name) for name, _ in rows) + 2
    return [f"{name.ljust(width)}{text}".rstrip() for name, text in rows]


def render(package: Path | None = None) -> str:
    """The tree and the import-graph check, as the text block docs/architecture.md holds."""
    package = package or ROOT / "snapquant"
    lines = tree_lines(package)
    report = cycle_report(import_graph(package))
    return "\n".join(["```text", *lines, "", f"import graph: {report}", "```"])


def replace_block(doc: str, block: str) -> str:
    """`doc` with the text between BEGIN and END replaced by `block` (ValueError when a marker is missing)."""
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise ValueError(f"{DOC.name}: expected one '{BEGIN}' line before one '{END}' line")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print snapquant's module tree and its import-graph check.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"regenerate the tree in {DOC.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {DOC.relative_to(ROOT)} is out of date")
    args = p.parse_args(argv)
    block = render()
    if not (args.write or args.check):
        print(block)
        return 0
    doc = DOC.read_text(encoding="utf-8")
    new = replace_block(doc, block)
    if args.check:
        if new != doc:
            print(f"{DOC.relative_to(ROOT)}: the module tree is out of date; run python scripts/print_tree.py --write",
                  file=sys.stderr)
            return 1
        return 0
    if new != doc:
        atomic_write_text(DOC, new)
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
