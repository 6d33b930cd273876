"""The repository stands on its own: what the code cites from docs/ exists there, and nothing cites
documents outside the repository or issue numbers."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("snapquant", "scripts", "experiments", "tests", "configs", "notebooks", "README.md", "docs")
SUFFIXES = {".py", ".md", ".yaml", ".ipynb"}
# The history is the development notebook, kept as it was written (it names the issues of its day).
NOT_SCANNED = ("docs/history/",)
OWN_DOCS = ("numerics", "performance", "transformers-notes", "architecture", "kernels", "statistics")


def _files():
    for top in SOURCES:
        p = ROOT / top
        for f in ([p] if p.is_file() else sorted(p.rglob("*"))):
            rel = f.relative_to(ROOT).as_posix()
            if f.is_file() and f.suffix in SUFFIXES and not rel.startswith(NOT_SCANNED):
                yield rel, f.read_text(encoding="utf-8", errors="replace")


def _flat(text: str) -> str:
    """One line: comment markers and indentation at line starts dropped, so a citation may wrap."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def _headings(doc: str) -> list[str]:
    text = (ROOT / "docs" / f"{doc}.md").read_text(encoding="utf-8")
    return [m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)]


CITATION = re.compile(r'docs/(' + "|".join(OWN_DOCS) + r')\.md[`,:\s]*\(?((?:"[^"]+"(?:,\s*|\s+and\s+)?)+)')


def _citations():
    for rel, text in _files():
        for m in CITATION.finditer(_flat(text)):
            for section in re.findall(r'"([^"]+)"', m.group(2)):
                yield rel, m.group(1), section


def test_cited_sections_exist():
    cites = list(_citations())
    assert len(cites) >= 10  # the code does cite sections: a regex that matched nothing would pass vacuously
    missing = [(rel, doc, sec) for rel, doc, sec in cites
               if not any(h == sec or h.startswith(sec) for h in _headings(doc))]
    assert not missing, f"citations of sections that docs/ does not have: {missing}"


def test_cited_docs_exist():
    missing = set()
    for rel, text in _files():
        for m in re.finditer(r"docs/([\w/-]+\.md)", text):
            if not (ROOT / "docs" / m.group(1)).is_file():
                missing.add((rel, m.group(1)))
    assert not missing, f"references to files docs/ does not have: {sorted(missing)}"


@pytest.mark.parametrize("pattern, what", [
    (r"(?<![\w/\"'])(numerics|kernels|hf-lmeval|perf-notes)\.md", "a document cited without its docs/ path"),
    (r"\.\./shared|hf-lmeval", "a document outside the repository"),
    (r"\bissue[ -]?#?\d+|\bissues? #\d+|\(issue\b|\bthe issue's\b", "an issue number"),
])
def test_no_reference_outside_the_repository(pattern, what):
    hits = [f"{rel}: {m.group(0)}" for rel, text in _files() for m in re.finditer(pattern, text, flags=re.I)
            if rel != "tests/test_docs_citations.py"]
    assert not hits, f"{what}: {hits}"
