"""`snapquant.environment`: the one record of what produced a result (versions, hardware, commit)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

from snapquant import environment as env_mod
from snapquant.environment import device_environment, environment, git_commit

REPO = Path(__file__).resolve().parents[1]


def _head() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10)
    except OSError:
        return None
    return out.stdout.strip() or None


def test_git_commit_is_head_unless_overridden(monkeypatch):
    monkeypatch.delenv("SNAPQUANT_GIT_COMMIT", raising=False)
    assert git_commit() == _head()
    monkeypatch.setenv("SNAPQUANT_GIT_COMMIT", "f" * 40)  # a copied tree whose .git is stale
    assert git_commit() == "f" * 40


def test_every_record_carries_the_commit_versions_and_hardware(monkeypatch):
    monkeypatch.setenv("SNAPQUANT_GIT_COMMIT", "a" * 40)
    rec = environment()
    assert rec["git_commit"] == "a" * 40
    assert rec["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert rec["hardware"]["cpu_count"] and "gpus" in rec["hardware"]
    flat = device_environment(torch.device("cpu"))
    # what the benchmark summaries and the kernel check print from it
    for key in ("date", "device", "torch", "triton", "transformers", "cuda", "python", "git_commit"):
        assert key in flat, key
    assert flat["device"] == "cpu" and flat["git_commit"] == "a" * 40 and "gpu" not in flat


def test_no_other_module_defines_its_own_environment_record():
    """The sweep, the benchmarks, the experiments and the scripts all take their record from here."""
    defined = []
    for sub in ("snapquant", "scripts", "experiments"):
        for f in sorted((REPO / sub).rglob("*.py")):
            text = f.read_text(encoding="utf-8")
            if f.resolve() != Path(env_mod.__file__).resolve() and (
                    "def environment(" in text or "def git_commit(" in text
                    # asking git for HEAD (resolving any other revision, as the staleness check does, is fine)
                    or re.search(r'"rev-parse"[^\n)]*"HEAD"', text)):
                defined.append(f.relative_to(REPO).as_posix())
    assert defined == []
