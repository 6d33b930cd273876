"""Run-time guards shared by the decode backends, the kernels, the cache and the graph step.

When a length check may skip its host read:

    trusted_lengths()   a block inside which backends skip value checks of `lengths` that need a host
                        read (a device sync): the fixed-shape decode step (`snapquant.graphs.DecodeGraph`),
                        whose lengths come from the cache's own device counters, bounded on the host
    lengths_trusted()   True inside that block, or while the current CUDA stream is being captured
    stream_capturing()  True while the current CUDA stream is being captured into a graph

Where the host may not wait for the device:

    no_host_sync()          raise HostSyncError at any op that makes the host wait for the device (works on
                            CPU too, where it proves a code path free of them before it meets a GPU)
    allow_host_sync(reason) inside no_host_sync(), exempt a block documented never to run in a graph

A leaf module (torch and snapquant.errors only), so that the kernels, the attention seam, the cache and
the graph step can all use it without importing each other.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import HostSyncError

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


# ---------------------------------------------------------------------------------------------- no_host_sync
aten = torch.ops.aten

# Ops whose result size or value the host must read from the device (on CUDA each one waits for the stream).
_SYNC_OPS = {
    aten._local_scalar_dense: "reads a device value on the host (.item(), int(t), float(t), bool(t), if t: ...)",
    aten.is_nonzero: "reads a device value on the host (bool(t))",
    aten.item: "reads a device value on the host (.item())",
    aten.nonzero: "has a data-dependent output size (nonzero / torch.where(cond) / boolean indexing)",
    aten.masked_select: "has a data-dependent output size (boolean masking)",
    aten.equal: "returns a Python bool computed on the device (torch.equal)",
    aten.allclose: "returns a Python bool computed on the device (torch.allclose)",
    aten.unique_consecutive: "has a data-dependent output size",
    aten._unique2: "has a data-dependent output size",
    aten._unique: "has a data-dependent output size",
    aten.unique_dim: "has a data-dependent output size",
    aten.bincount: "sizes its output from the input's maximum",
}
_BOOL_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_HOST_READS = {"tolist": "copies the tensor to host Python objects (.tolist())",
               "numpy": "copies the tensor to host memory (.numpy())"}
_ALLOW = threading.local()


@contextmanager
def allow_host_sync(reason: str) -> Iterator[None]:
    """Inside `no_host_sync()`, let this block sync (for code documented never to run in a graph)."""
    stack = getattr(_ALLOW, "stack", None)
    if stack is None:
        stack = _ALLOW.stack = []
    stack.append(reason)
    try:
        yield
    finally:
        stack.pop()


def _allowed() -> bool:
    return bool(getattr(_ALLOW, "stack", None))


def _raise(what: str, why: str) -> None:
    raise HostSyncError(f"{what} {why}: a host-device sync inside no_host_sync() (not capturable in a CUDA graph)")


def _is_host(dev) -> bool:
    return dev is not None and torch.device(dev).type == "cpu"


class _NoSyncDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _allowed():
            packet = func.overloadpacket
            if packet in _SYNC_OPS:
                _raise(f"aten.{packet.__name__}", _SYNC_OPS[packet])
            if packet is aten.histc:
                lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
                hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
                if lo == hi:
                    _raise("aten.histc", "with min == max reads the input's range on the host")
            if packet in _BOOL_INDEX_OPS:
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                for i in indices or ():
                    if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                        _raise(f"aten.{packet.__name__}", "with a boolean mask index has a data-dependent size")
            if packet is aten._to_copy and isinstance(args[0], torch.Tensor):
                _check_transfer(args[0], kwargs.get("device"), bool(kwargs.get("non_blocking", False)), "_to_copy")
            if packet is aten.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
                _check_transfer(args[1], args[0].device, bool(args[2] if len(args) > 2 else
                                                             kwargs.get("non_blocking", False)), "copy_")
        return func(*args, **kwargs)


def _check_transfer(src: torch.Tensor, dst_device, non_blocking: bool, name: str) -> None:
    if dst_device is None:
        return
    dst = torch.device(dst_device)
    if src.device.type != "cpu" and dst.type == "cpu":
        _raise(f"aten.{name}", f"copies a {src.device.type} tensor to the host (.cpu() / .to('cpu') / .tolist())")
    if src.device.type == "cpu" and dst.type != "cpu" and not (non_blocking and src.is_pinned()):
        _raise(f"aten.{name}", f"copies pageable host memory to {dst.type} (synchronous; not capturable)")


class _NoSyncFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and not _allowed():
            _raise(f"Tensor.{name}()", _HOST_READS[name])
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise `HostSyncError` (naming the op) when code in this block would make the host wait for the device.

    Flags `.item()` / `int(t)` / `float(t)` / `bool(t)` (aten._local_scalar_dense, is_nonzero), ops with
    data-dependent output sizes (nonzero, masked_select, boolean-mask indexing, unique, bincount),
    torch.equal / torch.allclose, `.tolist()` / `.numpy()`, device-to-host copies (`.cpu()`, `.to('cpu')`)
    and synchronous host-to-device copies. On a CPU run every tensor is on the host, so value reads are
    flagged whatever the device (that is what makes a CPU test a proof for the GPU), while copies are
    flagged only when they cross devices. Blocks inside `allow_host_sync(reason)` are exempt.
    Not visible to the guard: `torch.tensor(data, device=cuda)` (its copy happens below the Python
    dispatch key) and syncs inside non-PyTorch code (Triton launches are host-side only).
    """
    with _NoSyncFunction(), _NoSyncDispatch():
        yield


WARNED: set[str] = set()
"""Messages `warn_once` has shown in this process (tests clear it to see a warning again)."""


def warn_once(msg: str, stacklevel: int = 3) -> None:
    """`warnings.warn(msg)` the first time this process sees `msg`: a backend that falls back on every
    decode step says so once, not once per step and layer."""
    if msg not in WARNED:
        WARNED.add(msg)
        warnings.warn(msg, stacklevel=stacklevel)
