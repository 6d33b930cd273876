"""The end of a pytest run carries no third-party teardown report (tests/support/teardown_filter.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.teardown_filter import drop_nanobind_leak_report

# What a Gluon compile left at exit with Triton 3.9 (27 lines; the link has no newline of its own).
REPORT = (
    "nanobind: leaked 4 instances!\n"
    + "".join(f' - leaked instance 0x7fdf80c530e{i} of type "triton._C.libtriton.ir.attribute"\n' for i in range(4))
    + "nanobind: leaked 7 types!\n"
    + "".join(f' - leaked type "{t}"\n' for t in ("triton._C.libtriton.gluon_ir.GluonOpBuilder",
                                                   "triton._C.libtriton.ir.builder", "PROPAGATE_NAN", "MEM_SEMANTIC",
                                                   "triton._C.libtriton.ir.attribute", "CACHE_MODIFIER",
                                                   "triton._C.libtriton.ir.value"))
    + "nanobind: leaked 326 functions!\n"
    + "".join(f' - leaked function "create_{i}"\n' for i in range(10))
    + " - ... skipped remainder\n"
    + "nanobind: this is likely caused by a reference counting issue in the binding code.\n"
    + "See https://nanobind.readthedocs.io/en/latest/refleaks.html"
).encode()


def test_only_the_report_lines_are_dropped():
    assert REPORT.count(b"\n") + 1 == 27
    kept = b"Fatal Python error: something real\n"
    assert drop_nanobind_leak_report(kept + REPORT + b"Exception ignored in: <x>\n") == kept + b"Exception ignored in: <x>\n"
    assert drop_nanobind_leak_report(REPORT) == b""
    assert drop_nanobind_leak_report(b"nanobind is a library\n") == b"nanobind is a library\n"


_LEAKY = """
import ctypes, sys
sys.path.insert(0, {tests!r})
import triton._C.libtriton as lt
ctypes.pythonapi.Py_IncRef(ctypes.py_object(lt.ir.context()))  # alive at exit: nanobind reports it
if {install}:
    from teardown_filter import install_if_triton_loaded
    install_if_triton_loaded()
print("kept on stderr", file=sys.stderr)
sys.exit(3)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the filter forks (Linux)")
@pytest.mark.parametrize("install", [False, True])
def test_process_exit_keeps_stderr_and_status_but_not_the_report(install):
    pytest.importorskip("triton")
    code = _LEAKY.format(tests=str(Path(__file__).parent / "support"), install=install)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert res.returncode == 3
    assert b"kept on stderr" in res.stderr
    assert (b"nanobind: leaked" in res.stderr) is not install, res.stderr.decode()[-500:]
