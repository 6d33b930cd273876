"""The research-model script end to end at toy size on CPU (every stage, plots and card)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_research_model_smoke(tmp_path):
    state = tmp_path / "state"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_research_model.py"), "all", "--smoke", "--state", str(state),
           "--budget-s", "1800"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={"PYTHONPATH": str(ROOT),
                                                                                 "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = state / "results"
    for name in ("data_manifest_summary.json", "training_info.json", "eval.json", "study.json", "analyses.json",
                 "README.md", "study_cache_outliers.png", "analyses_kl.png", "analyses_long_context.png"):
        assert (out / name).is_file(), name
    an = json.loads((out / "analyses.json").read_text())
    assert an["complete"], sorted(an["parts"])
    assert an["parts"]["agreement"]["ran"] is False  # no CUDA here: said so, not skipped silently
    # Resumable: a second run skips every finished stage.
    res2 = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(ROOT),
                                                                                "PATH": "/usr/bin:/bin"})
    assert res2.returncode == 0 and "data_skip" in res2.stdout and "train_skip" in res2.stdout
    # The card alone re-renders from the result files, with what the model can and cannot show.
    (out / "README.md").unlink()
    res3 = subprocess.run([*cmd[:2], "card", *cmd[3:]], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res3.returncode == 0, res3.stderr[-2000:]
    card = (out / "README.md").read_text()
    assert "## What this model can and cannot show" in card and "- Activations: RoPE key absmax" in card


def test_device_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "device_research.sh")]).returncode == 0
