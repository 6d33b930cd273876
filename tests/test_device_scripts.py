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
