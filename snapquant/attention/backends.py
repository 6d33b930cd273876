"""The decode backend seam: a registry name -> callable with the signature of `mla_decode_reference`.

    fn(q [B,(S,)H,r+d], kv: QuantizedKV, lengths [B], softmax_scale, config, *, causal, round_16bit)
        -> (out [B,(S,)H,r] fp32, lse natural log)

`reference` is the exact PyTorch reference (any device). `triton` is `snapquant.kernels.triton_backend`
(paged FP8 kernels, CUDA), registered on first use (the kernels import nothing from here); without
triton installed, asking for `triton` raises a clear error. `auto` picks triton on CUDA when it is
registered and `supports(config)` is true, else the reference. `backend` is an argument of
`snapquant.patch`, never a config field (configs are hashed by sweeps).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import KVQuantConfig
from ..errors import ConfigError, unknown_choice
from ..reference import mla_decode_reference
from ..runtime import lengths_trusted, stream_capturing, trusted_lengths  # the guards, re-exported here

__all__ = ["BACKEND_CHOICES", "Backend", "check_backend_name", "lengths_trusted", "register_backend",
           "resolve_backend", "static_backend", "stream_capturing", "trusted_lengths"]

BACKEND_CHOICES = ("auto", "reference", "triton")


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    supports: Callable[[KVQuantConfig], bool] | None = None
    needs_cuda: bool = False


_REGISTRY: dict[str, Backend] = {"reference": Backend("reference", mla_decode_reference)}


def register_backend(name: str, fn: Callable, *, supports: Callable[[KVQuantConfig], bool] | None = None,
                     needs_cuda: bool = True) -> None:
    """Add (or replace) a decode backend; `supports(config)` says which configs it implements."""
    _REGISTRY[name] = Backend(name, fn, supports, needs_cuda)


_KERNELS_TRIED = False


def _load_kernels() -> None:
    """Register `triton` from snapquant.kernels once; without triton installed that fails quietly."""
    global _KERNELS_TRIED
    if "triton" in _REGISTRY or _KERNELS_TRIED:
        return
    _KERNELS_TRIED = True
    try:
        kernels = importlib.import_module("snapquant.kernels")
    except ImportError:
        return
    register_backend("triton", kernels.triton_backend, supports=kernels.supports, needs_cuda=True)


def check_backend_name(name: str) -> str:
    if name not in BACKEND_CHOICES:
        raise unknown_choice("backend", name, BACKEND_CHOICES)
    return name


def resolve_backend(name: str, config: KVQuantConfig, device: torch.device) -> Backend:
    """The backend that will run decode for `config` on `device` (raises a clear error when impossible)."""
    check_backend_name(name)
    if name == "reference":
        return _REGISTRY["reference"]
    _load_kernels()
    triton = _REGISTRY.get("triton")
    if name == "auto":
        if (triton is not None and device.type == "cuda"
                and (triton.supports is None or triton.supports(config))):
            return triton
        return _REGISTRY["reference"]
    # name == "triton": explicit request, so every reason it cannot run is an error.
    if triton is None:
        raise ConfigError(
            "backend='triton' is not available: snapquant.kernels has not registered a Triton MLA decode kernel "
            "(needs triton and a CUDA GPU); use backend='reference' or 'auto'"
        )
    if triton.needs_cuda and device.type != "cuda":
        raise ConfigError(f"backend='triton' needs a CUDA device, but the attention runs on {device}")
    if triton.supports is not None and not triton.supports(config):
        raise ConfigError(
            f"backend='triton' does not implement config {config.label()!r}; use backend='auto' to fall back "
            f"to the reference for it"
        )
    return triton


# ---------------------------------------------------------------------------------------------- static path
def static_backend(backend: Backend) -> Callable:
    """`backend.fn` as the fixed-shape decode step calls it: lengths trusted (no host-read checks).

    The reference backend validates lengths with a host read it has no switch for; it is never captured
    (DecodeGraph captures only the Triton backend: the reference also creates host constants per call),
    so that one read is allowed by `snapquant.graphs.no_host_sync` by name."""

    @functools.wraps(backend.fn)
    def call(*args, **kwargs):
        with trusted_lengths():
            if backend.name == "reference":
                from ..graphs import allow_host_sync

                with allow_host_sync("mla_decode_reference's lengths check (the reference is never captured)"):
                    return backend.fn(*args, **kwargs)
            return backend.fn(*args, **kwargs)

    return call
