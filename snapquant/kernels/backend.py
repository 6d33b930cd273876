"""The `triton` decode backend for `snapquant.attention.backends` (the patch's seam), which registers it.

The seam calls a backend with the reference's signature, over a contiguous-rows `QuantizedKV`
(`latent.data [B, T, r]`, one scale row per token, RoPE `[B, T, d]`), usually row slices of the
patch's store buffers `[B, capacity, ...]`. Those rows already are the kernel's layout: request b's
token t sits at flat row b * capacity + t of every tensor, so 64-row chunks of it are pages whose
"page id" is the flat row of their first token (page stride = one row). `operands_from_kv` builds
that block table and launches on the store's own memory, with no copy and no conversion per step.

Falls back to `mla_decode_reference` (with a one-time warning) where the kernels cannot run the
call exactly: round_16bit=False (an fp32 model's identity config), a stored format that is not a
kernel layout (fp32 passthrough, KIVI groups, ...), widths below 16 or not powers of two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..config import KVQuantConfig
from ..errors import ShapeError
from ..quant.quantizer import QuantizedKV
from ..reference import mla_decode_reference
from ..runtime import lengths_trusted, stream_capturing, warn_once
from ._checks import raise_on_flags
from .decode import launch_decode
from .layouts import PAGE_SIZE, layout_of, unsupported_reason
from .operands import KernelOperands
from .options import DecodeOptions

_INT32_MAX = 2**31 - 1


def triton_backend(
    q: torch.Tensor,
    kv: QuantizedKV,
    lengths: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    config: KVQuantConfig | None = None,
    *,
    causal: bool = True,
    round_16bit: bool = True,
    options: DecodeOptions | Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `mla_decode_reference` running the kernels (see the module docstring); `options` are the
    decode's knobs (`snapquant.kernels.DecodeOptions`, default: `dispatch`'s choice for the call)."""
    cfg = config or kv.config
    reason = kernel_mismatch(kv, cfg, round_16bit)
    if reason is not None:
        warn_once(f"snapquant triton backend: using the reference decode because {reason}")
        return mla_decode_reference(q, kv, lengths, softmax_scale, cfg, causal=causal, round_16bit=round_16bit)
    ops = operands_from_kv(kv, lengths, cfg)
    tau = 1.0 / math.sqrt(ops.kv_lora_rank + ops.rope_dim) if softmax_scale is None else float(softmax_scale)
    return launch_decode(q, ops, tau, cfg, causal=causal, options=options)


def kernel_mismatch(kv: QuantizedKV, config: KVQuantConfig, round_16bit: bool = True) -> str | None:
    """Why the kernel cannot run this call exactly as the reference would; None when it can."""
    if not round_16bit:
        return "round_16bit=False (the kernels round the query and P to 16 bits)"
    if not isinstance(kv, QuantizedKV):
        return f"kv is a {type(kv).__name__}, not a QuantizedKV"
    lat, rope = kv.latent, kv.rope
    if lat.data.dim() != 3 or rope.data.dim() != 3:
        return f"the cache is not [B, T, width] (latent {tuple(lat.data.shape)})"
    reason = unsupported_reason(config, lat.width, rope.width)
    if reason is not None:
        return reason
    layout = layout_of(config)
    if rope.data.dtype != torch.bfloat16 or rope.scale is not None:
        return f"RoPE is stored as {rope.data.dtype}, not plain bf16"
    if kv.rope_prescaled != (layout == "snapmla"):
        return f"rope_prescaled={kv.rope_prescaled} does not match the {layout} layout"
    if layout == "bf16":
        if lat.data.dtype != torch.bfloat16 or lat.scale is not None:
            return f"the latent is stored as {lat.data.dtype}, not bf16 (e.g. an fp32 model's identity cache)"
        return None
    nb = 1 if layout == "snapmla" else lat.width // config.block_size
    if lat.data.dtype != torch.float8_e4m3fn or lat.scale is None or lat.scale.dtype != torch.float32:
        return f"the latent is stored as {lat.data.dtype} with scales {getattr(lat.scale, 'dtype', None)}"
    if lat.token_group != 1 or lat.scale.dim() != 3 or lat.scale.shape[-1] != nb:
        return f"the latent's scales are not one row of {nb} per token (shape {tuple(lat.scale.shape)})"
    return None


