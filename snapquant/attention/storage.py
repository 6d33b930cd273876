"""Per-layer storage of the quantized MLA latent cache: ragged token rows, real codes and scales.

`LatentStore` is the narrow interface the attention code and the HF cache layer use:

    append(latent [B,S,r], rope [B,S,d], valid [B,S])   quantize and store the valid new tokens
    segments() -> [Segment]                              what the decode backend reads (QuantizedKV views)
    dequantize() -> (latent [B,L,r], rope [B,L,d])       ragged rows in fp32 (prefill on a non-empty cache)
    nbytes(), truncate(new_lengths), index_select(idx)   bytes, crop, beam reorder / batch select / repeat
    append_static, static_reason, rewind                 the fixed-shape (CUDA-graph) decode step

so a paged store (pages of 64 tokens + block table) can replace `DenseLatentStore` without touching the
attention code. Rows are *ragged*: request b keeps exactly its `lengths[b]` valid tokens at rows
`[0, lengths[b])`; padding tokens are never stored (as in a serving engine), so decode needs only
per-request lengths.

What is stored, per `KVQuantConfig` (docs/numerics.md, "What the cache stores"), is decided per part by
the policies of snapquant.attention.store_policies (one small class each, as HF's cache layers):
- identity configs (`config.is_identity`): `PassThrough` of the activations in the model's own dtype,
  unrounded, so a patched fp32 model reproduces the stock one; in a bf16 model this is exactly the
  1152 B/token cache. 16-bit parts of quantized configs are `PassThrough` too.
- per_token / per_token_block parts: `RowScales`, codes + one scale row per token (the paper's 644 B/token).
- per_tensor_static, and per_tensor_dynamic / per_channel without token groups: `FrozenScales`. The
  latter two are not causal-consistent (the scale would drift as tokens arrive): the scale is computed
  once from the first append (the prefill; padding excluded) and then frozen, as HF's QuantizedCache
  does; later tokens are quantized with it and saturate if they exceed it.
- per_channel with `token_group` G (KIVI): `GroupScales`, plus a `KiviWindow` where tokens wait in the
  model's dtype until G of them (per request) are there, then the group is quantized with one scale per
  channel. Decode reads two segments (quantized groups, raw window); attention merges them by their LSE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..config import KVQuantConfig
from ..constants import PAGE_SIZE
from ..errors import ConfigError, ShapeError
from ..quant.dtypes import ELEMENT_FORMATS, ElementFormat
from ..quant.quantizer import QuantizedKV, quantize_kv
from ..quant.scales import get_scale_format
from ..quant.tensor import QuantizedTensor
from .store_policies import (
    GroupScales,
    KiviWindow,
    PartPolicy,
    PassThrough,
    grow_rows,
    part_policy,
    select_rows,
)

# Unregistered passthrough format for fp32 activations: identity configs keep an fp32 model's latent
# exactly (configs cannot name it, so it never appears in sweeps).
FP32_PASSTHROUGH = ElementFormat("fp32", "passthrough", 32, torch.float32)


def native_format(dtype: torch.dtype) -> ElementFormat:
    """The passthrough format that stores activations of `dtype` without rounding."""
    if dtype == torch.float32:
        return FP32_PASSTHROUGH
    if dtype == torch.bfloat16:
        return ELEMENT_FORMATS["bf16"]
    if dtype == torch.float16:
        return ELEMENT_FORMATS["fp16"]
    raise ShapeError(f"unsupported activation dtype {dtype}; expected float32, bfloat16 or float16")


def joint_rows_reason(config: KVQuantConfig) -> str | None:
    """Why a store of `config` cannot keep latent and RoPE in one row (`joint_rows=True`); None when it can:
    scales or two element formats cannot share a row."""
    if config.nope_format.is_quantized or config.rope_format.is_quantized or config.rope_prescale:
        return (f"joint_rows=True needs a cache with nothing quantized (one 16-bit row of latent then RoPE); "
                f"config {config.label()!r} stores nope_dtype={config.nope_dtype}, rope_dtype={config.rope_dtype}")
    if config.nope_dtype != config.rope_dtype:
        return (f"joint_rows=True needs one dtype for the latent and the RoPE key, got "
                f"nope_dtype={config.nope_dtype} and rope_dtype={config.rope_dtype}")
    return None


@dataclass
class Segment:
    """A run of cached tokens the backend reads as one `QuantizedKV`.

    Request b's rows `[0, lengths[b])` of `kv` hold its cache positions `[offset[b], offset[b] + lengths[b])`.
    """

    kv: QuantizedKV
    lengths: torch.Tensor
    offset: torch.Tensor


@runtime_checkable
class LatentStore(Protocol):
    """What the attention code and `LatentLayer` need from a layer's store (see the module docstring)."""

    config: KVQuantConfig
    capacity: int | None
    lengths: torch.Tensor | None  # [B] stored tokens per request

    @property
    def batch_size(self) -> int: ...

    @property
    def max_length(self) -> int: ...

    def append(self, latent: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor | None = None) -> None: ...

    def append_static(self, latent: torch.Tensor, rope: torch.Tensor) -> None: ...

    def static_reason(self) -> str | None: ...

    def segments(self, static: bool = False) -> list[Segment]: ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]: ...

    def nbytes(self) -> int: ...

    def truncate(self, new_lengths: torch.Tensor) -> None: ...

    def rewind(self, n: int) -> None: ...

    def index_select(self, idx: torch.Tensor) -> None: ...


