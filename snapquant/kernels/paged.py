"""`PagedMLACache`: the MLA latent cache in the kernels' page layout (pages of 64 tokens).

    latent       [num_pages, 64, r]   fp8 e4m3 (bf16 for the baseline layout)
    scale        [num_pages, 64]      fp32 per-token scale (snapmla layout)
                 [num_pages, 64, r/b] fp32 block scales (ds_v32 layout); None for bf16
    rope         [num_pages, 64, d]   bf16 (divided by the token's scale in the snapmla layout)
    block_table  [B, max_pages]       int32 physical page of each request's i-th logical page
    lengths      [B]                  int32 valid tokens per request

Token t of request b lives in page block_table[b, t // 64], row t % 64; its slot is
page * 64 + row. The container converts to and from the contiguous `QuantizedKV` that the reference
decode consumes, which is how the kernels are tested against `snapquant.mla_decode_reference`.

`quantize_append` writes new tokens into the pages (the fused quantize-and-append kernels of
`triton/append.py`, bit-exact to `snapquant.quantize_kv`); `PagedMLACache.append` is it at the next
free slots.
"""

from __future__ import annotations

import math

import torch

from ..config import KVQuantConfig
from ..errors import ConfigError, ShapeError
from ..quant.dtypes import get_element_format
from ..quant.quantizer import QuantizedKV
from ..quant.scales import get_scale_format
from ..quant.tensor import QuantizedTensor
from ._checks import check_shape, check_tensor, raise_on_flags
from .layouts import PAGE_SIZE, layout_of, unsupported_reason
from .triton.append import launch_append

_LATENT_DTYPE = {"snapmla": torch.float8_e4m3fn, "ds_v32": torch.float8_e4m3fn, "bf16": torch.bfloat16}
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIG_APPEND = 4096  # tokens; from here on quantize_append's default is 8 tokens per program


