"""Reading sweep results: every valid cell JSON under a path, in the sweep's own order."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..results_io import CELL_SCHEMA, ResultStore, cell_problem

EXPECTED = (f"expected a sweep results directory (with cells/), a directory of cell result JSONs, or a cell "
            f"result JSON (schema {CELL_SCHEMA!r})")


class CorruptResultWarning(UserWarning):
    """A cell result file could not be read and was left out (`load_results(..., skip_corrupt=True)`)."""


def load_results(*paths: str | Path, all_runs: bool = False, skip_corrupt: bool = False) -> list[dict[str, Any]]:
    """Cell results from results directories (with `cells/`), directories of JSONs, or JSON files.

    A results directory with a `sweep.json` manifest yields its cells in manifest order, and only
    the cells of the current sweep settings (a file left from an earlier run with other limits has
    another eval key and is ignored) unless `all_runs`. In a directory of JSONs, files of another
    schema are ignored.

    A file that should be a cell but cannot be read (truncated, not JSON, not a cell) is a
    ConfigError naming it: a table with silently fewer rows is a wrong table. Each cell dict gets
    "_file", the path it was read from (its arrays file, if any, is beside it). With `skip_corrupt`
    each such file is left out with a `CorruptResultWarning` naming it instead. Raises ConfigError
    when nothing is found.
    """
    out: list[dict[str, Any]] = []

    def corrupt(msg: str) -> None:
        if not skip_corrupt:
            raise ConfigError(msg + " (--skip-corrupt leaves it out)")
        warnings.warn(f"left out {msg}", CorruptResultWarning, stacklevel=3)

    for p in map(Path, paths):
        if p.is_file():
            if p.suffix.lower() in (".yaml", ".yml"):
                raise ConfigError(f"{p} is a YAML file, not sweep results (a sweep config? `snapquant sweep {p}` "
                                  f"runs it; then pass its output directory); {EXPECTED}")
            data, why = _read_json(p)
            if why is None and not _claims_cell(data):
                raise ConfigError(f"{p} is not a snapquant sweep cell result ({cell_problem(data)}); {EXPECTED}")
            why = why or cell_problem(data)
            if why is not None:
                corrupt(f"{p}: {why}; {EXPECTED}")
            else:
                out.append({**data, "_file": str(p)})
        elif (p / "cells").is_dir():
            out.extend(_from_store(ResultStore(p), all_runs, corrupt))
        elif p.is_dir():
            files = sorted(p.glob("*.json"))
            others = 0
            for f in files:
                data, why = _read_json(f)
                if why is None and not _claims_cell(data):
                    others += 1  # another kind of JSON sharing the folder
                    continue
                why = why or cell_problem(data)
                if why is not None:
                    corrupt(f"{f}: {why}; expected a cell result JSON (schema {CELL_SCHEMA!r})")
                else:
                    out.append({**data, "_file": str(f)})
            if files and others == len(files):
                raise ConfigError(f"no finished cell results under {p}: none of its {len(files)} JSON file(s) "
                                  f"has schema {CELL_SCHEMA!r}; {EXPECTED}")
        else:
            raise ConfigError(f"no results at {p}")
    if not out:
        raise ConfigError(f"no finished cell results under {', '.join(map(str, paths))}")
    seen: dict[str, dict] = {}
    for r in out:
        seen.setdefault(r["cell_id"], r)
    return list(seen.values())


def _read_json(p: Path) -> tuple[Any, str | None]:
    """(parsed JSON, None), or (None, why the file is not JSON)."""
    try:
        return json.loads(p.read_bytes().decode("utf-8")), None
    except json.JSONDecodeError as e:
        if not e.doc.strip():
            return None, "empty file"
        return None, f"not valid JSON ({'truncated? ' if e.pos >= len(e.doc.rstrip()) else ''}{e})"
    except UnicodeDecodeError:
        return None, "not UTF-8 text (a binary file?)"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"


def _claims_cell(data: Any) -> bool:
    return isinstance(data, dict) and data.get("schema") == CELL_SCHEMA


def _from_store(store: ResultStore, all_runs: bool, corrupt) -> list[dict[str, Any]]:
    man = store.manifest()
    wanted = None if man is None or all_runs else [c["cell_id"] for c in man.get("cells", [])]
    results: dict[str, dict[str, Any]] = {}
    for f in sorted(store.cells_dir.glob("*.json")):
        if wanted is not None and f.stem not in wanted:
            continue  # a cell of earlier sweep settings
        data, why = _read_json(f)
        why = why or cell_problem(data)
        if why is None and data["cell_id"] != f.stem:
            why = f"its cell_id {data['cell_id']!r} does not match the file name"
        if why is not None:
            corrupt(f"corrupt cell result {f}: {why}; `snapquant sweep` redoes the cell when resumed")
        else:
            results[data["cell_id"]] = {**data, "_file": str(f)}
    if wanted is None:
        return list(results.values())
    return [results[c] for c in wanted if c in results]


def baseline_of(results: list[dict[str, Any]], baseline: str | None = None) -> dict[str, Any] | None:
    """The baseline cell: the one labelled `baseline`, else the one the sweep marked as its baseline."""
    if baseline is not None:
        for r in results:
            if r["label"] == baseline or r["cell_id"] == baseline:
                return r
        raise ConfigError(f"baseline={baseline!r} is not a cell label; labels: {', '.join(r['label'] for r in results)}")
    for r in results:
        if r.get("is_baseline"):
            return r
    return None
