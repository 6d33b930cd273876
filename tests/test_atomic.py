"""snapquant.atomic: the one atomic writer. Modes follow the umask like open(); failures keep the old file."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pandas as pd
import pytest

from snapquant import atomic
from snapquant.atomic import (
    atomic_open,
    atomic_save_figure,
    atomic_write_bytes,
    atomic_write_csv,
    atomic_write_json,
    atomic_write_text,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def umask():
    """Set the process umask for one test, restored afterwards."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda m: os.umask(m)
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _writers(tmp_path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))

    def opened(p):
        with atomic_open(p, "wb") as f:
            f.write(b"x")
        return p

    yield "text", lambda p: atomic_write_text(p, "x")
    yield "bytes", lambda p: atomic_write_bytes(p, b"x")
    yield "json", lambda p: atomic_write_json(p, {"x": 1})
    yield "csv", lambda p: atomic_write_csv(p, pd.DataFrame({"x": [1]}))
    yield "open", opened
    yield "figure", lambda p: atomic_save_figure(fig, p.with_suffix(".png"))
    plt.close(fig)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_get_the_mode_open_would_give(tmp_path, umask, mask, expected):
    umask(mask)
    ref = tmp_path / "ref"
    ref.write_text("x")  # what a plain open() creates under this umask
    assert _mode(ref) == expected
    for name, write in _writers(tmp_path):
        p = write(tmp_path / f"{name}.out")
        assert _mode(p) == expected, name
    # a rewrite is a new file: it takes the umask's mode too (not the 0600 of an older snapquant)
    old = tmp_path / "old.json"
    old.write_text("{}")
    old.chmod(0o600)
    atomic_write_json(old, {})
    assert _mode(old) == expected


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600)])
def test_results_files_follow_the_umask(tmp_path, umask, mask, expected):
    """What a shared results directory gets: the cell JSONs, the manifest, the tables, the figures."""
    from snapquant.analysis import build_table
    from snapquant.analysis.plots import plot_all
    from snapquant.results_io import CELL_SCHEMA
    from snapquant.sweep import ResultStore

    umask(mask)
    st = ResultStore(tmp_path)
    cells = []
    for cid, v in (("base", 0.5), ("var", 0.4)):
        cell = {"schema": CELL_SCHEMA, "cell_id": cid, "label": cid, "kv_config": {}, "seed": 0, "env": {},
                "timing": {}, "bytes_per_token": {"per_layer": 1152 if cid == "base" else 644},
                "is_baseline": cid == "base",
                "tasks": {"t": {"metrics": {"acc": {"value": v, "stderr": 0.05}}, "primary_metric": "acc"}}}
        st.write(cell)
        cells.append(cell)
    st.write_manifest({"cells": [{"cell_id": "base"}, {"cell_id": "var"}]})
    files = list(build_table(cells).save(tmp_path).values()) + plot_all(build_table(cells), tmp_path / "plots")
    written = [st.path("base"), st.path("var"), tmp_path / "sweep.json", *files]
    assert len(written) >= 10
    for p in written:
        assert _mode(p) == expected, p


def test_failure_mid_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    p = tmp_path / "r.json"
    atomic_write_json(p, {"old": True})
    with pytest.raises(RuntimeError, match="disk gone"), atomic_open(p, "w") as f:
        f.write('{"new": tr')  # half of the new content is in the temp file...
        raise RuntimeError("disk gone")  # ...when the writer dies
    assert json.loads(p.read_text()) == {"old": True}
    assert [q.name for q in tmp_path.iterdir()] == ["r.json"]


def test_failure_of_fsync_or_rename_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "t.md"
    atomic_write_text(p, "old\n")
    for target in ("fsync", "replace"):
        with monkeypatch.context() as m:
            def boom(*a, **k):
                raise OSError(28, "No space left on device")
            m.setattr(atomic.os, target, boom)
            with pytest.raises(OSError, match="No space"):
                atomic_write_text(p, "new\n" * 1000)
        assert p.read_text() == "old\n", target
        assert [q.name for q in tmp_path.iterdir()] == ["t.md"], target


def test_failed_figure_keeps_the_old_figure(tmp_path):
    class Broken:
        def savefig(self, f, **kw):
            f.write(b"\x89PNG half")
            raise ValueError("renderer failed")

    p = atomic_write_bytes(tmp_path / "f.png", b"old png")
    with pytest.raises(ValueError, match="renderer"):
        atomic_save_figure(Broken(), p)
    assert p.read_bytes() == b"old png" and [q.name for q in tmp_path.iterdir()] == ["f.png"]


def test_umask_is_read_without_changing_it(umask):
    umask(0o027)
    assert atomic.current_umask() == 0o027
    assert atomic.current_umask() == 0o027  # reading twice: the first read did not reset it


def test_no_other_atomic_write_helpers_remain():
    """Every temp-file-then-rename write goes through snapquant.atomic (one place to get modes right)."""
    pattern = re.compile(r"mkstemp\(|os\.replace\(|\btmp\w*\.replace\(|NamedTemporaryFile\([^)]*delete=False")
    allowed = {"snapquant/atomic.py", "snapquant/kernels/compile_stats.py"}  # the latter: a scratch cubin
    offenders = []
    for sub in ("snapquant", "scripts", "experiments"):
        for f in sorted((REPO / sub).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if rel not in allowed and pattern.search(f.read_text(encoding="utf-8")):
                offenders.append(rel)
    assert offenders == []
    import snapquant.sweep

    assert snapquant.sweep.atomic_write_text is atomic_write_text  # the name the sweep package exports
