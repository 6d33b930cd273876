"""What the compiler makes of each benchmark decode variant at a benchmark shape, without a GPU.

`decode_compile_stats(variant, shape)` builds the variant's plan over meta tensors of the shape and
compiles it with `snapquant.kernels.compile_stats` (whose docstring lists what each column means);
`snapquant bench --compile-stats` writes the rows as compile_stats_<tag>.csv.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.compile_stats import compile_launch, kernel_stats, loop_mix, plan_compile_stats, tile_loads
from .shapes import DecodeShape
from .variants import Variant

__all__ = ["compile_launch", "decode_compile_stats", "kernel_stats", "loop_mix", "tile_loads"]


def decode_compile_stats(v: Variant, shape: DecodeShape, *, arch: int = 90, num_sms: int = 132,
                         r: int = 512, d: int = 64) -> list[dict[str, Any]]:
    """Compile every kernel of `v`'s plan at `shape` for `arch`; one dict per kernel."""
    from ..kernels import PagedMLACache
    from ..kernels.decode import plan_decode
    from ..kernels.operands import KernelOperands

    if v.impl != "kernel":
        return []
    cfg = v.config()
    cache = PagedMLACache.empty(shape.batch, shape.max_len, r, d, cfg, device="meta")
    q = torch.empty(shape.batch, shape.q_tokens, shape.heads, r + d, dtype=torch.bfloat16, device="meta")
    plan = plan_decode(q, KernelOperands.from_paged(cache), 0.07, cfg, native=True, num_sms=num_sms,
                       **v.kernel_kwargs(shape, num_sms))
    return [{"variant": v.name, "shape": shape.name, **row} for row in plan_compile_stats(plan, arch)]
