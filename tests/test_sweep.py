"""Sweep schema, grid expansion, result store, inline runs, resume and kill -9 safety."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from snapquant import PRESETS, ConfigError
from snapquant.results_io import CELL_SCHEMA, is_valid_cell
from snapquant.sweep import ResultStore, SweepSpec, atomic_write_json, expand, run_sweep
from snapquant.sweep.api import execute
from tests.support.sweep_fakes import FakeEvaluator, outcomes

ROOT = Path(__file__).resolve().parents[1]  # on a subprocess's PYTHONPATH, so it imports tests.support
FAKE = "tests.support.sweep_fakes:FakeEvaluator"


def spec_dict(tmp_path: Path, **kw) -> dict:
    d = {"name": "t", "model": "embedded", "tasks": ["fake_a", {"name": "fake_b", "limit": 40}],
         "presets": ["bf16", "snapmla", "per_tensor_fp8"], "fidelity": False, "output_dir": str(tmp_path / "out")}
    d.update(kw)
    return d


def test_fake_outcomes_deterministic_and_baseline_exact():
    a = outcomes("fake_a", 50, PRESETS["snapmla"])
    assert (a == outcomes("fake_a", 50, PRESETS["snapmla"])).all()
    assert (outcomes("fake_a", 50, PRESETS["bf16"]) == outcomes("fake_a", 50, PRESETS["bf16"].replace(name="x"))).all()
    assert (a != outcomes("fake_a", 50, PRESETS["bf16"])).any()


# ---------------------------------------------------------------------- schema
def test_valid_spec_defaults(tmp_path):
    s = SweepSpec.from_dict(spec_dict(tmp_path))
    assert [t.name for t in s.tasks] == ["fake_a", "fake_b"]
    assert s.tasks[1].limit == 40 and s.baseline == "bf16" and s.launcher.executor == "inline"
    assert s.out_dir == tmp_path / "out"
    again = SweepSpec.from_dict(s.to_dict())  # round trip through plain data (what jobs receive)
    assert again == s and again.eval_key() == s.eval_key()


def test_all_problems_in_one_error_with_valid_names(tmp_path):
    bad = spec_dict(tmp_path, presets=["bf16", "snapmal"], grid={"axes": {"nope_dtyp": ["fp8_e4m3"],
                                                                          "query": ["fp4"]}},
                    dtype="float8", launcher={"executor": "kubernetes"}, colour="red")
    bad["tasks"] = ["fake_a", {"name": "fake_b", "limit": -3}]
    with pytest.raises(ConfigError) as e:
        SweepSpec.from_dict(bad, task_checker=FakeEvaluator().check_tasks)
    msg = str(e.value)
    assert "problem(s)" in msg
    assert "presets='snapmal'" in msg and "did you mean 'snapmla'" in msg and "per_tensor_fp8" in msg
    assert "grid axis='nope_dtyp'" in msg and "nope_dtype" in msg
    assert "grid.axes.query value='fp4'" in msg and "fp8_e4m3" in msg
    assert "dtype='float8'" in msg and "bfloat16" in msg
    assert "launcher.executor='kubernetes'" in msg and "slurm" in msg
    assert "key='colour'" in msg
    assert "limit=-3" in msg
    assert msg.count("\n  - ") == 7


def test_unknown_task_is_reported_with_the_rest(tmp_path):
    d = spec_dict(tmp_path, presets=["nope"])
    d["tasks"] = ["fake_a", "fake_zzz"]
    with pytest.raises(ConfigError) as e:
        SweepSpec.from_dict(d, task_checker=FakeEvaluator().check_tasks)
    assert "fake_zzz" in str(e.value) and "fake_b" in str(e.value) and "presets='nope'" in str(e.value)


def test_code_executing_task_refused_without_permission(tmp_path):
    from snapquant.eval.catalog import check_tasks

    errs = check_tasks(["humaneval", "mbpp"], False, [])
    assert len(errs) == 2 and all("allow_code_execution: true" in e for e in errs)
    d = spec_dict(tmp_path, tasks=["humaneval"])
    with pytest.raises(ConfigError, match="executes model-generated code"):
        SweepSpec.from_dict(d, task_checker=check_tasks)


def test_snapquant_task_names_checked_against_lm_eval_index():
    from snapquant.eval.catalog import check_tasks

    assert check_tasks(["sq_code_ppl"], False, []) == []
    errs = check_tasks(["sq_code_pp"], False, [])
    assert len(errs) == 1 and "did you mean 'sq_code_ppl'" in errs[0] and "sq_passkey" in errs[0]


# ---------------------------------------------------------------------- grid
def test_grid_expansion_counts_skips_and_baseline(tmp_path):
    d = spec_dict(tmp_path, presets=["snapmla"], grid={
        "base": "snapmla_kv_only",
        "axes": {"nope_dtype": ["fp8_e4m3", "fp8_e5m2", "int8"], "nope_granularity": ["per_token", "per_channel"]}})
    ex = expand(SweepSpec.from_dict(d))
    labels = [c.label for c in ex.cells]
    # per_channel is incompatible with the base's pre-scaled RoPE: 3 combos skipped with the reason
    assert len([s for s in ex.skipped if "rope_prescale" in s[1]]) == 3
    assert labels[0] == "snapmla" and labels[-1] == "bf16" and ex.cells[-1].is_baseline
    grid_cells = [c for c in ex.cells if c.source == "grid"]
    assert len(grid_cells) == 3 and {c.config.nope_dtype for c in grid_cells} == {"fp8_e4m3", "fp8_e5m2", "int8"}
    assert grid_cells[0].config == PRESETS["snapmla_kv_only"]  # same config, listed once as a grid cell
    assert grid_cells[1].axes == {"nope_dtype": "fp8_e5m2", "nope_granularity": "per_token"}
    assert len({c.cell_id for c in ex.cells}) == len(ex.cells)


def test_duplicate_configs_evaluated_once(tmp_path):
    d = spec_dict(tmp_path, presets=["bf16", "snapmla"], grid={"base": "snapmla", "axes": {"pv": ["fp8_scale_fused", "bf16"]}})
    ex = expand(SweepSpec.from_dict(d))
    assert [c.label for c in ex.cells] == ["bf16", "snapmla", "pv=bf16"]
    assert any("same configuration as 'snapmla'" in why for _, why in ex.skipped)


def test_cell_ids_stable_and_sensitive_to_eval_settings(tmp_path):
    a = expand(SweepSpec.from_dict(spec_dict(tmp_path)))
    b = expand(SweepSpec.from_dict(spec_dict(tmp_path)))
    assert [c.cell_id for c in a.cells] == [c.cell_id for c in b.cells]
    changed = spec_dict(tmp_path)
    changed["tasks"] = ["fake_a", {"name": "fake_b", "limit": 41}]
    c = expand(SweepSpec.from_dict(changed))
    assert not {x.cell_id for x in a.cells} & {x.cell_id for x in c.cells}
    # the output directory and the launcher do not change results: same ids
    moved = expand(SweepSpec.from_dict(spec_dict(tmp_path, output_dir="elsewhere", launcher={"executor": "local"})))
    assert [x.cell_id for x in moved.cells] == [x.cell_id for x in a.cells]


def test_only_baseline_left_is_an_error(tmp_path):
    d = spec_dict(tmp_path, presets=["bf16"])
    with pytest.raises(ConfigError, match="no cell besides the baseline"):
        expand(SweepSpec.from_dict(d))


# ---------------------------------------------------------------------- store
def _cell(cid: str) -> dict:
    return {"schema": CELL_SCHEMA, "cell_id": cid, "label": cid, "kv_config": {}, "tasks": {},
            "bytes_per_token": {}, "timing": {}, "env": {}, "seed": 0, "x": float("nan")}


def test_store_atomic_roundtrip_and_invalid_files(tmp_path):
    st = ResultStore(tmp_path)
    st.write(_cell("a"))
    assert st.load("a")["x"] == "nan" and st.is_done("a")
    st.path("b").write_text('{"schema": "snapquant.sweep.cell/1", "cell_id": "b"')  # truncated by hand
    st.path("c").write_text(json.dumps({**_cell("c"), "cell_id": "other"}))
    assert st.load("b") is None and st.load("c") is None
    assert [r["cell_id"] for r in st.iter_results()] == ["a", "other"]
    (st.cells_dir / ".tmp-a.json.xyz").write_text("{")
    assert len(st.clean_temp()) == 1 and not list(st.cells_dir.glob(".tmp-*"))
    with pytest.raises(ValueError, match="invalid cell"):
        st.write({"cell_id": "z"})


# the atomic writer is stdlib-only: load it by path so the writer starts in milliseconds (no torch import)
_WRITER = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("atomic", sys.argv[2])
    atomic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic)
    atomic_write_json = atomic.atomic_write_json
    payload = {"schema": "x", "blob": ["y" * 1000] * 4000}
    i = 0
    while True:
        payload["i"] = i
        atomic_write_json(sys.argv[1], payload)
        i += 1
""")