def operands_from_kv(kv: QuantizedKV, lengths: torch.Tensor | None, config: KVQuantConfig) -> KernelOperands:
    """Zero-copy kernel operands over `kv`'s rows (copies only when the three tensors' strides disagree).

    Checks lengths against T (one device sync, as the reference does), except inside
    `snapquant.runtime.trusted_lengths()` or while a CUDA graph is being captured."""
    layout = layout_of(config)
    latent, rope = kv.latent.data, kv.rope.data
    scale = kv.latent.scale
    tensors = [latent, rope] + ([] if scale is None else [scale])
    B, T = latent.shape[0], latent.shape[1]
    if (scale is not None and scale.shape[:2] != (B, T)) or rope.shape[:2] != (B, T):
        raise ShapeError(f"latent {tuple(latent.shape)}, rope {tuple(rope.shape)} and scale rows must agree")
    rows = _rows_per_request(tensors)
    if rows is None:  # not one shared row pitch: make the rows dense (a copy)
        tensors = [t.contiguous() for t in tensors]
        latent, rope = tensors[0], tensors[1]
        scale = tensors[2] if scale is not None else None
        rows = T
    if (B - 1) * rows + T > _INT32_MAX:
        raise ShapeError(f"the cache spans {(B - 1) * rows + T} rows, beyond int32 page ids")
    dev = latent.device
    n_pages = math.ceil(T / PAGE_SIZE)
    block_table = dense_block_table(B, rows, n_pages, dev)
    if lengths is None:
        lens = torch.full((B,), T, dtype=torch.int32, device=dev)
    else:
        lens = torch.as_tensor(lengths, device=dev)
        if lens.shape != (B,):
            raise ShapeError(f"lengths must have shape [B={B}], got {tuple(lens.shape)}")
        if not lengths_trusted():  # a host read; skipped by the fixed-shape decode step and in graph capture
            raise_on_flags(((lens < 0) | (lens > T)).any()[None],
                           [f"lengths must lie in [0, {T}] (the cache holds {T} tokens)"])
        lens = lens.to(torch.int32).contiguous()
    st_l, st_r = latent.stride(1), rope.stride(1)
    if scale is None:
        scale_arg, s_strides = lens, (0, 0, 0)
    else:
        scale_arg, s_strides = scale, (scale.stride(1), scale.stride(1), scale.stride(2))
    lat_arg = latent.view(torch.int16) if layout == "bf16" else latent
    return KernelOperands(layout, lat_arg, rope.view(torch.int16), scale_arg, (st_l, st_l), (st_r, st_r),
                          s_strides, block_table, lens, kv.latent.width, kv.rope.width,
                          1 if scale is None else scale.shape[-1])


_BLOCK_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_BLOCK_TABLES = 64


def dense_block_table(B: int, rows: int, n_pages: int, device: torch.device) -> torch.Tensor:
    """`[B, n_pages]` int32: page p of request b at row b * rows + 64 p of one table of rows.

    The same few shapes recur every decode step (a preallocated cache's), and building one is five small
    launches per layer and step; so each is built once, eagerly, and reused (the kernels only read it). While
    a CUDA graph is being captured a missing table is built inside the graph and not kept: a tensor recorded
    there holds its values only once the graph runs."""
    key = (B, rows, n_pages, device.type, device.index)
    table = _BLOCK_TABLES.get(key)
    if table is None:
        table = (torch.arange(B, device=device)[:, None] * rows
                 + torch.arange(n_pages, device=device)[None, :] * PAGE_SIZE).to(torch.int32)
        if not stream_capturing():
            if len(_BLOCK_TABLES) >= _MAX_BLOCK_TABLES:
                _BLOCK_TABLES.pop(next(iter(_BLOCK_TABLES)))
            _BLOCK_TABLES[key] = table
    return table


def _rows_per_request(tensors: list[torch.Tensor]) -> int | None:
    """The row pitch between requests shared by all tensors (stride(0) / stride(1)), or None."""
    B = tensors[0].shape[0]
    pitches = set()
    for t in tensors:
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            return None
        if t.shape[1] > 1 and t.stride(1) < t.shape[-1]:
            return None  # rows overlap (a broadcast or expanded tensor)
        if B > 1:
            if t.stride(1) == 0 or t.stride(0) % t.stride(1):
                return None
            pitches.add(t.stride(0) // t.stride(1))
    if B == 1:
        return tensors[0].shape[1]
    return pitches.pop() if len(pitches) == 1 else None


