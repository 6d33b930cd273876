"""RMSNorm modules of a model run by one Triton kernel each inside a block, then restored.

    with fused_rms_norms(model) as n:       # n = how many norm modules now run the fused kernel
        ...                                  # prefill and captured decode steps

A module is switched only if it behaves as transformers' T5-style RMSNorm (the DeepSeek families' norm:
fp32 statistics, result rounded to the hidden dtype before the weight): its own forward and
`kernels.triton.rms_norm.rms_norm_reference` give the same bits on a probe input on its device. Norms
of other forms ((1 + weight), no weight, fp32 output before the weight) keep their own forward.

The kernel's outputs can differ from torch's by one rounding of the hidden dtype in rare elements (its
fp32 sum runs in a different order; see the kernel module), so the decode loop uses it only where it
already differs from HF generate by bf16 rounding: fixed-shape steps on CUDA (`DecodeLoop(fused_norms=
"auto")`). `plan_fused_norms` says why it is off elsewhere.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _eps(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def candidate_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules named like an RMSNorm with a 1-D weight and a float epsilon."""
    found = []
    for module in model.modules():
        w = getattr(module, "weight", None)
        if ("RMSNorm" in type(module).__name__ and isinstance(w, torch.Tensor) and w.dim() == 1
                and _eps(module) is not None):
            found.append(module)
    return found


@torch.no_grad()
def behaves_as_reference(module: torch.nn.Module) -> bool:
    """True when the module's own forward equals the T5-style expression bit for bit on a probe input."""
    from ..kernels.triton.rms_norm import rms_norm_reference, unsupported_reason

    w = module.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    probe = (torch.randn(3, w.shape[0], generator=g) * 2).to(device=w.device, dtype=w.dtype)
    if unsupported_reason(probe, w) is not None:
        return False
    try:
        own = module(probe)
    except (TypeError, RuntimeError, ValueError):  # another signature or form: not this norm
        return False
    ref = rms_norm_reference(probe, w, _eps(module))
    return isinstance(own, torch.Tensor) and own.dtype == ref.dtype and torch.equal(own, ref)


def _fused_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    from ..kernels.triton.rms_norm import rms_norm

    return rms_norm(hidden_states, self.weight, self._snapquant_eps)


@contextmanager
def fused_rms_norms(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Inside the block, every T5-style RMSNorm of `model` runs `kernels.triton.rms_norm`; yields their count."""
    switched: list[torch.nn.Module] = []
    if enabled:
        for module in candidate_norms(model):
            if "forward" not in module.__dict__ and behaves_as_reference(module):
                module._snapquant_eps = _eps(module)
                module.forward = types.MethodType(_fused_forward, module)
                switched.append(module)
    try:
        yield len(switched)
    finally:
        for module in switched:
            del module.forward
            del module._snapquant_eps


def plan_fused_norms(device: torch.device, steps: str, requested: bool | str) -> tuple[bool, str]:
    """(use the fused norms, why) for a decode loop on `device` with `steps` ('graph' | 'static' | 'eager')."""
    if requested is True:
        return True, "requested"
    if requested is False:
        return False, "not requested"
    if requested != "auto":
        raise ValueError(f"fused_norms must be True, False or 'auto', got {requested!r}")
    if device.type != "cuda":
        return False, f"auto: the model is on {device.type} (the kernel runs compiled on CUDA only)"
    if steps == "eager":
        return False, "auto: eager steps keep HF's own forward"
    return True, "auto: CUDA fixed-shape steps"
