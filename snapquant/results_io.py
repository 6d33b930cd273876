"""Sweep results on disk: the cell JSON schema, its encoding, and the directory that holds the cells.

The one module that both writes results (`snapquant.sweep`) and reads them back (`snapquant.analysis`)
import, so neither goes through the other.

Layout of a results directory:

    <out>/sweep.json            the sweep spec and its cell list (rewritten atomically on each start)
    <out>/cells/<cell_id>.json  one finished cell (present = done; never partially written)
    <out>/cells/<cell_id>.npz   the cell's per-position arrays, when its evaluator returned any
                                (fidelity KL and top-1 tokens per position); written before the
                                JSON, which names it and its SHA-256 under "arrays_file"
    <out>/submitit/             job scripts and logs when cells run through submitit

Atomicity: every file goes through `snapquant.atomic` (temp file in the same directory, fsync,
`os.replace`, fsync of the directory). A kill -9 at any moment leaves either the old state or the
complete new file, plus at worst a stray `.tmp-*` file that `clean_temp` removes on the next start.
Jobs on several hosts write different cell files into one shared directory, so merging is just
reading the directory. A cell is finished only when its JSON is valid and the arrays file it names
is there: a copy without the .npz is redone on resume.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from . import atomic
from .atomic import TMP_PREFIX

__all__ = ["ARRAYS_KEY", "CELL_SCHEMA", "ResultStore", "atomic_write_json", "cell_problem", "from_json_number",
           "is_valid_cell", "missing_keys", "read_arrays", "to_jsonable"]

CELL_SCHEMA = "snapquant.sweep.cell/1"
ARRAYS_KEY = "arrays_file"
"""Cell JSON key naming its arrays file: {"file": "<cell_id>.npz", "sha256": ..., "names": [...]}."""


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    # allow_nan=False: NaN/inf are not JSON; `to_jsonable` maps them to None/strings first.
    return atomic.atomic_write_json(path, to_jsonable(obj), indent=1, allow_nan=False)


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

    def arrays_path(self, cell_id: str) -> Path:
        return self.cells_dir / f"{cell_id}.npz"

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
        ref = data.get(ARRAYS_KEY)
        if isinstance(ref, dict) and not (self.cells_dir / str(ref.get("file"))).is_file():
            return None  # the JSON names an arrays file that is not here: not finished
        return data

    def is_done(self, cell_id: str) -> bool:
        return self.load(cell_id) is not None

    def write(self, result: dict[str, Any], arrays: Mapping[str, Any] | None = None) -> Path:
        """Write a cell: its `arrays` ({name: numpy array}) first, as `<cell_id>.npz`, then the JSON naming them.

        In that order, a kill between the two leaves an arrays file without a JSON: not a finished
        cell, and rewritten when the cell is redone.
        """
        if not is_valid_cell(result):
            raise ValueError(f"refusing to write an invalid cell result (missing {missing_keys(result)})")
        if arrays:
            import numpy as np

            buf = io.BytesIO()
            np.savez_compressed(buf, **{k: np.asarray(v) for k, v in arrays.items()})
            data = buf.getvalue()
            path = atomic.atomic_write_bytes(self.arrays_path(result["cell_id"]), data)
            result = {**result, ARRAYS_KEY: {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(),
                                             "names": sorted(arrays)}}
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


def read_arrays(result: dict[str, Any], cell_file: str | Path) -> dict[str, Any] | None:
    """The arrays a cell JSON (read from `cell_file`) names, checked against its SHA-256; None when it names none.

    Raises FileNotFoundError / ValueError naming the file when it is missing or not the one written.
    """
    ref = result.get(ARRAYS_KEY)
    if not isinstance(ref, dict):
        return None
    path = Path(cell_file).parent / str(ref.get("file"))
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != ref.get("sha256"):
        raise ValueError(f"{path} is not the arrays file {Path(cell_file).name} was written with (SHA-256 differs)")
    import numpy as np

    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


REQUIRED_KEYS = ("schema", "cell_id", "label", "kv_config", "tasks", "bytes_per_token", "timing", "env", "seed")


def missing_keys(d: Any) -> list[str]:
    if not isinstance(d, dict):
        return list(REQUIRED_KEYS)
    return [k for k in REQUIRED_KEYS if k not in d]


def is_valid_cell(d: Any) -> bool:
    return isinstance(d, dict) and d.get("schema") == CELL_SCHEMA and not missing_keys(d)


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def cell_problem(d: Any) -> str | None:
    """Why parsed JSON `d` is not a cell result, in words (None when it is one)."""
    if not isinstance(d, dict):
        return f"the JSON is {_JSON_TYPES.get(type(d), type(d).__name__)}, not an object"
    if d.get("schema") != CELL_SCHEMA:
        return f"schema {d.get('schema')!r}, not {CELL_SCHEMA!r}"
    if missing_keys(d):
        return f"missing keys: {', '.join(missing_keys(d))}"
    return None
