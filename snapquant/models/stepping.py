"""Driving a Hugging Face causal LM one token at a time: the one step-by-step decode loop.

transformers >= 5.2x names the forward's cache argument `cache` and returns the cache under that
key; 5.15-5.1x call both `past_key_values`. These helpers hide the difference:

    cache_kwarg(model)       the name of the forward's cache argument
    output_cache(out)        the cache a forward returned
    decode_step(...)         one forward of one token per row at a given position, through a cache
    decode_steps(...)        prefill a prompt, then one token per step (teacher-forced or greedy)

Fidelity's step-by-step decode, the end-to-end decode benchmark and the memory / throughput
experiment all step through these, so the calling convention lives in one place.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError


@functools.lru_cache(maxsize=64)
def _cache_kwarg_of(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_kwarg(model: Any) -> str:
    """'cache' (transformers >= 5.2x) or 'past_key_values' (5.15-5.1x): how `model.forward` takes its cache."""
    forward = model.__dict__.get("forward")  # an instance-level wrapper, if any, has the final say
    return _cache_kwarg_of(forward if forward is not None else type(model).forward)


def output_cache(out: Any) -> Any:
    """The cache a forward returned: `cache` from transformers 5.2x, `past_key_values` before."""
    keys = out.keys() if hasattr(out, "keys") else ()
    if "cache" in keys:
        return out["cache"]
    return out["past_key_values"] if "past_key_values" in keys else None


def decode_step(model: Any, tokens: torch.Tensor, position: int | torch.Tensor, cache: Any) -> Any:
    """One forward of `tokens` [B, 1] at sequence position `position` (an int for every row, or the
    [B, 1] position_ids), reading and extending `cache`; returns the model output
    (`output_cache(out)` is the cache to pass next)."""
    pos = position if isinstance(position, torch.Tensor) else torch.full(
        (tokens.shape[0], 1), position, dtype=torch.long, device=tokens.device)
    return model(input_ids=tokens, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})


@torch.no_grad()
def decode_steps(model: Any, ids: torch.Tensor, prompt_len: int | None = None, *, cache: Any = None,
                 greedy_steps: int | None = None) -> Iterator[Any]:
    """Prefill `ids[:, :prompt_len]` (through `cache` when given), then decode one token per step.

    Yields the model output of every forward pass: first the prefill's, then one per step.
    Teacher forcing (the default) feeds the rest of `ids` itself: the step at position t consumes
    ids[:, t] for t = prompt_len .. T-2, so its logits predict ids[:, t + 1]. With `greedy_steps=n`
    it feeds n tokens instead, each the argmax of the previous output (prompt_len defaults to T).
    The next token is chosen before each output is yielded, so a caller timing the gap between
    two outputs times the forward pass alone.
    """
    N, T = ids.shape
    prompt_len = T if prompt_len is None else prompt_len
    teacher = greedy_steps is None
    if not 0 < prompt_len <= T or (teacher and prompt_len >= T - 1):
        raise ConfigError(f"prompt_len={prompt_len} must be in [1, {T - 2 if teacher else T}] for sequences of "
                          f"{T} tokens")
    extra = {cache_kwarg(model): cache} if cache is not None else {}
    out = model(input_ids=ids[:, :prompt_len], use_cache=True, **extra)
    positions = range(prompt_len, T - 1) if teacher else range(prompt_len, prompt_len + greedy_steps)
    for t in positions:
        tokens = ids[:, t:t + 1] if teacher else out.logits[:, -1:].argmax(-1)
        pos = torch.full((N, 1), t, dtype=torch.long, device=ids.device)
        cache = output_cache(out)
        yield out
        out = decode_step(model, tokens, pos, cache)
    yield out
