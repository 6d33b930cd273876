"""DeepSeek-V2's rotary embedding through one Triton kernel while a block runs (`kernels/triton/rotary.py`).

transformers' DeepSeek-V2 attention calls its module's `apply_rotary_emb` (complex products in fp32) by name:
six small kernels per layer and decode step. `fused_rotary(model)` points that name, for the families of
`model`'s MLA attentions that define it, at a wrapper that runs the one-launch kernel on CUDA, and restores it
after. It switches only where the kernel gives torch's bits: on the model's device and dtype, a probe input of
~2M pairs (enough that the fma contractions the compiler may have chosen differ on some) is rotated by the
module's own function and by each contraction mode of the kernel, and the first mode equal bit for bit is
used; none equal (or a module whose function is not transformers' expression), nothing switches. Families
whose RoPE is a cos / sin rotation (DeepSeek-V3, Kimi, ...) keep theirs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..runtime import allow_host_sync, warn_once

NAME = "apply_rotary_emb"
# 2.2M channel pairs of query and key, one token per request in the decode step's layout, so that the probe
# and the step share one compiled specialization of the kernel (Triton specializes S == 1 and strides)
_PROBE = dict(B=4096, H=16, S=1, D=64)
_MODES: dict[tuple, tuple[int, int] | None] = {}  # (function, device, dtype) -> the matching mode


def _modules_with_rotary(model: torch.nn.Module) -> list[Any]:
    from .registry import find_mla_modules

    seen, out = set(), []
    for _, module, _ in find_mla_modules(model):
        mod = sys.modules.get(type(module).__module__)
        if mod is not None and callable(getattr(mod, NAME, None)) and mod.__name__ not in seen:
            seen.add(mod.__name__)
            out.append(mod)
    return out


def _probe(device: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    B, H, S, D = _PROBE.values()
    q = torch.randn(B, S, H, D + 128, generator=g).to(dtype).transpose(1, 2)[..., 128:]  # a channel slice, as HF's
    k = torch.randn(B, 1, S, D, generator=g).to(dtype)
    pos = torch.randint(0, 1 << 17, (B, S), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = torch.polar(torch.ones(B, S, D // 2), pos[..., None] * inv)
    return q.to(device), k.to(device), f.to(device)


def matching_mode(fn: Any, device: torch.device, dtype: torch.dtype) -> tuple[int, int] | None:
    """The kernel's contraction mode whose bits equal `fn`'s (a module's apply_rotary_emb) on the probe, or None
    (probed once per function, device and dtype; the modes tried in MODES' order, the first equal kept)."""
    key = (fn, device.type, device.index, dtype)
    if key not in _MODES:
        try:
            with allow_host_sync("the fused rotary kernel's one-off bit check"):
                _MODES[key] = _probe_modes(fn, device, dtype)
        except Exception as e:  # a kernel that fails to compile or run here: torch's operations stay
            warn_once(f"snapquant: the fused rotary kernel failed on {device} ({type(e).__name__}: {e}); "
                      f"keeping transformers' apply_rotary_emb")
            _MODES[key] = None
    return _MODES[key]


def _probe_modes(fn: Any, device: torch.device, dtype: torch.dtype) -> tuple[int, int] | None:
    from ..kernels.triton.rotary import MODES, rotary_fused, rotary_reason

    q, k, f = _probe(device, dtype)
    if rotary_reason(q, k, f) is not None:
        return None
    want_q, want_k = fn(q, k, f)
    for mode in MODES:
        got_q, got_k = rotary_fused(q, k, f, mode)
        if torch.equal(got_q, want_q) and torch.equal(got_k, want_k):
            return mode
    return None


@contextmanager
def fused_rotary(model: torch.nn.Module, enabled: bool = True) -> Iterator[tuple[int, int] | None]:
    """Inside the block, the model's DeepSeek-V2-style `apply_rotary_emb` runs the fused kernel where it gives
    torch's bits on the model's device and dtype; yields the contraction mode used (None: nothing switched)."""
    switched: list[tuple[Any, Any]] = []
    mode = None
    param = next(model.parameters(), None)
    if enabled and param is not None and param.is_cuda:
        for mod in _modules_with_rotary(model):
            original = getattr(mod, NAME)
            if getattr(original, "_snapquant_fused", False):
                continue  # an enclosing block switched it already
            mode = matching_mode(original, param.device, param.dtype)
            if mode is None:
                continue
            setattr(mod, NAME, _wrapper(original, mode))
            switched.append((mod, original))
    try:
        yield mode if switched else None
    finally:
        for mod, original in switched:
            setattr(mod, NAME, original)


def _wrapper(original: Any, mode: tuple[int, int]) -> Any:
    from ..kernels.triton.rotary import rotary_fused, rotary_reason

    def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
        if rotary_reason(xq, xk, freqs_cis) is None:
            return rotary_fused(xq, xk, freqs_cis, mode)
        return original(xq, xk, freqs_cis)

    apply_rotary_emb._snapquant_fused = True
    return apply_rotary_emb