def test_kill_9_during_writes_never_leaves_a_corrupt_file(tmp_path):
    from snapquant import atomic as atomic_mod

    target = tmp_path / "r.json"
    atomic_write_json(target, {"i": -1})
    rng = random.Random(0)
    for _ in range(6):
        atomic_write_json(target, {"i": -1})
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target), atomic_mod.__file__])
        deadline = time.time() + 60
        while json.loads(target.read_text())["i"] < 1 and time.time() < deadline:  # writes are under way
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.05))  # a ~4 MB write takes tens of ms: land at any point of one
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        data = json.loads(target.read_text())  # must always parse: the old or the complete new content
        assert data["i"] >= 1 and len(data["blob"]) == 4000
    ResultStore(tmp_path).clean_temp()  # what the next sweep start does with a killed writer's temp file
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


# ---------------------------------------------------------------------- inline runs
def test_inline_sweep_three_presets_two_tasks_and_resume(tmp_path):
    spec = SweepSpec.from_dict(spec_dict(tmp_path))
    ev = FakeEvaluator()
    rep = run_sweep(spec, ev, show_progress=False)
    assert len(rep.ran) == 3 and not rep.failed and ev.setups == 1
    files = sorted((tmp_path / "out" / "cells").glob("*.json"))
    assert len(files) == 3
    for f in files:
        d = json.loads(f.read_text())
        assert is_valid_cell(d) and set(d["tasks"]) == {"fake_a", "fake_b"}
        assert d["kv_config"]["nope_dtype"] in ("bf16", "fp8_e4m3")
        assert d["bytes_per_token"]["per_layer"] in (1152, 644, 576)
        assert d["env"]["packages"]["torch"] and d["seed"] == spec.seed and d["timing"]["total_s"] >= 0
        assert len(d["samples"]["fake_b"]) == 40
    man = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [c["label"] for c in man["cells"]] == ["bf16", "snapmla", "per_tensor_fp8"]
    # resume: nothing left to do, the evaluator is not even set up
    ev2 = FakeEvaluator()
    rep2 = run_sweep(spec, ev2, show_progress=False)
    assert rep2.ran == [] and len(rep2.already_done) == 3 and ev2.setups == 0 and ev2.evaluated == []
    # a deleted cell is the only one re-run
    files[0].unlink()
    ev3 = FakeEvaluator()
    rep3 = run_sweep(spec, ev3, show_progress=False)
    assert len(rep3.ran) == 1 and ev3.evaluated == [files[0].stem]