class PagedMLACache:
    """One layer's paged MLA cache for a batch of requests (see the module docstring for the layout)."""

    def __init__(
        self,
        latent: torch.Tensor,
        scale: torch.Tensor | None,
        rope: torch.Tensor,
        block_table: torch.Tensor,
        lengths: torch.Tensor,
        config: KVQuantConfig,
    ) -> None:
        layout = _require_layout(config)
        dev = latent.device if isinstance(latent, torch.Tensor) else None
        check_tensor("latent", latent, dtypes=(_LATENT_DTYPE[layout],), ndim=3, device=dev)
        P, page, r = latent.shape
        if page != PAGE_SIZE:
            raise ShapeError(f"latent must be [num_pages, {PAGE_SIZE}, r], got {tuple(latent.shape)}")
        check_tensor("rope", rope, dtypes=(torch.bfloat16,), ndim=3, device=dev)
        d = rope.shape[-1]
        check_shape("rope", rope, (P, PAGE_SIZE, d), " (same pages as latent)")
        reason = unsupported_reason(config, r, d)
        if reason is not None:
            raise ConfigError(f"the kernels cannot store this cache: {reason}")
        if layout == "bf16":
            if scale is not None:
                raise ShapeError("scale must be None for the bf16 layout (nothing is quantized)")
        else:
            check_tensor("scale", scale, dtypes=(torch.float32,), ndim=(2, 3), device=dev, last_contiguous=False)
            if layout == "snapmla":
                check_shape("scale", scale, (P, PAGE_SIZE), " (one fp32 scale per token)")
            else:
                check_shape("scale", scale, (P, PAGE_SIZE, r // config.block_size),
                            f" (one scale per {config.block_size} channels)")
        check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
        B = block_table.shape[0]
        check_tensor("lengths", lengths, dtypes=(torch.int32,), ndim=1, device=dev)
        check_shape("lengths", lengths, (B,), " (one per block_table row)")
        self.latent, self.scale, self.rope = latent, scale, rope
        self.block_table, self.lengths, self.config = block_table, lengths, config
        self.layout = layout

    # ---------------------------------------------------------------- shape
    @property
    def device(self) -> torch.device:
        return self.latent.device

    @property
    def num_pages(self) -> int:
        return self.latent.shape[0]

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    @property
    def capacity(self) -> int:
        """Tokens one request can hold (block_table width x 64)."""
        return self.max_pages * PAGE_SIZE

    @property
    def kv_lora_rank(self) -> int:
        return self.latent.shape[-1]

    @property
    def rope_dim(self) -> int:
        return self.rope.shape[-1]

    @property
    def num_scale_blocks(self) -> int:
        """Scales per token (1 for snapmla, r / block_size for ds_v32, 0 for bf16)."""
        if self.scale is None:
            return 0
        return 1 if self.scale.dim() == 2 else self.scale.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of the page pool (latent, scales, rope)."""
        ts = [self.latent, self.rope] + ([] if self.scale is None else [self.scale])
        return sum(t.numel() * t.element_size() for t in ts)

    def check_bounds(self) -> None:
        """Check lengths and the block-table entries in use (one device sync); ValueError if bad."""
        pages_used = (self.lengths.long() + PAGE_SIZE - 1) // PAGE_SIZE
        col = torch.arange(self.max_pages, device=self.device)
        in_use = col[None, :] < pages_used[:, None]
        bt = self.block_table
        flags = torch.stack([
            (self.lengths < 0).any(),
            (self.lengths > self.capacity).any(),
            (in_use & ((bt < 0) | (bt >= self.num_pages))).any(),
        ])
        raise_on_flags(flags, [
            "lengths has a negative entry",
            f"lengths has an entry beyond the pages: a request holds at most {self.max_pages} pages x "
            f"{PAGE_SIZE} = {self.capacity} tokens",
            f"block_table has an entry outside [0, num_pages={self.num_pages}) among the pages in use",
        ])

    # ---------------------------------------------------------------- construction
    @classmethod
    def empty(
        cls,
        batch_size: int,
        max_tokens: int,
        kv_lora_rank: int,
        rope_dim: int,
        config: KVQuantConfig,
        *,
        device: torch.device | str = "cpu",
        num_pages: int | None = None,
    ) -> PagedMLACache:
        """An empty cache in which request b owns pages [b * n, (b + 1) * n), n = ceil(max_tokens / 64)."""
        layout = _require_layout(config)
        for name, v in (("batch_size", batch_size), ("max_tokens", max_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ShapeError(f"{name} must be a positive int, got {v!r}")
        per_req = math.ceil(max_tokens / PAGE_SIZE)
        need = batch_size * per_req
        P = need if num_pages is None else num_pages
        if P < need:
            raise ShapeError(f"num_pages={num_pages} is too small: {batch_size} requests x {per_req} pages")
        bt = torch.arange(need, dtype=torch.int32, device=device).view(batch_size, per_req)
        latent = torch.zeros(P, PAGE_SIZE, kv_lora_rank, device=device).to(_LATENT_DTYPE[layout])
        scale = None if layout == "bf16" else torch.ones(
            (P, PAGE_SIZE) if layout == "snapmla" else (P, PAGE_SIZE, kv_lora_rank // config.block_size),
            dtype=torch.float32, device=device)
        rope = torch.zeros(P, PAGE_SIZE, rope_dim, dtype=torch.bfloat16, device=device)
        lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        return cls(latent, scale, rope, bt, lengths, config)

    @classmethod
    def from_quantized_kv(
        cls,
        kv: QuantizedKV,
        lengths: torch.Tensor | None = None,
        *,
        shuffle: bool = False,
        extra_pages: int = 0,
        generator: torch.Generator | None = None,
    ) -> PagedMLACache:
        """Page a contiguous cache (latent `[B, T, r]`, e.g. from `quantize_kv`) into the kernel layout.

        `shuffle` scatters the logical pages over a pool with `extra_pages` unused pages, so tests
        exercise the block-table indirection.
        """
        if not isinstance(kv, QuantizedKV):
            raise ShapeError(f"kv must be a QuantizedKV, got {type(kv).__name__}")
        config = kv.config
        layout = _require_layout(config)
        codes, rope_codes = kv.latent.data, kv.rope.data
        if codes.dim() != 3:
            raise ShapeError(f"kv.latent must be [B, T, r], got {tuple(codes.shape)}")
        B, T, _ = codes.shape
        if kv.rope_prescaled != (layout == "snapmla"):
            raise ShapeError(f"kv.rope_prescaled={kv.rope_prescaled} does not match the {layout} layout")
        if codes.dtype != _LATENT_DTYPE[layout] or rope_codes.dtype != torch.bfloat16:
            raise ShapeError(f"kv holds {codes.dtype} latent / {rope_codes.dtype} rope; the {layout} layout "
                             f"stores {_LATENT_DTYPE[layout]} / torch.bfloat16")
        if kv.latent.token_group not in (None, 1) and layout != "bf16":
            raise ShapeError("kv.latent must have one scale row per token")
        per_req = max(1, math.ceil(T / PAGE_SIZE))
        Tp = per_req * PAGE_SIZE
        dev = codes.device
        need = B * per_req
        P = need + int(extra_pages)
        order = torch.randperm(P, generator=generator)[:need] if shuffle else torch.arange(need)
        bt = order.to(device=dev, dtype=torch.int32).view(B, per_req)

        def to_pages(x: torch.Tensor, fill: float) -> torch.Tensor:
            dtype, x = x.dtype, _raw(x)  # fp8 is moved as uint8 (indexing ops lack fp8 kernels on CPU)
            pad = torch.full((B, Tp - T, *x.shape[2:]), fill, device=dev).to(x.dtype)
            x = torch.cat([x, pad], dim=1).reshape(need, PAGE_SIZE, *x.shape[2:])
            pool = torch.full((P, PAGE_SIZE, *x.shape[2:]), fill, device=dev).to(x.dtype)
            pool[bt.flatten().long()] = x
            return pool.view(dtype)

        scale = None
        if layout != "bf16":
            s = kv.latent.scale.to(torch.float32).expand(B, T, -1)
            scale = to_pages(s, 1.0)
            if layout == "snapmla":
                scale = scale[..., 0].contiguous()
        if lengths is None:
            lengths = torch.full((B,), T, dtype=torch.int32, device=dev)
        lengths = torch.as_tensor(lengths, device=dev).to(torch.int32)
        if lengths.shape != (B,):
            raise ShapeError(f"lengths must have shape [B={B}], got {tuple(lengths.shape)}")
        return cls(to_pages(codes, 0.0), scale, to_pages(rope_codes, 0.0), bt, lengths, config)

    # ---------------------------------------------------------------- conversion
    def to_quantized_kv(self, num_tokens: int | None = None) -> QuantizedKV:
        """Gather each request's pages into a contiguous `QuantizedKV` with latent `[B, T, r]`.

        T = `num_tokens` (default: the block-table capacity). Rows at or beyond a request's length
        hold zero codes and unit scales, so garbage in unused slots never reaches the reference.
        """
        T = self.capacity if num_tokens is None else int(num_tokens)
        if not 0 <= T <= self.capacity:
            raise ShapeError(f"num_tokens={num_tokens} must lie in [0, {self.capacity}]")
        B, n = self.batch_size, math.ceil(T / PAGE_SIZE)
        pos = torch.arange(n * PAGE_SIZE, device=self.device)
        valid = (pos[None, :] < self.lengths[:, None].long())[:, :T]  # [B, T]
        pages = self.block_table[:, :n].long().clamp(0, self.num_pages - 1)

        def gather(x: torch.Tensor, fill: float) -> torch.Tensor:
            dtype, x = x.dtype, _raw(x)
            g = x[pages].reshape(B, n * PAGE_SIZE, *x.shape[2:])[:, :T]
            mask = valid.view(B, T, *([1] * (g.dim() - 2)))
            return torch.where(mask, g, torch.full((), fill, device=self.device).to(g.dtype)).view(dtype)

        cfg = self.config
        r, d = self.kv_lora_rank, self.rope_dim
        nope_fmt, rope_fmt = get_element_format(cfg.nope_dtype), get_element_format(cfg.rope_dtype)
        if self.layout == "bf16":
            latent = QuantizedTensor(gather(self.latent, 0.0), None, nope_fmt, None, cfg.nope_granularity, r, 1)
        else:
            s = self.scale if self.scale.dim() == 3 else self.scale[..., None]
            latent = QuantizedTensor(gather(self.latent, 0.0), gather(s, 1.0), nope_fmt,
                                     get_scale_format(cfg.scale_format), cfg.nope_granularity, r, 1)
        rope_gran = "per_token" if self.layout == "snapmla" else cfg.rope_granularity
        rope = QuantizedTensor(gather(self.rope, 0.0), None, rope_fmt, None, rope_gran, d, 1)
        return QuantizedKV(latent, rope, cfg, rope_prescaled=self.layout == "snapmla")

    # ---------------------------------------------------------------- appending
    def slot_mapping(self, num_new: int) -> torch.Tensor:
        """Slots `[B, num_new]` (int64) of positions lengths[b] .. lengths[b] + num_new - 1 (no sync).

        Positions beyond the capacity are clamped to the last logical page: check bounds first.
        """
        pos = self.lengths.long()[:, None] + torch.arange(num_new, device=self.device)[None, :]
        logical = (pos // PAGE_SIZE).clamp(max=self.max_pages - 1)
        return self.block_table.long().gather(1, logical) * PAGE_SIZE + pos % PAGE_SIZE

    def append(self, latent: torch.Tensor, rope: torch.Tensor, *, check_bounds: bool = True) -> torch.Tensor:
        """Quantize `[B, n, r]` / `[B, n, d]` new tokens into the next free slots and advance lengths.

        Returns the slot mapping used. `check_bounds` costs one device sync (capacity and block table).
        """
        if not isinstance(latent, torch.Tensor) or latent.dim() != 3 or latent.shape[0] != self.batch_size:
            shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise ShapeError(f"latent must be [B={self.batch_size}, n, r], got {shape}")
        n = latent.shape[1]
        if check_bounds:
            self.check_bounds()
            raise_on_flags((self.lengths.long() + n > self.capacity).any()[None], [
                f"appending {n} tokens overflows a request's pages (capacity {self.capacity} tokens)"])
        slots = self.slot_mapping(n)
        quantize_append(latent, rope, self, slots, check_bounds=False)
        self.lengths += n
        return slots


def quantize_append(
    latent: torch.Tensor,
    rope: torch.Tensor,
    paged_cache: PagedMLACache,
    slot_mapping: torch.Tensor,
    config: KVQuantConfig | None = None,
    *,
    check_bounds: bool = True,
    tokens_per_program: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize new tokens and write them into `paged_cache` at `slot_mapping` (in place).

    Args:
        latent: `[..., r]` NoPE latent after kv_a_layernorm (bf16, fp16 or fp32).
        rope: `[..., d]` rotated shared RoPE key, same leading shape.
        paged_cache: destination; its `lengths` are not changed (see `PagedMLACache.append`).
        slot_mapping: `[...]` int32/int64 slots (page * 64 + row); negative entries are skipped.
        config: must match the cache's storage (default: the cache's config).
        check_bounds: verify every slot lies inside the page pool (one device sync).
        tokens_per_program: tokens one program quantizes (a power of two). Default: 8 for appends of
            at least `BIG_APPEND` tokens (bandwidth), else 1 (one program per token: the least latency
            for a decode step's few tokens). Same bits either way.
        num_warps: launch knob (GPU only; default Triton's).
    """
    if not isinstance(paged_cache, PagedMLACache):
        raise ShapeError(f"paged_cache must be a PagedMLACache, got {type(paged_cache).__name__}")
    cache = paged_cache
    config = cache.config if config is None else config
    if layout_of(config) != cache.layout:
        raise ConfigError(f"config {config.label()!r} stores the {layout_of(config)} layout but the cache "
                          f"holds the {cache.layout} layout")
    if any(getattr(config, f) != getattr(cache.config, f)
           for f in ("scale_format", "block_size", "scale_rule", "scale_divisor")):
        raise ConfigError("config's scale_format/block_size/scale_rule/scale_divisor differ from the cache's config")
    dev = cache.device
    check_tensor("latent", latent, dtypes=_IN_DTYPES, ndim=range(1, 9), device=dev)
    check_tensor("rope", rope, dtypes=_IN_DTYPES, ndim=range(1, 9), device=dev)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64), ndim=range(0, 8), device=dev,
                 last_contiguous=False)
    lead = tuple(slot_mapping.shape)
    r, d = cache.kv_lora_rank, cache.rope_dim
    check_shape("latent", latent, (*lead, r), " (slot_mapping's shape + kv_lora_rank)")
    check_shape("rope", rope, (*lead, d), " (slot_mapping's shape + rope_dim)")
    latent, rope = latent.reshape(-1, r), rope.reshape(-1, d)
    slots = slot_mapping.reshape(-1).contiguous()
    n = slots.numel()
    if n == 0:
        return
    if check_bounds:
        raise_on_flags((slots >= cache.num_pages * PAGE_SIZE).any()[None], [
            f"slot_mapping has a slot beyond the page pool ({cache.num_pages} pages x {PAGE_SIZE} slots)"])
    if tokens_per_program is None:
        tokens_per_program = 8 if n >= BIG_APPEND else 1
    if (not isinstance(tokens_per_program, int) or isinstance(tokens_per_program, bool) or tokens_per_program < 1
            or tokens_per_program & (tokens_per_program - 1)):
        raise ShapeError(f"tokens_per_program must be a power of two >= 1, got {tokens_per_program!r}")
    if num_warps is not None and (not isinstance(num_warps, int) or num_warps < 1):
        raise ShapeError(f"num_warps must be a positive int, got {num_warps!r}")
    scale = cache.scale if cache.scale is not None else cache.lengths  # never read by the bf16 layout
    launch_append(latent, rope, slots, cache.latent, scale, cache.rope, layout=cache.layout,
                  num_scale_blocks=max(cache.num_scale_blocks, 1), pow2=config.scale_format == "pow2",
                  scale_rule=config.scale_rule,
                  divisor=config.scale_divisor,
                  tokens_per_program=tokens_per_program, num_warps=num_warps)


def _raw(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their uint8 codes (code 0 is +0.0), others unchanged."""
    return x.view(torch.uint8) if x.element_size() == 1 and x.is_floating_point() else x


def _require_layout(config: KVQuantConfig) -> str:
    if not isinstance(config, KVQuantConfig):
        raise ConfigError(f"config must be a KVQuantConfig, got {type(config).__name__}")
    layout = layout_of(config)
    if layout is None:
        raise ConfigError(f"the kernels have no page layout for config {config.label()!r}: "
                          f"{unsupported_reason(config)}")
    return layout
