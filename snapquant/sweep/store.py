"""The result store: one JSON file per cell, written atomically, so a sweep can be killed and resumed.

Layout of a results directory:

    <out>/sweep.json            the sweep spec and its cell list (rewritten atomically on each start)
    <out>/cells/<cell_id>.json  one finished cell (present = done; never partially written)
    <out>/submitit/             job scripts and logs when cells run through submitit

Atomicity: write to a uniquely named temp file in the same directory, flush + fsync it, then
`os.replace` it over the target (atomic on POSIX within one file system) and fsync the directory
so the rename itself survives a crash. A kill -9 at any moment leaves either the old state or the
complete new file, plus at worst a stray `.tmp-*` file that `clean_temp` removes on the next start.
Jobs on several hosts write different cell files into one shared directory, so merging is just
reading the directory.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CELL_SCHEMA = "snapquant.sweep.cell/1"
TMP_PREFIX = ".tmp-"


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` so that readers only ever see the old or the complete new content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    # allow_nan=False: NaN/inf are not JSON; `to_jsonable` maps them to None/strings first.
    return atomic_write_text(path, json.dumps(to_jsonable(obj), indent=1, allow_nan=False) + "\n")


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def to_jsonable(x: Any) -> Any:
    """Make lm-eval / numpy / torch values JSON-safe: tensors and arrays to lists, NaN/inf to strings."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))
    if hasattr(x, "tolist"):  # numpy / torch scalars and arrays
        return to_jsonable(x.tolist())
    if isinstance(x, Path):
        return str(x)
    return str(x)


def from_json_number(x: Any) -> float:
    """Inverse of `to_jsonable` for numbers: 'nan' / 'inf' strings back to floats; None -> nan."""
    if x is None:
        return math.nan
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return math.nan
    return float(x)


class ResultStore:
    """Cell files of one results directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.cells_dir = self.root / "cells"

    def path(self, cell_id: str) -> Path:
        return self.cells_dir / f"{cell_id}.json"

    def clean_temp(self) -> list[Path]:
        """Remove temp files left by a killed writer (they are never valid results)."""
        removed = []
        for d in (self.root, self.cells_dir):
            if d.is_dir():
                for p in d.glob(TMP_PREFIX + "*"):
                    p.unlink(missing_ok=True)
                    removed.append(p)
        return removed

    def load(self, cell_id: str) -> dict[str, Any] | None:
        """The finished result of a cell, or None when it is missing or not a valid cell file."""
        p = self.path(cell_id)
        try:
            data = json.loads(p.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not is_valid_cell(data) or data.get("cell_id") != cell_id:
            return None
        return data

    def is_done(self, cell_id: str) -> bool:
        return self.load(cell_id) is not None

    def write(self, result: dict[str, Any]) -> Path:
        if not is_valid_cell(result):
            raise ValueError(f"refusing to write an invalid cell result (missing {missing_keys(result)})")
        return atomic_write_json(self.path(result["cell_id"]), result)

    def iter_results(self) -> Iterator[dict[str, Any]]:
        if not self.cells_dir.is_dir():
            return
        for p in sorted(self.cells_dir.glob("*.json")):
            try:
                data = json.loads(p.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if is_valid_cell(data):
                yield data

    def write_manifest(self, manifest: dict[str, Any]) -> Path:
        return atomic_write_json(self.root / "sweep.json", manifest)

    def manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / "sweep.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None


REQUIRED_KEYS = ("schema", "cell_id", "label", "kv_config", "tasks", "bytes_per_token", "timing", "env", "seed")


def missing_keys(d: Any) -> list[str]:
    if not isinstance(d, dict):
        return list(REQUIRED_KEYS)
    return [k for k in REQUIRED_KEYS if k not in d]


def is_valid_cell(d: Any) -> bool:
    return isinstance(d, dict) and d.get("schema") == CELL_SCHEMA and not missing_keys(d)
