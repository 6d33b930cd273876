"""FlashMLA (the BF16 MLA decode kernel vLLM and SGLang run on Hopper) as a decode backend and a benchmark anchor.

snapquant never depends on FlashMLA: it is imported when a benchmark or `backend="flashmla"` asks for it,
and a missing package is one line ("FlashMLA not installed"), never a traceback. Users install it from
github.com/deepseek-ai/FlashMLA. Its dense decode API:

    meta, _ = flash_mla.get_mla_metadata()          # empty; the first call fills it (schedule from lengths)
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, None,
                                                softmax_scale=tau, causal=...)

    q            [B, S, H, r + d] bf16 (absorbed query: latent part, then RoPE part)
    k_cache      [pages, 64, 1, r + d] bf16: per token one row of the latent then the RoPE key (last dim contiguous)
    block_table  [B, max_pages] int32: request b's j-th page is k_cache[block_table[b, j]]
    cache_seqlens [B] int32
    out          [B, S, H, r] bf16;  lse [B, H, S] fp32, natural log (+inf for a query that sees no token)

A metadata object may be reused only while the shapes and the lengths stay the same (the benchmark's
repeated calls); a decode step whose lengths grow needs a fresh one per call.

snapquant's stores keep the latent and the RoPE key in separate row buffers unless the cache is built with
`joint_rows=True` (`LatentCache(..., joint_rows=True)`), which allocates one [B, capacity, r + d] buffer of
which the two parts are column slices: exactly FlashMLA's page layout, read with no copy. On a split store
the backend packs the rows into that layout on every call (correct, but a copy of the whole cache per layer
and step; it warns once).
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import torch

from ..config import KVQuantConfig
from ..constants import PAGE_SIZE
from ..errors import ConfigError, ShapeError
from ..quant.quantizer import QuantizedKV
from ..reference import mla_decode_reference
from ..runtime import lengths_trusted, warn_once

MODULE = "flash_mla"
NOT_INSTALLED = "FlashMLA not installed"
INSTALL_HINT = "install it from github.com/deepseek-ai/FlashMLA (a Hopper GPU build)"
PAGE = PAGE_SIZE  # FlashMLA's page size (tokens): the same 64 as our paged kernels
DIMS = (512, 64)  # FlashMLA's dense decode: head_dim 576 = kv_lora_rank 512 + rope 64, head_dim_v 512



def load() -> ModuleType | None:
    """The `flash_mla` module, or None when it is not installed (or its extension fails to load)."""
    try:
        return importlib.import_module(MODULE)
    except (ImportError, OSError):  # OSError: a CUDA extension whose shared libraries are missing
        return None


def available() -> bool:
    return load() is not None


def require() -> ModuleType:
    """The `flash_mla` module; ConfigError (one line) when it is not installed."""
    mod = load()
    if mod is None:
        raise ConfigError(f"{NOT_INSTALLED}: {INSTALL_HINT}")
    return mod


# ---------------------------------------------------------------------------------------------- configs
def unsupported_reason(config: KVQuantConfig) -> str | None:
    """Why FlashMLA's BF16 decode cannot run `config` here; None when it can (the bf16 preset's arithmetic, and
    flash_mla importable). The backend registry quotes it when `backend="flashmla"` is refused."""
    if not available():
        return f"{NOT_INSTALLED}: {INSTALL_HINT}"
    return config_reason(config)


def config_reason(config: KVQuantConfig) -> str | None:
    """Why FlashMLA's arithmetic is not `config`'s (None: it is the bf16 preset's)."""
    if not isinstance(config, KVQuantConfig):
        return f"expected a KVQuantConfig, got {type(config).__name__}"
    if config.nope_dtype != "bf16" or config.rope_dtype != "bf16" or config.rope_prescale:
        return (f"FlashMLA reads a bf16 latent and RoPE key (nope_dtype={config.nope_dtype!r}, "
                f"rope_dtype={config.rope_dtype!r}, rope_prescale={config.rope_prescale})")
    if config.query != "bf16" or config.pv != "bf16":
        return f"FlashMLA rounds the query and P to bf16 (query={config.query!r}, pv={config.pv!r})"
    return None


def supports(config: KVQuantConfig) -> bool:
    """True when FlashMLA's BF16 decode implements `config` (the registry's `supports`)."""
    return unsupported_reason(config) is None


# ---------------------------------------------------------------------------------------------- layouts
def pages_from_paged(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """FlashMLA's k_cache [pages, 64, 1, r + d] from snapquant's paged bf16 buffers latent [pages, 64, r] and
    rope [pages, 64, d] (a new buffer: page ids, hence the block table, are unchanged)."""
    if latent.dim() != 3 or rope.shape[:2] != latent.shape[:2] or latent.shape[1] != PAGE:
        raise ShapeError(f"expected latent [pages, {PAGE}, r] and rope [pages, {PAGE}, d], got "
                         f"{tuple(latent.shape)} and {tuple(rope.shape)}")
    return torch.cat([latent, rope], dim=-1).to(torch.bfloat16).unsqueeze(2).contiguous()


def joint_pitch(latent: torch.Tensor, rope: torch.Tensor) -> int | None:
    """Rows per request when `latent [B, T, r]` and `rope [B, T, d]` are the two column slices of one
    [B, pitch, r + d] buffer (a `joint_rows` store), pitch a whole number of pages; None otherwise."""
    if latent.dtype != rope.dtype or latent.dim() != 3 or rope.dim() != 3 or latent.shape[:2] != rope.shape[:2]:
        return None
    r, d = latent.shape[-1], rope.shape[-1]
    w = r + d
    if latent.stride(2) != 1 or rope.stride(2) != 1 or latent.stride(1) != w or rope.stride(1) != w:
        return None
    if latent.untyped_storage().data_ptr() != rope.untyped_storage().data_ptr():
        return None
    if rope.storage_offset() != latent.storage_offset() + r:
        return None
    B, T = latent.shape[:2]
    if B > 1 and (latent.stride(0) % w or rope.stride(0) != latent.stride(0)):
        return None
    pitch = latent.stride(0) // w
    if pitch % PAGE or pitch < T:
        return None
    # every page the block table names must lie inside the buffer
    rows = (B - 1) * pitch + max(1, math.ceil(T / PAGE)) * PAGE
    if latent.storage_offset() + rows * w > latent.untyped_storage().nbytes() // latent.element_size():
        return None
    return pitch


def pages_from_rows(latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """FlashMLA's (k_cache [pages, 64, 1, r + d], block_table [B, ceil(T / 64)] int32, copied) over a store's
    rows `latent [B, T, r]`, `rope [B, T, d]`: a view of a joint buffer (no copy) when the two are slices of
    one, else a packed copy. Device ops only (no host sync): usable inside a captured decode step."""
    B, T, r = latent.shape
    d = rope.shape[-1]
    n_pages = max(1, math.ceil(T / PAGE))
    dev = latent.device
    pitch = joint_pitch(latent, rope)
    copied = pitch is None
    if copied:
        pitch = n_pages * PAGE
        buf = latent.new_zeros(B, pitch, r + d, dtype=torch.bfloat16)
        buf[:, :T, :r] = latent
        buf[:, :T, r:] = rope
        base = buf
        offset = 0
    else:
        base, offset = latent, latent.storage_offset()
    pages_per_request = pitch // PAGE
    k_cache = torch.as_strided(base, ((B - 1) * pages_per_request + n_pages, PAGE, 1, r + d),
                               (PAGE * (r + d), r + d, r + d, 1), offset)
    block_table = (torch.arange(B, device=dev, dtype=torch.int32)[:, None] * pages_per_request
                   + torch.arange(n_pages, device=dev, dtype=torch.int32)[None, :])
    return k_cache, block_table, copied


# ---------------------------------------------------------------------------------------------- calls
class AnchorDecode:
    """Zero-argument FlashMLA decode over fixed inputs (the benchmark's timed callable): the schedule
    metadata is filled by `prime()` (the first call), outside any timed region, and reused by every later
    call (same shapes and lengths, as FlashMLA requires)."""

    def __init__(self, mod: ModuleType, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                 seqlens: torch.Tensor, tau: float, head_dim_v: int, causal: bool = True) -> None:
        self.mod, self.q, self.k_cache = mod, q, k_cache
        self.block_table = block_table.to(torch.int32).contiguous()
        self.seqlens = seqlens.to(torch.int32).contiguous()
        self.tau, self.head_dim_v, self.causal = float(tau), int(head_dim_v), causal
        self.meta = mod.get_mla_metadata()[0]

    def prime(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self()

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mod.flash_mla_with_kvcache(self.q, self.k_cache, self.block_table, self.seqlens,
                                               self.head_dim_v, self.meta, None, softmax_scale=self.tau,
                                               causal=self.causal)


# ---------------------------------------------------------------------------------------------- the backend
def flashmla_backend(
    q: torch.Tensor,
    kv: QuantizedKV,
    lengths: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    config: KVQuantConfig | None = None,
    *,
    causal: bool = True,
    round_16bit: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `mla_decode_reference` on FlashMLA: q [B, (S,) H, r + d] (any float dtype; rounded to bf16,
    as the bf16 preset's query), kv the store's bf16 rows -> (out [B, (S,) H, r] fp32, lse natural log, -inf
    where a query sees no token). Falls back to the reference (warning once) where FlashMLA cannot run the
    call exactly: round_16bit=False (an fp32 model) or a cache not stored as bf16."""
    cfg = config or kv.config
    mod = require()
    reason = mismatch_reason(kv, cfg, round_16bit)
    if reason is not None:
        warn_once(f"snapquant flashmla backend: using the reference decode because {reason}")
        return mla_decode_reference(q, kv, lengths, softmax_scale, cfg, causal=causal, round_16bit=round_16bit)
    single = q.dim() == 3
    q4 = q.unsqueeze(1) if single else q
    B, w = q4.shape[0], q4.shape[-1]
    latent, rope = kv.latent.data, kv.rope.data
    T, r, d = latent.shape[1], latent.shape[2], rope.shape[2]
    if (r, d) != DIMS:
        raise ShapeError(f"backend='flashmla' runs kv_lora_rank={DIMS[0]} and qk_rope_head_dim={DIMS[1]} only "
                         f"(FlashMLA's head_dim 576, head_dim_v 512), got {r} and {d}")
    if w != r + d or latent.shape[0] != B:
        raise ShapeError(f"q [B, S, H, r + d] = {tuple(q4.shape)} does not match the cache [B={latent.shape[0]}, "
                         f"T, {r} + {d}]")
    lens = _lengths(lengths, B, T, latent.device)
    k_cache, block_table, copied = pages_from_rows(latent, rope)
    if copied:
        warn_once("snapquant flashmla backend: the cache stores the latent and RoPE key in separate buffers, so "
                   "every call packs them into FlashMLA's [pages, 64, 1, r + d] rows (a copy of the cache); build "
                   "the cache with LatentCache(..., joint_rows=True) to read it in place")
    tau = 1.0 / math.sqrt(r + d) if softmax_scale is None else float(softmax_scale)
    meta = mod.get_mla_metadata()[0]  # fresh per call: the schedule depends on the lengths, which grow
    out, lse = mod.flash_mla_with_kvcache(q4.to(torch.bfloat16).contiguous(), k_cache, block_table, lens, r, meta,
                                          None, softmax_scale=tau, causal=causal)
    out = out.float()
    lse = lse.transpose(1, 2).float()  # [B, H, S] -> [B, S, H]
    # FlashMLA marks a query that sees no token with lse = +inf (and out = 0); the seam's convention is -inf
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)
    if single:
        return out[:, 0], lse[:, 0]
    return out, lse


def mismatch_reason(kv: QuantizedKV, config: KVQuantConfig, round_16bit: bool = True) -> str | None:
    """Why FlashMLA cannot run a call over `kv` exactly as the reference would (None when it can)."""
    if not round_16bit:
        return "round_16bit=False (FlashMLA rounds the query and P to bf16)"
    reason = config_reason(config)
    if reason is not None:
        return reason
    lat, rope = kv.latent, kv.rope
    if lat.data.dtype != torch.bfloat16 or rope.data.dtype != torch.bfloat16 or lat.scale is not None:
        return f"the cache is stored as {lat.data.dtype} / {rope.data.dtype}, not plain bf16 (e.g. an fp32 model)"
    if lat.data.dim() != 3 or rope.data.dim() != 3:
        return f"the cache is not [B, T, width] (latent {tuple(lat.data.shape)})"
    return None


def _lengths(lengths: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    if lengths is None:
        return torch.full((B,), T, dtype=torch.int32, device=device)
    lens = torch.as_tensor(lengths, device=device)
    if lens.shape != (B,):
        raise ShapeError(f"lengths must have shape [B={B}], got {tuple(lens.shape)}")
    if not lengths_trusted() and bool(((lens < 0) | (lens > T)).any()):  # a host read; skipped in graph capture
        raise ShapeError(f"lengths must lie in [0, {T}] (the cache holds {T} tokens), got {lens.tolist()}")
    return lens.to(torch.int32).contiguous()

