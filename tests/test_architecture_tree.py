"""docs/architecture.md's module tree is the one scripts/print_tree.py generates from the sources."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("print_tree", ROOT / "scripts" / "print_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_tree_is_current():
    pt = _script()
    doc = pt.DOC.read_text(encoding="utf-8")
    assert pt.replace_block(doc, pt.render()) == doc, "run python scripts/print_tree.py --write"
    assert pt.main(["--check"]) == 0


def test_the_tree_names_every_module_with_its_summary_and_reports_cycles(tmp_path):
    pt = _script()
    pkg = tmp_path / "snapquant"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package.\n\nMore."""\n')
    (pkg / "a.py").write_text('"""Module a: does\nthings. Second sentence."""\nfrom .sub import b\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    text = pt.render(pkg)
    lines = text.splitlines()
    assert lines[1].split() == ["snapquant/", "The", "package."]
    assert lines[2].split(maxsplit=1) == ["a.py", "Module a: does things."]
    assert [ln.strip() for ln in lines[3:5]] == ["sub/", "b.py"]
    assert "import graph: cycle of 2 modules: snapquant.a -> snapquant.sub.b -> snapquant.a" in text
    doc = f"x\n{pt.BEGIN}\nold\n{pt.END}\ny\n"
    assert pt.replace_block(doc, "new") == f"x\n{pt.BEGIN}\nnew\n{pt.END}\ny\n"
    with pytest.raises(ValueError, match="expected one"):
        pt.replace_block("no markers", "new")
