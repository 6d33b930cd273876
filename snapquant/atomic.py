"""Atomic file writes: readers see the old file or the complete new one, never a partial write.

Every file snapquant writes (results JSON, tables, CSVs, figures, data shards) goes through here:
write a uniquely named temp file in the target's directory, flush + fsync it, `os.replace` it
over the target (atomic on POSIX within one file system), then fsync the directory so the rename
itself survives a crash. A kill -9 at any moment leaves the old state or the complete new file,
plus at worst a stray `.tmp-*` file (`ResultStore.clean_temp` removes those in results dirs).

Permissions: `tempfile.mkstemp` creates files 0600. The final file instead gets the mode a plain
`open(path, "w")` of a new file gets, 0666 minus the process umask, so results in a shared
directory are as readable as anything else the user writes there (umask 022 -> 0644).

Stdlib only, so a writer process can load this file on its own and start in milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TMP_PREFIX = ".tmp-"
"""Name prefix of in-flight temp files (hidden, and never ending in the target's suffix)."""

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:  # os.umask can only be read by setting it: set it straight back
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """A file object for `path` that replaces it atomically when the block exits without error.

    `mode` is "w" (text) or "wb" (bytes). On any exception (or KeyboardInterrupt) the temp file is
    removed and `path` keeps its old content.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode={mode!r}; allowed: 'w', 'wb'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        _chmod_fd(fd, tmp, 0o666 & ~current_umask())
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically; returns `path`."""
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically; returns `path`."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 1, **dumps_kwargs: Any) -> Path:
    """`json.dumps(obj, indent=indent, **dumps_kwargs)` plus a newline, written atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, **dumps_kwargs) + "\n")


def atomic_write_csv(path: str | Path, frame: Any, **to_csv_kwargs: Any) -> Path:
    """A pandas DataFrame as CSV (`index=False` unless given), written atomically."""
    to_csv_kwargs.setdefault("index", False)
    return atomic_write_text(path, frame.to_csv(**to_csv_kwargs))


def atomic_save_figure(fig: Any, path: str | Path, **savefig_kwargs: Any) -> Path:
    """`fig.savefig` into a buffer (format from the suffix unless given), then an atomic write."""
    path = Path(path)
    savefig_kwargs.setdefault("format", path.suffix.lstrip(".") or None)
    buf = io.BytesIO()
    fig.savefig(buf, **savefig_kwargs)
    return atomic_write_bytes(path, buf.getvalue())


def _chmod_fd(fd: int, name: str, mode: int) -> None:
    if hasattr(os, "fchmod"):
        os.fchmod(fd, mode)
    else:  # pragma: no cover - Windows before Python 3.13
        os.chmod(name, mode)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
