"""Input validation shared by the launchers: every problem is a ValueError naming the argument,
raised before any launch (a bad index inside a kernel would be a CUDA fault, not an error)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ShapeError


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: int | Sequence[int],
    device: torch.device | None = None,
    last_contiguous: bool = True,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if t.dim() not in ndims:
        want = " or ".join(f"{n}-d" for n in ndims)
        raise ShapeError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ShapeError(f"{name} has dtype {t.dtype}; expected {' or '.join(str(d) for d in dtypes)}")
    if device is not None and t.device != device:
        raise ShapeError(f"{name} is on {t.device} but the paged cache is on {device}")
    if last_contiguous and t.numel() and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ShapeError(
            f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}; call .contiguous()"
        )
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], what: str = "") -> None:
    """`expected` entries of None match anything."""
    ok = t.dim() == len(expected) and all(e is None or s == e for s, e in zip(t.shape, expected, strict=True))
    if not ok:
        shown = ", ".join("*" if e is None else str(e) for e in expected)
        raise ShapeError(f"{name} must have shape [{shown}]{what}, got {tuple(t.shape)}")


def raise_on_flags(flags: torch.Tensor, messages: Sequence[str]) -> None:
    """One device sync for several value checks: flags[i] true -> raise messages[i]."""
    for bad, msg in zip(flags.tolist(), messages, strict=True):
        if bad:
            raise ShapeError(msg)