def test_fidelity_arrays_are_written_beside_the_cell_and_a_cell_is_done_only_with_both(tmp_path):
    import numpy as np

    from snapquant.results_io import ARRAYS_KEY, read_arrays
    from tests.support.sweep_fakes import fake_fidelity

    fid = {"num_sequences": 3, "seq_len": 20, "prompt_len": 6}
    spec = SweepSpec.from_dict(spec_dict(tmp_path, presets=["bf16", "snapmla"], fidelity=fid))
    rep = run_sweep(spec, FakeEvaluator(fidelity=True), show_progress=False)
    assert len(rep.ran) == 2 and not rep.failed
    store = ResultStore(tmp_path / "out")
    cells = {c.label: c for c in rep.cells}
    cid = cells["snapmla"].cell_id
    d = json.loads(store.path(cid).read_text())
    assert d[ARRAYS_KEY]["file"] == f"{cid}.npz" and store.arrays_path(cid).is_file()
    assert "arrays" not in d and "positions" not in d["fidelity"]["decode"]  # arrays only in the .npz
    assert d["fidelity"]["decode"]["per_sequence"]["n_positions"] == [13, 13, 13]  # 20 - 6 - 1 decode positions
    got = read_arrays(d, store.path(cid))
    _, want = fake_fidelity(cells["snapmla"].config, spec)
    assert set(got) == set(want) == {"input_ids", "prefill_kl", "prefill_ref_top1", "prefill_quant_top1", "decode_kl",
                                     "decode_ref_top1", "decode_quant_top1"}
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert got["decode_kl"].dtype == np.float64 and got["decode_kl"].shape == (3, 13)
    # the JSON without its arrays file is not a finished cell: dry-run lists it as to do, resume redoes it only
    store.arrays_path(cid).unlink()
    assert not store.is_done(cid) and store.is_done(cells["bf16"].cell_id)
    assert run_sweep(spec, FakeEvaluator(fidelity=True), dry_run=True).already_done == [cells["bf16"].cell_id]
    ev = FakeEvaluator(fidelity=True)
    assert run_sweep(spec, ev, show_progress=False).ran == [cid] and ev.evaluated == [cid]
    assert store.is_done(cid)
    # an arrays file other than the one the JSON was written with is refused, naming it
    store.arrays_path(cid).write_bytes(store.arrays_path(cells["bf16"].cell_id).read_bytes())
    with pytest.raises(ValueError, match=f"{cid}.npz is not the arrays file"):
        read_arrays(json.loads(store.path(cid).read_text()), store.path(cid))


