"""Reading sweep results: every valid cell JSON under a path, in the sweep's own order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..sweep.store import ResultStore, is_valid_cell


def load_results(*paths: str | Path, all_runs: bool = False) -> list[dict[str, Any]]:
    """Cell results from results directories (with `cells/`), directories of JSONs, or JSON files.

    A results directory with a `sweep.json` manifest yields its cells in manifest order, and only
    the cells of the current sweep settings (a file left from an earlier run with other limits has
    another eval key and is ignored) unless `all_runs`. Raises ConfigError when nothing is found.
    """
    out: list[dict[str, Any]] = []
    for p in map(Path, paths):
        if p.is_file():
            data = json.loads(p.read_text())
            if not is_valid_cell(data):
                raise ConfigError(f"{p} is not a snapquant sweep cell result (schema {data.get('schema')!r})")
            out.append(data)
        elif (p / "cells").is_dir():
            out.extend(_from_store(ResultStore(p), all_runs))
        elif p.is_dir():
            for f in sorted(p.glob("*.json")):
                data = json.loads(f.read_text())
                if is_valid_cell(data):
                    out.append(data)
        else:
            raise ConfigError(f"no results at {p}")
    if not out:
        raise ConfigError(f"no finished cell results under {', '.join(map(str, paths))}")
    seen: dict[str, dict] = {}
    for r in out:
        seen.setdefault(r["cell_id"], r)
    return list(seen.values())


def _from_store(store: ResultStore, all_runs: bool) -> list[dict[str, Any]]:
    results = {r["cell_id"]: r for r in store.iter_results()}
    man = store.manifest()
    if man is None or all_runs:
        return list(results.values())
    ordered = [results[c["cell_id"]] for c in man.get("cells", []) if c["cell_id"] in results]
    return ordered


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
