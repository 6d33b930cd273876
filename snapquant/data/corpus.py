"""The Python-source corpus the embedded model is trained on: which files, in which split.

Sources are this machine's CPython standard library plus a pinned list of installed packages. The
corpus is built once (on the development machine), recorded in a manifest (path, sha256, bytes,
split) and shipped to the training machine already tokenized, so both machines see identical data
whatever Python they have. Held-out evaluation files live in `snapquant/eval/tasks/data/` and are
excluded from training by content hash, which also catches vendored copies of the same file.

Held-out files that turned out to be near duplicates of training files, or to share a long
verbatim passage with one (`decontam.heldout_overlaps`, run by `scripts/decontam_heldout.py`),
were moved to `assets/embedded/heldout_dropped.jsonl`: evaluation never reads them, while corpus
builds still exclude them from training so that a rebuilt corpus matches the shipped manifest.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata as md
import json
import os
import sysconfig
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..atomic import atomic_open, atomic_write_text
from ..errors import ConfigError

# Packages whose .py files join the stdlib in the training text, pinned to the versions the shipped
# corpus was built from. Distribution name -> (import directory under site-packages, version).
PINNED_PACKAGES: dict[str, tuple[str, str]] = {
    "requests": ("requests", "2.34.2"),
    "urllib3": ("urllib3", "2.7.0"),
    "Jinja2": ("jinja2", "3.1.6"),
    "click": ("click", "8.5.1"),
    "rich": ("rich", "15.0.0"),
    "typer": ("typer", "0.29.2"),
    "PyYAML": ("yaml", "6.0.3"),
    "networkx": ("networkx", "3.6.1"),
    "pytest": ("_pytest", "9.0.3"),
    "hypothesis": ("hypothesis", "6.155.2"),
    "setuptools": ("setuptools", "84.2.1"),
    "datasets": ("datasets", "5.2.0"),
    "numpy": ("numpy", "2.4.6"),
    "fsspec": ("fsspec", "2026.9.0"),
    "aiohttp": ("aiohttp", "3.14.5"),
    "pydantic": ("pydantic", "2.13.4"),
}

# Quality filters: skip generated blobs and data-as-code files that teach nothing about code.
MIN_BYTES = 200
MAX_BYTES = 300_000
MAX_LINE_CHARS = 1000
# Stdlib folders holding deliberately broken or Python-2 sources used as test fixtures.
SKIP_PARTS = ("site-packages", "lib2to3/tests/data", "test/badsyntax", "test/tokenizedata", "__pycache__",
              "idlelib/idle_test", "test/test_lib2to3/data")

HELDOUT_FILE = Path(__file__).resolve().parent.parent / "eval" / "tasks" / "data" / "heldout_code.jsonl"
DROPPED_HELDOUT_FILE = Path(__file__).resolve().parent.parent / "assets" / "embedded" / "heldout_dropped.jsonl"


@dataclass(frozen=True)
class SourceFile:
    """One candidate file: `path` is relative to its origin root, `origin` is 'stdlib' or 'pkg:NAME==VER'."""

    path: str
    origin: str
    sha256: str
    bytes: int
    abs_path: str

    def read(self) -> str:
        return normalize_source(Path(self.abs_path).read_bytes().decode("utf-8"))


def normalize_source(text: str) -> str:
    """Line endings to '\\n' and a single trailing newline, so hashes ignore platform noise."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.rstrip("\n") + "\n"


def content_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _accept(text: str) -> str | None:
    """Reason to reject a source text, or None to keep it."""
    size = len(text.encode("utf-8"))
    if size < MIN_BYTES:
        return "too_small"
    if size > MAX_BYTES:
        return "too_large"
    if max(map(len, text.split("\n"))) > MAX_LINE_CHARS:
        return "long_line"
    try:
        # Python 2 fixtures and intentionally broken test inputs fail here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(text)
    except (SyntaxError, ValueError):
        return "syntax"
    return None


