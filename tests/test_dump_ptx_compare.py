"""scripts/dump_ptx.py --compare: identical, identical up to debug info, up to a renamed kernel, different."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASE = """.version 8.7
.target sm_90a
.visible .entry {name}(
\t.param .u64 {name}_param_0
)
{{
\t.file\t1 "{path}"
\t.loc\t1 {line} 0
\tld.param.u64 \t%rd1, [{name}_param_0];  // {pad}
\t{op} \t%r1, %r2, %r3;
\tret;
}}
\t.section\t.debug_abbrev
"""


def _ptx(name="kern", path="/a/k.py", line=10, op="add.s32"):
    return BASE.format(name=name, path=path, line=line, op=op, pad=" " * len(name) + "c")


def test_compare_classes_and_exit_status(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    cases = {"same": (_ptx(), _ptx()), "debug": (_ptx(), _ptx(path="/b/k.py", line=12)),
             "renamed": (_ptx(name="_kern"), _ptx(name="kern", path="/b/k.py")),
             "changed": (_ptx(), _ptx(op="sub.s32"))}
    for name, (a, b) in cases.items():
        (before / f"{name}.ptx").write_text(a)
        (after / f"{name}.ptx").write_text(b)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "dump_ptx.py"), "--compare", str(before), str(after)],
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert counts == {"identical": 1, "identical_without_debug_info": 1, "identical_but_kernel_name": 1,
                      "different": 1, "missing": 0}
    assert res.returncode == 1 and "DIFFERENT  changed.ptx" in res.stdout
    (before / "changed.ptx").unlink()
    (after / "changed.ptx").unlink()
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "dump_ptx.py"), "--compare", str(before), str(after)],
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stdout + res.stderr