def test_dry_run_lists_without_running(tmp_path):
    spec = SweepSpec.from_dict(spec_dict(tmp_path))
    ev = FakeEvaluator()
    rep = run_sweep(spec, ev, dry_run=True)
    assert len(rep.cells) == 3 and ev.setups == 0 and not (tmp_path / "out").exists()


def test_failing_cell_is_reported_and_others_still_run(tmp_path):
    class Flaky(FakeEvaluator):
        def evaluate(self, cell, spec, progress):
            if cell.label == "snapmla":
                raise RuntimeError("boom")
            return super().evaluate(cell, spec, progress)

    from rich.console import Console

    spec = SweepSpec.from_dict(spec_dict(tmp_path))
    rep = run_sweep(spec, Flaky(), show_progress=False, console=Console(file=open(os.devnull, "w")))
    assert len(rep.ran) == 2 and list(rep.failed.values()) == ["RuntimeError: boom"]
    assert len(list((tmp_path / "out" / "cells").glob("*.json"))) == 2


def _write_cfg(tmp_path: Path, **kw) -> Path:
    d = spec_dict(tmp_path, **kw)
    p = tmp_path / "sweep.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _env(tmp_path: Path, delay: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               SQ_FAKE_DELAY=str(delay), SQ_FAKE_LOG=str(tmp_path / "log.txt"))
    return env


