"""scripts/probe_step_parts.py on CPU (--smoke): every part runs and the two expert layouts agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_probe_smoke_writes_every_part(tmp_path):
    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, str(ROOT / "scripts/probe_step_parts.py"), "--smoke", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    parts = {r["part"] for r in rows}
    assert parts == {"read_bandwidth", "experts", "prefill_sdpa"}
    experts = [r for r in rows if r["part"] == "experts"]
    assert {r["b_layout"] for r in experts} == {"hf_view", "kn_contiguous"}
    assert all(r["equal_to_hf_view"] and r["ms"] > 0 for r in experts)
    sdpa = [r for r in rows if r["part"] == "prefill_sdpa"]
    assert all(("ms" in r) != ("error" in r) for r in sdpa)
    assert any("ms" in r for r in sdpa if r["backend"] == "default")
