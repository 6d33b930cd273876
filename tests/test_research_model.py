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
    cur = json.loads((out / "training_info.json").read_text())["curriculum"]
    assert cur["short_seq_len"] == 256 and 0 < cur["long_from_step"] <= 8, cur  # both row lengths trained
    tasks = json.loads((out / "eval.json").read_text())["models"]["research"]["tasks"]
    assert {"sq_code_completion_mc", "sq_passkey:passkey_digits=5,passkey_distractors=0,max_seq_lengths=512"} <= set(tasks)
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


def test_length_curriculum_plan_fills_the_time():
    """The planned steps spend exactly the measured time: short steps then the long share at its cost."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_research_model import RESEARCH_ARCH, plan_steps, step_cost

    kappa = step_cost(RESEARCH_ARCH, 229_000_000, 8192) / step_cost(RESEARCH_ARCH, 229_000_000, 2048)
    assert 1.2 < kappa < 3.0  # attention is a large but not dominant share of an 8K row's cost
    for done, units, f in ((5, 1000.0, 0.3), (0, 400.0, 0.5), (40, 10.0, 0.0)):
        total = plan_steps(done, units, f, kappa)
        spent = ((1 - f) * total - done) + f * total * kappa
        assert units - 2 * kappa <= spent <= units + 1e-9, (done, units, f, total, spent)
