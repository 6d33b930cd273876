"""Run-time guards shared by the decode backends and the kernels: when a length check may skip its host read.

    trusted_lengths()   a block inside which backends skip value checks of `lengths` that need a host
                        read (a device sync): the fixed-shape decode step (`snapquant.graphs.DecodeGraph`),
                        whose lengths come from the cache's own device counters, bounded on the host
    lengths_trusted()   True inside that block, or while the current CUDA stream is being captured
    stream_capturing()  True while the current CUDA stream is being captured into a graph

A leaf module (torch only), so that the kernels can ask without importing the attention seam.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_TRUST = threading.local()


@contextmanager
def trusted_lengths() -> Iterator[None]:
    """Within this block, backends skip value checks of `lengths` that need a host read (a device sync)."""
    depth = getattr(_TRUST, "depth", 0)
    _TRUST.depth = depth + 1
    try:
        yield
    finally:
        _TRUST.depth = depth


def lengths_trusted() -> bool:
    """True inside `trusted_lengths()` or while the current CUDA stream is being captured into a graph."""
    if getattr(_TRUST, "depth", 0):
        return True
    return stream_capturing()


def stream_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
