"""Decode plans for a GPU target built over meta tensors, and what the compiler makes of them, for the kernel
tests: their shapes and knobs are spelled here, not borrowed from the benchmark (snapquant.bench), so a
benchmark change cannot silently change what the kernel tests check.

Nothing runs: `meta_plan` builds the launch plan an H200 (132 SMs, sm_90) would get, `sm90_stats` compiles
one of its launches for sm_90 (Triton compiles for any target on any machine) and caches the result per
case, so a test and a version snapshot of the same case compile it once."""

from __future__ import annotations

import functools
from typing import Any

import torch

from snapquant import PRESETS
from snapquant.config import KVQuantConfig
from snapquant.kernels import PagedMLACache
from snapquant.kernels.compile_stats import compile_launch, kernel_stats
from snapquant.kernels.decode import plan_decode
from snapquant.kernels.operands import KernelOperands

H200_SMS = 132
SMEM_LIMIT = 227 * 1024  # H100 / H200 shared memory per block (opt-in maximum)
R, D = 512, 64  # DeepSeek's kv_lora_rank and RoPE width


def meta_plan(preset: str | KVQuantConfig, *, B: int, H: int, L: int, S: int = 1, r: int = R, d: int = D,
              arch: int | None = 90, num_sms: int = H200_SMS, **knobs: Any):
    """The plan of B requests of L cached tokens, S query tokens of H heads each, on a GPU of `arch`."""
    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="meta")
    q = torch.empty(B, S, H, r + d, dtype=torch.bfloat16, device="meta")
    return plan_decode(q, KernelOperands.from_paged(cache), 0.07, cfg, native=True, num_sms=num_sms, arch=arch,
                       **knobs)


@functools.cache
def _stats(preset: str, B: int, H: int, L: int, r: int, d: int, arch: int | None, launch: int,
           knobs: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    plan = meta_plan(preset, B=B, H=H, L=L, r=r, d=d, arch=arch, **dict(knobs))
    ln = plan.launches[launch]
    return {"kernel": ln.name, "grid": ln.grid, **kernel_stats(compile_launch(ln, 90))}


def sm90_stats(preset: str, *, B: int, H: int, L: int, r: int = R, d: int = D, arch: int | None = 90,
               launch: int = 0, **knobs: Any) -> dict[str, Any]:
    """`kernel_stats` of launch `launch` (0: the decode kernel) of the plan compiled for sm_90, plus its
    kernel name and grid. A compile error propagates: a kernel test wants it, not a row that hides it."""
    return dict(_stats(preset, B, H, L, r, d, arch, launch, tuple(sorted(knobs.items()))))


def wgmma_mix(stats: dict[str, Any], unit: str) -> dict[str, float]:
    """The wgmma instruction counts by kind (`wgmma_kinds`) divided by the count of kind `unit`.

    The kernel source fixes how many MMAs of each kind one page issues (QK over r channels, RoPE over d,
    PV over r); how often the compiler repeats the page loop's body (peeling, unrolling for pipelining)
    differs between Triton versions and multiplies every kind alike. Ratios to one kind hold across
    versions and still catch a kernel that widens, narrows or drops an MMA."""
    kinds = stats["wgmma_kinds"]
    assert kinds.get(unit), f"no {unit} wgmma in {kinds}"
    return {k: v / kinds[unit] for k, v in kinds.items()}
