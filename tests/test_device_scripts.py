"""The device scripts (scripts/*.sh) are run only on a lent GPU, in a few minutes per session; what can be
checked without one is checked here, so a session does not spend its device time finding it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_script_parses(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_env_script_is_sourced_inside_a_pipeline(script):
    """`source x.sh | tee log` runs in a subshell: x.sh's exports (PYTHONPATH to FlashMLA or the carried
    lm-eval wheels) vanish, and every later step silently runs without them."""
    bad = [ln for ln in script.read_text().splitlines()
           if re.match(r"\s*(source|\.)\s+\S+\.sh\b[^#]*\|", ln) and not ln.lstrip().startswith("#")]
    assert not bad, f"{script.name}: sourced in a pipeline: {bad}"


def test_sourcing_the_wheel_env_exports_to_the_caller(tmp_path):
    """wheels_env.sh, sourced, must leave /tmp/site on the caller's PYTHONPATH when wheels are present."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / ".whl").mkdir()
    out = subprocess.run(["bash", "-c", f"cd {tmp_path} && python3() {{ :; }}; export -f python3; "
                          f"PYTHONPATH=/x; touch .whl/a-1-py3-none-any.whl; source {root}/scripts/wheels_env.sh; "
                          "echo $PYTHONPATH"], capture_output=True, text=True)
    assert out.stdout.strip().endswith(":/tmp/site"), out


def test_eval_case_7_smoke_runs_every_part_into_out_only(tmp_path):
    """`SMOKE=1 device_eval.sh 7`: the end-to-end and the 32K loop rows on the tiny model, written under $OUT;
    the committed H200 / H100 tables stay untouched."""
    import json
    import os

    root = Path(__file__).resolve().parents[1]
    tables = sorted(root.glob("results/bench/eval_h200.*")) + sorted(root.glob("results/h100/eval_h100.*")) + sorted(root.glob("results/h100/eval_e2e_h100.*"))
    before = {p: p.stat().st_mtime_ns for p in tables}
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "CASE_S": "240", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", "scripts/device_eval.sh", "7"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert "case 7 done" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    # (a smoke run starts its table afresh, so the second part's file holds its rows; the first part's are in its log)
    logged = [json.loads(ln.split("] ", 1)[1]) for ln in (tmp_path / "eval_part7a.log").read_text().splitlines()
              if ln.startswith("[") and "] {" in ln]
    rows = logged + json.loads((tmp_path / "eval_smoke7.json").read_text())["rows"]
    assert {(r["path"], r["preset"], r["batch"]) for r in rows if r.get("status") == "ok"} == {
        ("lmeval", "bf16", 128), ("lmeval", "snapmla", 128), ("lmeval", "bf16", 32), ("lmeval", "snapmla", 32),
        ("loop", "bf16", 32), ("loop", "snapmla", 32)}
    assert {p: p.stat().st_mtime_ns for p in tables} == before


DEVICE_SCRIPTS = [p for p in SCRIPTS if p.name.startswith("device_")]


@pytest.mark.parametrize("script", DEVICE_SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("commit", ["", "ref: refs/heads/main", "bd41308"])
def test_device_script_stops_without_the_full_commit_hash(script, commit, tmp_path):
    """Every device script records the commit of its results from SNAPQUANT_GIT_COMMIT (the device's copy of the
    tree can carry stale git metadata, which once labelled a session's results with an older commit): without a
    full 40-character hash it stops at once, exit 2, naming the variable, before it writes or runs anything."""
    import os

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("SNAPQUANT_GIT_COMMIT", "SMOKE")}
    env.update(SNAPQUANT_GIT_COMMIT=commit, OUT=str(tmp_path / "out"))
    out = subprocess.run(["bash", str(script.relative_to(root))], cwd=root, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "SNAPQUANT_GIT_COMMIT must be the full 40-character hash" in out.stderr, out
    assert not (tmp_path / "out").exists()
