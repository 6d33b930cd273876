"""`KernelOperands`: the cache as the decode kernels address it (pages, or the patch's dense rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged import PagedMLACache


@dataclass
class KernelOperands:
    """The cache as the decode kernel addresses it: token t of request b is row t % 64 of "page"
    block_table[b, t // 64], at `page * page_stride + row * token_stride` in each tensor.

    A `PagedMLACache` gives real pages (page_stride = 64 rows). Dense per-request rows `[B, T, ...]`
    (the patch's store) are pages too: page ids are then token offsets b * T' + 64 i and the page
    stride is one row (see `snapquant.kernels.backend`), so no copy is made.
    """

    layout: str
    latent: torch.Tensor  # fp8, or int16 bits for the bf16 layout
    rope: torch.Tensor  # int16 bits of bf16
    scale: torch.Tensor  # fp32; any tensor for the bf16 layout (never read)
    lat_strides: tuple[int, int]  # (page, row)
    rope_strides: tuple[int, int]
    scale_strides: tuple[int, int, int]  # (page, row, block)
    block_table: torch.Tensor  # [B, max_pages] int32
    lengths: torch.Tensor  # [B] int32
    kv_lora_rank: int
    rope_dim: int
    num_scale_blocks: int  # 1 for snapmla and bf16

    @property
    def device(self) -> torch.device:
        return self.latent.device

    @classmethod
    def from_paged(cls, cache: PagedMLACache) -> KernelOperands:
        scale = cache.scale if cache.scale is not None else cache.lengths
        s_strides = (0, 0, 0) if cache.scale is None else (
            scale.stride(0), scale.stride(1), scale.stride(2) if scale.dim() == 3 else 0)
        lat = cache.latent.view(torch.int16) if cache.layout == "bf16" else cache.latent
        return cls(cache.layout, lat, cache.rope.view(torch.int16), scale,
                   (cache.latent.stride(0), cache.latent.stride(1)), (cache.rope.stride(0), cache.rope.stride(1)),
                   s_strides, cache.block_table, cache.lengths, cache.kv_lora_rank, cache.rope_dim,
                   max(cache.num_scale_blocks, 1))