def test_kill_9_mid_sweep_then_resume_runs_every_cell_exactly_once(tmp_path):
    grid = {"base": "snapmla_kv_only", "axes": {"nope_dtype": ["fp8_e4m3", "fp8_e5m2", "int8"],
                                                "scale_format": ["fp32", "pow2"]}}
    cfg = _write_cfg(tmp_path, presets=["bf16"], grid=grid)
    cmd = [sys.executable, "-m", "snapquant.cli", "sweep", str(cfg), "--evaluator", FAKE,
           "--no-progress"]
    env = _env(tmp_path, delay=0.5)
    cells_dir = tmp_path / "out" / "cells"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and len(list(cells_dir.glob("*.json"))) < 2:
        time.sleep(0.05)
    time.sleep(0.25)  # land inside the next cell's evaluation
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_at_kill = {p.stem for p in cells_dir.glob("*.json")}
    assert 2 <= len(done_at_kill) < 7, "the kill did not land mid-sweep"
    for p in cells_dir.glob("*.json"):
        assert is_valid_cell(json.loads(p.read_text()))
    out = subprocess.run(cmd, env=dict(env, SQ_FAKE_DELAY="0"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    files = {p.stem: json.loads(p.read_text()) for p in cells_dir.glob("*.json")}
    assert len(files) == 7 and all(is_valid_cell(d) for d in files.values())
    assert not list(cells_dir.glob(".tmp-*"))
    log = (tmp_path / "log.txt").read_text().split("\n")
    ends = [ln.split()[1] for ln in log if ln.startswith("end ")]
    starts = [ln.split()[1] for ln in log if ln.startswith("start ")]
    # finished cells were never evaluated again; every cell finished exactly once overall
    assert all(starts.count(c) == 1 for c in done_at_kill)
    assert sorted(set(ends)) == sorted(files)
    in_flight = [c for c in files if c not in done_at_kill and starts.count(c) == 2]
    assert len(in_flight) <= 1  # only the cell being evaluated at the kill ran twice
    assert all(starts.count(c) == 1 for c in files if c not in in_flight)
    assert all(ends.count(c) == 1 for c in files if c not in in_flight)
    assert "| bf16 (baseline)" in out.stdout  # the table is printed at the end


def test_cli_dry_run_and_validation_error(tmp_path):
    cfg = _write_cfg(tmp_path)
    base = [sys.executable, "-m", "snapquant.cli", "sweep", str(cfg), "--evaluator", FAKE]
    out = subprocess.run([*base, "--dry-run"], env=_env(tmp_path, 0), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "3 cells" in out.stdout and out.stdout.count("[todo]") == 3 and "(baseline)" in out.stdout
    assert not (tmp_path / "out").exists()
    bad = _write_cfg(tmp_path, presets=["snapmal"], tasks=["fake_q"])
    out = subprocess.run([*base[:4], str(bad), *base[5:], "--dry-run"], env=_env(tmp_path, 0),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "snapmal" in out.stderr and "fake_q" in out.stderr


# ---------------------------------------------------------------------- submitit
def test_submitit_local_executor_jobs_merge_into_one_results_dir(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SQ_FAKE_LOG", str(tmp_path / "log.txt"))
    spec = SweepSpec.from_dict(spec_dict(tmp_path, launcher={"executor": "local", "cells_per_job": 2,
                                                             "max_parallel": 2, "timeout_min": 5}))
    res = execute(spec, evaluator_path=FAKE, show_progress=False)
    assert not res.report.failed, res.report.failed
    assert len(res.jobs) == 2 and sorted(len(j.cell_ids) for j in res.jobs) == [1, 2]
    assert sorted(res.report.ran) == sorted(c.cell_id for c in res.report.cells)
    pids = {ln.split()[2] for ln in (tmp_path / "log.txt").read_text().splitlines() if ln.startswith("start")}
    assert len(pids) == 2  # two job processes, not this one
    assert str(os.getpid()) not in pids
    assert len(list((tmp_path / "out" / "cells").glob("*.json"))) == 3
    assert res.table is not None and len(res.table.cells) == 3 and res.files["markdown"].exists()
    # a second launch finds everything finished and submits nothing
    again = execute(spec, evaluator_path=FAKE, show_progress=False, report=False)
    assert again.jobs == [] and len(again.report.already_done) == 3