class DenseLatentStore:
    """Ragged dense rows `[B, capacity, ...]` grown by doubling (the reference storage).

    With `capacity` (a LatentCache's `max_cache_len`), rows are allocated once at the first append,
    rounded up to the 64-token page, and never reallocated: appending beyond raises a ShapeError, and
    `lengths` / the buffers are updated in place, so a captured CUDA graph keeps reading live state.
    """

    def __init__(self, config: KVQuantConfig, kv_lora_rank: int, rope_dim: int, act_dtype: torch.dtype,
                 capacity: int | None = None, joint_rows: bool = False):
        config.check_dims(kv_lora_rank, rope_dim)
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
            raise ShapeError(f"max_cache_len must be a positive int, got {capacity!r}")
        self.config = config
        # Preallocated stores: rows per request, a multiple of the 64-token page; allocated at the first
        # append and never reallocated (lengths and buffers keep their memory: CUDA graphs read them).
        self.capacity = None if capacity is None else math.ceil(capacity / PAGE_SIZE) * PAGE_SIZE
        self._static: dict = {}  # cached index tensors / kernel views of the static append path
        # append_static through the fused Triton kernel: None = on CUDA when the layout allows (True also
        # runs it in the Triton interpreter on CPU, for tests).
        self.kernel_append: bool | None = None
        self.r, self.d = kv_lora_rank, rope_dim
        self.act_dtype = act_dtype
        self.identity = config.is_identity
        self.lengths: torch.Tensor | None = None  # [B] stored tokens per request
        widths = (("nope", self.r), ("rope", self.d))
        self.parts: dict[str, PartPolicy]
        if self.identity:
            fmt = native_format(act_dtype)
            self.parts = {p: PassThrough(fmt, w, "per_token") for p, w in widths}
        else:
            sfmt = get_scale_format(config.scale_format)
            self.parts = {p: part_policy(config, p, w, sfmt) for p, w in widths}
        # joint_rows: one [B, capacity, r + d] buffer whose column slices are the two parts' codes, a token's
        # latent then RoPE key in one row (FlashMLA's and vLLM's page layout, read by them in place). Only
        # for unscaled parts of one dtype: scales or two element formats cannot share a row.
        self.joint_rows = bool(joint_rows)
        self._joint: torch.Tensor | None = None
        if self.joint_rows:
            reason = joint_rows_reason(config)
            if reason is not None:
                raise ConfigError(reason)
        grouped = any(isinstance(p, GroupScales) for p in self.parts.values())
        self.group = config.token_group if grouped else None
        # KIVI residual window: the last `lengths % group` tokens of each request, in the model's dtype.
        self.window = KiviWindow(self.group, act_dtype) if grouped else None

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> int:
        return 0 if self.lengths is None else int(self.lengths.shape[0])

    @property
    def max_length(self) -> int:
        return 0 if self.lengths is None or self.lengths.numel() == 0 else int(self.lengths.max())

    def quantized_lengths(self) -> torch.Tensor:
        """Tokens per request held as codes (all of them except KIVI's residual window)."""
        if self.group is None:
            return self.lengths
        return self.lengths - self.lengths % self.group

    # ------------------------------------------------------------------ append
    def append(self, latent: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Quantize and store the valid tokens of `latent [B,S,r]`, `rope [B,S,d]` after each request's rows."""
        B, S = latent.shape[:2]
        if latent.shape != (B, S, self.r) or rope.shape != (B, S, self.d):
            raise ShapeError(
                f"append expects latent [B, S, {self.r}] and rope [B, S, {self.d}], got {tuple(latent.shape)} "
                f"and {tuple(rope.shape)}"
            )
        if self.lengths is None:
            self.lengths = torch.zeros(B, dtype=torch.long, device=latent.device)
        elif B != self.batch_size:
            raise ShapeError(f"append got batch {B} but the cache holds {self.batch_size} requests")
        if valid is None:
            counts = torch.full((B,), S, dtype=torch.long, device=latent.device)
            packed_l, packed_r = latent, rope
        else:
            valid = valid.to(device=latent.device, dtype=torch.bool)
            counts = valid.sum(dim=1)
            packed_l, packed_r = _compact(latent, rope, valid, counts)
        if self.group is not None:
            self._append_grouped(packed_l, packed_r, counts)
        else:
            self._write_rows(packed_l, packed_r, counts, self.lengths.clone())
        if self.capacity is None:
            self.lengths = self.lengths + counts
        else:
            self.lengths.add_(counts)

    def _check_capacity(self, need: int) -> None:
        if self.capacity is not None and need > self.capacity:
            raise ShapeError(
                f"the cache would hold {need} tokens per request but it was preallocated for max_cache_len "
                f"(capacity {self.capacity} rows); build the LatentCache with a larger max_cache_len"
            )

    # ------------------------------------------------------------------ static (graph-safe) path
    @property
    def is_static_capable(self) -> bool:
        """True when `append_static` / `segments(static=True)` apply: preallocated, one fixed-shape segment."""
        return self.capacity is not None and self.group is None

    def static_reason(self) -> str | None:
        """Why this store cannot run the fixed-shape (CUDA-graph) path; None when it can."""
        if self.capacity is None:
            return "the store is not preallocated (build the LatentCache with max_cache_len=N)"
        if self.group is not None:
            return (f"token_group={self.group} (KIVI residual window) keeps a second, raw segment whose rows move "
                    f"every step; only fixed-capacity dense layouts can be captured")
        if self.lengths is None or self.parts["nope"].codes is None:
            return "the store is empty: append (prefill) at least once so its buffers exist before capture"
        return None

    def append_static(self, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """Store `latent [B,S,r]`, `rope [B,S,d]` (every token real) at rows lengths[b].., with no host sync.

        Fixed shapes and in-place writes only (CUDA-graph capturable): the caller guarantees the store is
        preallocated, holds B requests and has room (LatentLayer checks that on the host). On CUDA, kernel
        layouts are written by the fused Triton quantize-append (bit-exact to `quantize_kv`, and free of the
        host constants `quantize_kv` creates); elsewhere `quantize_kv` (without its finite check) and an
        index_put at the device-side rows.
        """
        reason = self.static_reason()
        if reason is not None:
            raise ConfigError(f"append_static: {reason}")
        B, S = latent.shape[:2]
        if latent.shape != (B, S, self.r) or rope.shape != (B, S, self.d) or B != self.batch_size:
            raise ShapeError(
                f"append_static expects latent [B={self.batch_size}, S, {self.r}] and rope [B, S, {self.d}], got "
                f"{tuple(latent.shape)} and {tuple(rope.shape)}"
            )
        paged = self._paged_view(latent, rope)
        if paged is not None:
            from ..kernels import quantize_append

            # slot of (b, s) = lengths[b] + s + b * capacity: one add to a cached offset table per step
            slots = self.lengths.view(B, 1) + self._slot_offsets(B, S)
            quantize_append(latent.contiguous(), rope.contiguous(), paged, slots, self.config, check_bounds=False)
        else:
            rows = self.lengths.view(B, 1) + self._arange(S).view(1, S)  # [B, S] destination rows
            if self.identity:
                q = self._quantize(latent, rope)
            else:
                q = quantize_kv(latent, rope, self.config, check_finite=False,
                                nope_scale=self.parts["nope"].frozen_scale(), rope_scale=self.parts["rope"].frozen_scale())
            b_idx = self._arange(B).view(B, 1).expand(B, S)
            for name, qt in (("nope", q.latent), ("rope", q.rope)):
                self.parts[name].write(qt.data, qt.scale, (b_idx, rows))
        self.lengths.add_(S)

    def _arange(self, n: int) -> torch.Tensor:
        key = ("arange", n)
        t = self._static.get(key)
        if t is None:
            t = self._static[key] = torch.arange(n, device=self.lengths.device)
        return t

    def _slot_offsets(self, B: int, S: int) -> torch.Tensor:
        """`[B, S]`: s + b * capacity, the paged view's slot of token s of request b past its length."""
        key = ("slots", B, S)
        t = self._static.get(key)
        if t is None:
            t = self._static[key] = self._arange(S).view(1, S) + self._arange(B).view(B, 1) * self.capacity
        return t

    def _paged_view(self, latent: torch.Tensor, rope: torch.Tensor):
        """The store's buffers as a `PagedMLACache` for the fused append kernel, or None (use quantize_kv)."""
        if self.kernel_append is False or (self.kernel_append is None and self.lengths.device.type != "cuda"):
            return None
        nope, rp = self.parts["nope"], self.parts["rope"]
        key = ("paged", nope.codes.data_ptr(), rp.codes.data_ptr(),
               None if nope.scale is None else nope.scale.data_ptr(), latent.dtype, rope.dtype)
        if key in self._static:
            return self._static[key]
        view = None
        try:
            from ..kernels.backend import kernel_mismatch
            from ..kernels.paged import PagedMLACache
        except ImportError:  # no triton
            self._static[key] = None
            return None
        kv = self.segments(static=True)[0].kv
        if kernel_mismatch(kv, self.config) is None and nope.layout in ("none", "row") and all(
                t is None or t.is_contiguous() for t in (nope.codes, nope.scale, rp.codes)):
            B, cap = self.batch_size, self.capacity
            pages = B * cap // PAGE_SIZE
            scale = None
            if nope.scale is not None:
                scale = nope.scale.view(pages, PAGE_SIZE, nope.scale.shape[-1])
                if scale.shape[-1] == 1:
                    scale = scale.view(pages, PAGE_SIZE)
            dev = self.lengths.device
            view = PagedMLACache(
                nope.codes.view(pages, PAGE_SIZE, self.r), scale, rp.codes.view(pages, PAGE_SIZE, self.d),
                torch.zeros(B, 1, dtype=torch.int32, device=dev), torch.zeros(B, dtype=torch.int32, device=dev),
                self.config,
            )
        self._static = {k: v for k, v in self._static.items() if k[0] != "paged"}
        self._static[key] = view
        return view

    def _quantize(self, latent: torch.Tensor, rope: torch.Tensor) -> QuantizedKV:
        if self.identity:  # the activations themselves, in the model's dtype (no rounding)
            fmt = self.parts["nope"].fmt
            return QuantizedKV(
                QuantizedTensor(latent.to(fmt.storage_dtype), None, fmt, None, "per_token", self.r, 1),
                QuantizedTensor(rope.to(fmt.storage_dtype), None, fmt, None, "per_token", self.d, 1),
                self.config,
            )
        return quantize_kv(latent, rope, self.config, nope_scale=self.parts["nope"].frozen_scale(),
                           rope_scale=self.parts["rope"].frozen_scale())

    def _write_rows(self, latent: torch.Tensor, rope: torch.Tensor, counts: torch.Tensor, start: torch.Tensor) -> None:
        """Quantize `latent [B,N,r]` (first counts[b] rows valid) and write them at rows start[b]..."""
        B, N = latent.shape[:2]
        if N == 0:
            return
        q = self._quantize(latent, rope)
        need = int((start + counts).max())
        self._check_capacity(need)
        keep = torch.arange(N, device=latent.device).view(1, N) < counts.view(B, 1)
        b_idx, k_idx = keep.nonzero(as_tuple=True)
        t_idx = start[b_idx] + k_idx
        if self.joint_rows:
            self._ensure_joint(B, need, q.latent.data)
        for name, qt in (("nope", q.latent), ("rope", q.rope)):
            part = self.parts[name]
            part.ensure(B, need, qt.data, qt.scale, self.capacity)
            part.write(qt.data, qt.scale, (b_idx, t_idx), (b_idx, k_idx))

    def _append_grouped(self, latent: torch.Tensor, rope: torch.Tensor, counts: torch.Tensor) -> None:
        """KIVI: pending = window ++ new tokens; quantize every complete group of G, keep the rest raw."""
        B, G = latent.shape[0], self.group
        held = self.lengths % G
        pend_l, pend_r, total = self.window.pending(latent, rope, counts, held)
        full = total // G
        n_full = int(full.max()) if B else 0
        if n_full:
            rows = n_full * G
            # Group-aligned start: the quantized rows end at lengths - held (a multiple of G).
            start = self.lengths - held
            self._write_group_rows(pend_l[:, :rows], pend_r[:, :rows], full * G, start)
        self.window.keep(pend_l, pend_r, full * G, total - full * G)

    def _ensure_joint(self, batch: int, need: int, like: torch.Tensor) -> None:
        """Allocate (or grow, keeping the rows) the joint buffer and point both parts' codes at its slices."""
        if self._joint is None:
            rows = self.capacity if self.capacity is not None else math.ceil(need / PAGE_SIZE) * PAGE_SIZE
            self._joint = like.new_zeros(batch, rows, self.r + self.d)
        elif self.capacity is None and self._joint.shape[1] < need:
            self._joint = grow_rows(self._joint, need)
        else:
            return
        self._point_parts()

    def _point_parts(self) -> None:
        self.parts["nope"].codes = self._joint[..., : self.r]
        self.parts["rope"].codes = self._joint[..., self.r:]

    def _write_group_rows(self, latent: torch.Tensor, rope: torch.Tensor, counts: torch.Tensor, start: torch.Tensor):
        """Quantize whole groups: `latent [B, F*G, r]` (first counts[b] rows valid, a multiple of G)."""
        B, rows = latent.shape[:2]
        G = self.group
        F = rows // G
        # One quantize call on [B*F, G, w]: per_channel over exactly G tokens gives one scale per channel.
        q = self._quantize(latent.reshape(B * F, G, self.r), rope.reshape(B * F, G, self.d))
        need = int((start + counts).max())
        self._check_capacity(need)
        keep = torch.arange(rows, device=latent.device).view(1, rows) < counts.view(B, 1)
        b_idx, k_idx = keep.nonzero(as_tuple=True)
        t_idx = start[b_idx] + k_idx
        gkeep = torch.arange(F, device=latent.device).view(1, F) < (counts // G).view(B, 1)
        gb, gk = gkeep.nonzero(as_tuple=True)
        g_dest = start[gb] // G + gk
        for name, qt in (("nope", q.latent), ("rope", q.rope)):
            part = self.parts[name]
            data = qt.data.reshape(B, rows, qt.data.shape[-1])
            part.ensure(B, need, data, qt.scale, self.capacity)
            part.write_grouped(data, qt.scale, (b_idx, t_idx), (b_idx, k_idx), (gb, g_dest), (gb, gk))

    # ------------------------------------------------------------------ views
    def segments(self, static: bool = False) -> list[Segment]:
        """The stored tokens as QuantizedKV views for the decode backend (one, or two with KIVI).

        static: one fixed-shape view over the whole preallocated capacity (rows past `lengths[b]` are
        masked by the backend through `lengths`); no host sync. Only for `static_reason() is None`.
        """
        if self.lengths is None:
            raise ShapeError("the cache layer is empty: nothing has been appended yet")
        if static:
            reason = self.static_reason()
            if reason is not None:
                raise ConfigError(f"static segments: {reason}")
            n = self.capacity
            kv = QuantizedKV(self.parts["nope"].view(n), self.parts["rope"].view(n), self.config,
                             rope_prescaled=self.config.rope_prescale and not self.identity)
            return [Segment(kv, self.lengths, torch.zeros_like(self.lengths))]
        q_len = self.quantized_lengths()
        n_rows = int(q_len.max()) if q_len.numel() else 0
        zero = torch.zeros_like(self.lengths)
        if self.parts["nope"].codes is None:  # nothing quantized yet (e.g. KIVI before the first full group)
            segs = [Segment(self._empty_kv(), zero, zero)]
        else:
            kv = QuantizedKV(self.parts["nope"].view(n_rows), self.parts["rope"].view(n_rows), self.config,
                             rope_prescaled=self.config.rope_prescale and not self.identity)
            segs = [Segment(kv, q_len, zero)]
        if self.group is not None:
            res_len = self.lengths - q_len
            fmt = native_format(self.act_dtype)
            n = int(res_len.max()) if res_len.numel() else 0
            res_kv = QuantizedKV(*self.window.view(n, fmt), self.config)
            segs.append(Segment(res_kv, res_len, q_len))
        return segs

    def _empty_kv(self) -> QuantizedKV:
        fmt = native_format(self.act_dtype)
        dev = self.lengths.device
        B = self.batch_size
        return QuantizedKV(
            QuantizedTensor(torch.zeros(B, 0, self.r, dtype=self.act_dtype, device=dev), None, fmt, None,
                            "per_token", self.r, 1),
            QuantizedTensor(torch.zeros(B, 0, self.d, dtype=self.act_dtype, device=dev), None, fmt, None,
                            "per_token", self.d, 1),
            self.config,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored tokens, ragged: (latent [B, L, r], rope [B, L, d]); rows >= lengths[b] are zero."""
        B, L = self.batch_size, self.max_length
        dev = self.lengths.device
        lat = torch.zeros(B, L, self.r, dtype=dtype, device=dev)
        rop = torch.zeros(B, L, self.d, dtype=dtype, device=dev)
        for seg in self.segments():
            if seg.kv.num_tokens == 0:
                continue
            sl, sr = seg.kv.dequantize(dtype)
            n = sl.shape[1]
            keep = torch.arange(n, device=dev).view(1, n) < seg.lengths.view(B, 1)
            b_idx, k_idx = keep.nonzero(as_tuple=True)
            t_idx = seg.offset[b_idx] + k_idx
            lat[b_idx, t_idx] = sl[b_idx, k_idx]
            rop[b_idx, t_idx] = sr[b_idx, k_idx]
        return lat, rop

    # ------------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        if self.lengths is None:
            return 0
        q_len = self.quantized_lengths()
        n = sum(part.nbytes(q_len) for part in self.parts.values())
        if self.window is not None:
            n += self.window.nbytes(int((self.lengths - q_len).sum()))
        return n

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Keep the first new_lengths[b] tokens of each request (crop)."""
        if self.lengths is None:
            return
        new_lengths = new_lengths.to(self.lengths.device).long()
        if bool((new_lengths > self.lengths).any()):
            raise ShapeError("truncate cannot grow the cache")
        if self.group is not None:
            q_len = self.quantized_lengths()
            if bool((new_lengths < q_len).any()):
                raise ConfigError(
                    f"cannot crop into a completed token group (token_group={self.group}): its raw values were "
                    f"replaced by int codes; crop is only possible within the residual window"
                )
        if self.capacity is None:
            self.lengths = new_lengths
        else:
            self.lengths.copy_(new_lengths)

    def rewind(self, n: int) -> None:
        """Remove the last `n` stored tokens of every request, with no host sync (the caller knows each
        request holds at least n: LatentLayer checks it on the host). In place for preallocated stores."""
        if self.lengths is None or n == 0:
            return
        if self.group is not None:
            raise ConfigError(f"rewind is not available with token_group={self.group}; use crop")
        if self.capacity is None:
            self.lengths = self.lengths - n
        else:
            self.lengths.sub_(n)

    def index_select(self, idx: torch.Tensor) -> None:
        """Rows of the new batch are rows idx of the old one (beam reorder, batch select, repeat)."""
        if self.lengths is None:
            return
        idx = idx.to(self.lengths.device).long()
        fixed = self.capacity is not None
        if self._joint is not None:  # select whole rows once; the parts stay slices of the one buffer
            self._joint = select_rows(self._joint, idx, fixed)
            self._point_parts()
        else:
            for part in self.parts.values():
                part.index_select(idx, in_place=fixed)
        if self.window is not None:
            self.window.index_select(idx)
        self.lengths = select_rows(self.lengths, idx, fixed)


def _compact(latent: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor):
    """Move each request's valid tokens (in order) to the front: -> [B, max(counts), w], zero-filled."""
    B = valid.shape[0]
    n_max = int(counts.max()) if B else 0
    # A stable sort on "is padding" lists each request's valid positions first, in order.
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :n_max]
    keep = (torch.arange(n_max, device=valid.device).view(1, -1) < counts.view(B, 1)).unsqueeze(-1)
    lat = torch.gather(latent, 1, order.unsqueeze(-1).expand(B, n_max, latent.shape[-1]))
    rop = torch.gather(rope, 1, order.unsqueeze(-1).expand(B, n_max, rope.shape[-1]))
    # where, not multiply: padding rows may hold anything (even NaN) and must become exact zeros.
    return torch.where(keep, lat, 0.0), torch.where(keep, rop, 0.0)