def _walk_py(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = Path(dirpath).relative_to(root).as_posix()
        if any(part in f"{rel}/" or rel.endswith(part) for part in SKIP_PARTS):
            dirnames[:] = []
            continue
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def source_path(origin: str, path: str) -> Path:
    """Where a manifest entry (`origin` 'stdlib' or 'pkg:NAME==VER', relative `path`) lives on this machine."""
    if origin == "stdlib":
        return stdlib_root() / path
    dist = origin.removeprefix("pkg:").split("==")[0]
    if dist not in PINNED_PACKAGES:
        raise ConfigError(f"manifest origin {origin!r} is neither 'stdlib' nor a pinned package")
    return Path(sysconfig.get_paths()["purelib"]) / PINNED_PACKAGES[dist][0] / path


def package_roots(packages: dict[str, tuple[str, str]] | None = None,
                  strict_versions: bool = True) -> list[tuple[str, Path]]:
    """(origin label, directory) for each pinned package; raises ConfigError on a version mismatch."""
    packages = PINNED_PACKAGES if packages is None else packages
    purelib = Path(sysconfig.get_paths()["purelib"])
    roots = []
    for dist, (import_dir, pinned) in packages.items():
        try:
            have = md.version(dist)
        except md.PackageNotFoundError as exc:
            raise ConfigError(f"corpus package {dist!r} (pinned {pinned}) is not installed") from exc
        if have != pinned and strict_versions:
            raise ConfigError(
                f"corpus package {dist!r} is {have} here but the corpus pins {pinned}; the shipped corpus "
                "would not be reproduced (pass strict_versions=False / --no-strict-versions to accept)"
            )
        root = purelib / import_dir
        if not root.is_dir():
            raise ConfigError(f"corpus package {dist!r}: import directory {root} not found")
        roots.append((f"pkg:{dist}=={have}", root))
    return roots


def iter_source_files(include_packages: bool = True, strict_versions: bool = True) -> Iterator[SourceFile]:
    """Every .py file of the stdlib (and pinned packages) in a fixed order, unfiltered."""
    roots: list[tuple[str, Path]] = [("stdlib", stdlib_root())]
    if include_packages:
        roots += package_roots(strict_versions=strict_versions)
    for origin, root in roots:
        for path in _walk_py(root):
            raw = path.read_bytes()
            yield SourceFile(path=path.relative_to(root).as_posix(), origin=origin,
                             sha256=hashlib.sha256(raw).hexdigest(), bytes=len(raw), abs_path=str(path))


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    origin: str
    sha256: str  # of the normalized text (what is trained on / evaluated)
    bytes: int
    split: str  # 'train', 'heldout' or 'excluded:<reason>'


def load_heldout(path: Path | str = HELDOUT_FILE, *, include_dropped: bool = False) -> list[dict]:
    """The shipped held-out files evaluation uses: dicts with path, origin, sha256, bytes, text.

    `include_dropped` adds the files decontamination dropped (`DROPPED_HELDOUT_FILE`): never
    evaluated on, but still excluded from training, which is what corpus builds need.
    """
    rows = _read_heldout(Path(path))
    if include_dropped and DROPPED_HELDOUT_FILE.is_file():
        rows += _read_heldout(DROPPED_HELDOUT_FILE)
    return rows


def _read_heldout(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"held-out code file {path} is missing; run build_heldout() first")
    with path.open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    for row in rows:
        if content_sha256(row["text"]) != row["sha256"]:
            raise ConfigError(f"held-out file {row['path']!r}: sha256 does not match its text (edited by hand?)")
    return rows


def select_heldout(files: Iterable[SourceFile], target_bytes: int = 300_000, min_bytes: int = 3_000,
                   max_bytes: int = 30_000) -> list[dict]:
    """Pick held-out stdlib library modules (not tests) deterministically by hashing their path.

    Ordering by sha256 of the path (not of the content) keeps the choice stable across patch
    releases of Python that touch the content.
    """
    cands = []
    for f in files:
        parts = f.path.split("/")
        # Library code only: no tests, no generated codec tables.
        if f.origin != "stdlib" or any("test" in p for p in parts) or parts[0] == "encodings":
            continue
        if not min_bytes <= f.bytes <= max_bytes:
            continue
        cands.append(f)
    cands.sort(key=lambda f: hashlib.sha256(f"heldout/{f.path}".encode()).hexdigest())
    chosen, total = [], 0
    for f in cands:
        text = f.read()
        if _accept(text) is not None:
            continue
        chosen.append({"path": f.path, "origin": f.origin, "sha256": content_sha256(text),
                       "bytes": len(text.encode("utf-8")), "text": text})
        total += chosen[-1]["bytes"]
        if total >= target_bytes:
            break
    return sorted(chosen, key=lambda r: r["path"])


def build_heldout(path: Path | str = HELDOUT_FILE, target_bytes: int = 300_000) -> list[dict]:
    """Write the held-out jsonl (one-time; the result is committed and shipped in the package).

    Files decontamination dropped earlier stay dropped; run `scripts/decontam_heldout.py` after
    a new selection.
    """
    dropped = {r["sha256"] for r in _read_heldout(DROPPED_HELDOUT_FILE)} if DROPPED_HELDOUT_FILE.is_file() else set()
    rows = [r for r in select_heldout(iter_source_files(include_packages=False), target_bytes=target_bytes)
            if r["sha256"] not in dropped]
    with atomic_open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return rows


def split_corpus(files: Iterable[SourceFile], heldout_hashes: set[str]
                 ) -> tuple[list[ManifestEntry], dict[int, str]]:
    """Assign every file a split; return the manifest and {manifest index: text} of training files.

    Exact duplicates (same normalized text) keep only their first occurrence, so a vendored copy
    of a held-out module cannot leak into training under another path.
    """
    manifest: list[ManifestEntry] = []
    texts: dict[int, str] = {}
    seen: set[str] = set()
    for f in files:
        try:
            text = f.read()
        except UnicodeDecodeError:
            manifest.append(ManifestEntry(f.path, f.origin, f.sha256, f.bytes, "excluded:not_utf8"))
            continue
        digest = content_sha256(text)
        nbytes = len(text.encode("utf-8"))
        if digest in heldout_hashes:
            split = "heldout"
        elif digest in seen:
            split = "excluded:duplicate"
        else:
            reason = _accept(text)
            split = "train" if reason is None else f"excluded:{reason}"
        seen.add(digest)
        if split == "train":
            texts[len(manifest)] = text
        manifest.append(ManifestEntry(f.path, f.origin, digest, nbytes, split))
    return manifest, texts


def write_manifest(entries: Iterable[ManifestEntry], path: Path | str) -> str:
    """Write manifest jsonl atomically; return its sha256."""
    lines = "".join(json.dumps(asdict(e)) + "\n" for e in entries)
    atomic_write_text(path, lines)
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def manifest_summary(entries: Iterable[ManifestEntry]) -> dict:
    """Counts and bytes per split and per origin, for the model card."""
    out: dict = {"splits": {}, "origins": {}}
    for e in entries:
        s = out["splits"].setdefault(e.split, {"files": 0, "bytes": 0})
        s["files"] += 1
        s["bytes"] += e.bytes
        if e.split == "train":
            o = out["origins"].setdefault(e.origin, {"files": 0, "bytes": 0})
            o["files"] += 1
            o["bytes"] += e.bytes
    return out
