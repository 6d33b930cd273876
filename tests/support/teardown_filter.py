"""Keep Triton's nanobind leak report out of the end of a pytest run (used by conftest.py).

Compiling a Gluon kernel whose code uses shared memory through Triton's frontend (a Triton cache miss,
so always on a fresh CI machine; our sm_90 compile tests do it on the CPU) leaves libtriton's
GluonOpBuilder type alive at interpreter exit in Triton 3.9, and nanobind then prints ~27 lines
("nanobind: leaked 4 instances! ... leaked type ... leaked function ...") after pytest's summary. A
15-line Gluon kernel with one shared-memory buffer reproduces it without snapquant; Triton silences
the same report in its own compile workers (triton/_compile_warmup_pool.py) by sending stderr to
/dev/null at exit. Here only the report's own lines are dropped: everything else the process writes
while it shuts down (a faulthandler trace, "Exception ignored in ...") still reaches stderr, and the
exit status is untouched.
"""

from __future__ import annotations

import atexit
import os
import sys

_REPORT_PREFIXES = (b"nanobind: leaked ", b" - leaked ", b" - ... skipped remainder",
                    b"nanobind: this is likely caused by a reference counting")
_REPORT_LINK = b"See https://nanobind.readthedocs.io/en/latest/refleaks.html"  # printed without a newline


def drop_nanobind_leak_report(data: bytes) -> bytes:
    """`data` without the lines of nanobind's leak report (its trailing link may run into the next line)."""
    out = []
    for line in data.splitlines(keepends=True):
        if line.startswith(_REPORT_PREFIXES):
            continue
        if line.startswith(_REPORT_LINK):
            line = line[len(_REPORT_LINK):]
            if not line:
                continue
        out.append(line)
    return b"".join(out)


def _route_stderr_through_filter() -> None:
    """From now on fd 2 goes through a forked copy of this process that drops the report on EOF."""
    try:
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        pid = os.fork()
    except OSError:
        return
    if pid == 0:  # the filter: read until the parent (the only writer left) has exited
        try:
            os.close(write_end)
            chunks = []
            while chunk := os.read(read_end, 1 << 16):
                chunks.append(chunk)
            data = drop_nanobind_leak_report(b"".join(chunks))
            while data:
                data = data[os.write(2, data):]
        finally:
            os._exit(0)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)


def install_if_triton_loaded() -> None:
    """Filter the teardown's stderr when libtriton is loaded (Linux, where fork is safe to use here).
    Registered late, so the filter is in place before the other exit handlers and the teardown run."""
    if "triton._C.libtriton" in sys.modules and sys.platform.startswith("linux") and hasattr(os, "fork"):
        atexit.register(_route_stderr_through_filter)
