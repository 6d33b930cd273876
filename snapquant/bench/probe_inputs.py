"""Raw-code decode inputs for the kernel probes (`scripts/probe_*.py`, `scripts/trace_native8.py`).

The probes time kernels, not quantization, so they fill a cache's storage directly: random finite e4m3
codes of either sign (0x7f / 0xff are NaN), token scales in [0.001, 0.01], random RoPE rows, every
request full. The harness (`harness.py`) builds its inputs by quantizing instead.
"""

from __future__ import annotations

import torch

from .. import PRESETS
from ..kernels import PagedMLACache


def random_snapmla_cache(B: int, L: int, r: int = 512, d: int = 64, device: str = "cuda") -> PagedMLACache:
    """A snapmla-layout cache of B requests of L tokens with random finite codes (torch's global RNG)."""
    cache = PagedMLACache.empty(B, L, r, d, PRESETS["snapmla"], device=device)
    codes = torch.randint(0, 0x7F, cache.latent.shape, device=device, dtype=torch.uint8)
    codes |= torch.randint(0, 2, cache.latent.shape, device=device, dtype=torch.uint8) << 7
    cache.latent.view(torch.uint8).copy_(codes)
    cache.scale.uniform_(0.001, 0.01)
    cache.rope.copy_(torch.randn(cache.rope.shape, device=device).to(cache.rope.dtype))
    cache.lengths.fill_(L)
    return cache


def random_bf16_cache(B: int, L: int, r: int = 512, d: int = 64, device: str = "cuda",
                      rope: torch.Tensor | None = None) -> PagedMLACache:
    """A bf16-layout cache of B full requests of L tokens, random latent rows; RoPE rows copied from
    `rope` (e.g. the snapmla cache's, so both formats see the same positions) or random."""
    cache = PagedMLACache.empty(B, L, r, d, PRESETS["bf16"], device=device)
    cache.latent.copy_(torch.randn_like(cache.latent, dtype=torch.float32).to(cache.latent.dtype))
    cache.rope.copy_(rope if rope is not None else torch.randn(cache.rope.shape, device=device).to(cache.rope.dtype))
    cache.lengths.fill_(L)
    return cache
