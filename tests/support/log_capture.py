"""Capture what transformers logs (no tests here).

transformers logs through its own `transformers` logger, which does not propagate to the root logger
that pytest's caplog listens on, so tests that check a message is (not) printed attach a handler to it.
Messages logged with `warning_once` are cached per process: `fresh_warning_once()` clears that cache so
an earlier test cannot hide one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def transformers_warnings() -> Iterator[list[str]]:
    """Yields the list of warning messages transformers logs inside the block."""
    logger = logging.getLogger("transformers")
    handler = _Collect()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def fresh_warning_once() -> None:
    cached = getattr(logging.Logger, "warning_once", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
