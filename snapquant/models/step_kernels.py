"""The model's modules as the decode loop's fixed-shape steps run them, in one block (restored after).

    with step_kernels(model, fused=True) as info:   # info: {"norms": count switched, "rotary_mode": mode}
        ...

Sync-free experts (`models.experts.decode_experts`), the T5-style RMSNorms through the fused kernel
(`models.norms`) and DeepSeek-V2's rotary embedding through its kernel where it gives torch's bits
(`models.rotary`). `DecodeLoop` and the benchmarks' step tables enter the same block, so what they time is
what the loop runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .experts import decode_experts
from .norms import fused_rms_norms
from .rotary import fused_rotary


@contextmanager
def step_kernels(model: torch.nn.Module, *, experts: str | None = "auto", fused: bool = True) -> Iterator[dict[str, Any]]:
    """`experts`: the MoE implementation (see `decode_experts`; None keeps the model's); `fused`: the fused
    norm and rotary kernels (each switches only where it applies)."""
    with decode_experts(model, experts), fused_rms_norms(model, fused) as norms, \
            fused_rotary(model, fused) as rotary_mode:
        yield {"norms": norms, "rotary_mode": rotary_mode}
