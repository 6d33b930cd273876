"""lm-eval integration: `SnapquantLM`, an HFLM that evaluates a model through the quantized latent cache."""

from __future__ import annotations

from typing import Any

__all__ = ["SnapquantLM"]


def __getattr__(name: str) -> Any:
    # lm-eval (and through it torch/transformers) is heavy: import it on first use only.
    if name == "SnapquantLM":
        from .lm import SnapquantLM

        return SnapquantLM
    raise AttributeError(name)
