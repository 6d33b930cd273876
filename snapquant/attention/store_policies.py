"""The storage policies of the latent store: how one cache part keeps its codes and scales, and KIVI's window.

A store (snapquant.attention.storage) keeps two parts, the latent ("nope") and the RoPE key, each over
ragged token rows `[B, capacity, ...]`; each part follows one policy, chosen by `part_policy` from the
`KVQuantConfig` (docs/numerics.md, "What the cache stores"):

    PassThrough   16-bit (or the model's own dtype for identity configs) values, no scale
    RowScales     codes + one scale row per token (per_token / per_token_block: the 644 B/token layout)
    FrozenScales  codes + one scale tensor computed at the first append and then frozen (per_tensor_static
                  / per_tensor_dynamic / per_channel over the sequence, which are not causal-consistent:
                  later tokens reuse it and saturate if they exceed it, as HF's QuantizedCache does)
    GroupScales   codes + one scale row per `group` tokens (KIVI: per_channel with token_group G)

and a KIVI store also keeps a `KiviWindow`: the tokens of the last incomplete group, raw in the model's
dtype, until G of them (per request) are there.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..config import KVQuantConfig
from ..constants import PAGE_SIZE
from ..errors import ShapeError
from ..quant.dtypes import ElementFormat
from ..quant.tensor import QuantizedTensor


class PartPolicy:
    """Codes (and scales, per the subclass) of one cache part over ragged rows `[B, capacity, ...]`."""

    layout: ClassVar[str]  # "none" | "row" | "shared" | "group": the scale layout, as reports name it
    group: int = 1  # tokens per scale row

    def __init__(self, fmt: ElementFormat, width: int, granularity: str, scale_fmt=None) -> None:
        self.fmt, self.width, self.granularity, self.scale_fmt = fmt, width, granularity, scale_fmt
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    # ------------------------------------------------------------------ allocation
    def ensure(self, batch: int, capacity: int, like_codes: torch.Tensor, like_scale: torch.Tensor | None,
               fixed: int | None = None) -> None:
        """Grow the row buffers to `capacity` tokens (keeping what is stored).

        fixed: a preallocated store's capacity: the buffers get exactly that many rows at the first call
        and are never reallocated (`capacity` beyond it is the caller's error to report)."""
        if self.codes is None:
            rows = 0 if fixed is None else fixed
            self.codes = like_codes.new_zeros(batch, rows, like_codes.shape[-1])
            self._allocate_scale(batch, rows, like_scale)
        if fixed is not None:
            return
        if self.codes.shape[1] < capacity:
            self.codes = grow_rows(self.codes, capacity)
            self._grow_scale(capacity)

    def _allocate_scale(self, batch: int, rows: int, like_scale: torch.Tensor | None) -> None:
        """Scale buffers that live beside the token rows (none by default)."""

    def _grow_scale(self, capacity: int) -> None:
        """Grow the scale buffers with the token rows (nothing by default)."""

    # ------------------------------------------------------------------ writing
    def write(self, data: torch.Tensor, scale: torch.Tensor | None, dst: tuple, src: tuple | None = None) -> None:
        """Store quantized tokens: `codes[dst] = data[src]` (src None: `data` is already indexed like dst),
        and their scales as the policy keeps them."""
        self.codes[dst] = data if src is None else data[src]
        self._write_scale(scale, dst, src)

    def _write_scale(self, scale: torch.Tensor | None, dst: tuple, src: tuple | None) -> None:
        """Nothing to store by default (no scale, or scales written per group)."""

    def write_grouped(self, data: torch.Tensor, scale: torch.Tensor | None, dst: tuple, src: tuple,
                      group_dst: tuple, group_src: tuple) -> None:
        """Store tokens quantized a group at a time: `data [B, F*G, w]` (as `write`), `scale` as the quantizer
        gave it for `[B*F, G, w]`; group f of request b is written at `group_dst` from `group_src`."""
        self.write(data, scale, dst, src)

    def frozen_scale(self) -> torch.Tensor | None:
        """The decoded scale every later token must be quantized with (FrozenScales once frozen), else None."""
        return None

    # ------------------------------------------------------------------ reading
    def view(self, n_rows: int) -> QuantizedTensor:
        """The first `n_rows` rows of every request as a QuantizedTensor (a view, no copy)."""
        return QuantizedTensor(self.codes[:, :n_rows], None, self.fmt, None, self.granularity, self.width,
                               token_group=1)

    def nbytes(self, lengths: torch.Tensor) -> int:
        """Bytes held for `lengths[b]` tokens per request (capacity slack is not counted)."""
        if self.codes is None:
            return 0
        return int(lengths.sum()) * self.codes.shape[-1] * self.codes.element_size() + self._scale_nbytes(lengths)

    def _scale_nbytes(self, lengths: torch.Tensor) -> int:
        return 0

    def index_select(self, idx: torch.Tensor, in_place: bool = False) -> None:
        """Rows of the new batch are rows idx of the old one (in place keeps a preallocated buffer's memory)."""
        if self.codes is None:
            return
        self.codes = select_rows(self.codes, idx, in_place)
        if self.scale is not None:
            self.scale = select_rows(self.scale, idx, in_place)


class PassThrough(PartPolicy):
    """Values stored as they are: 16-bit formats, or the model's own dtype for identity configs."""

    layout = "none"


class RowScales(PartPolicy):
    """Codes plus one scale row per token (`scale [B, capacity, blocks]`)."""

    layout = "row"

    def _allocate_scale(self, batch, rows, like_scale):
        if like_scale is not None:
            self.scale = like_scale.new_zeros(batch, rows, like_scale.shape[-1])

    def _grow_scale(self, capacity):
        self.scale = grow_rows(self.scale, capacity)

    def _write_scale(self, scale, dst, src):
        self.scale[dst] = scale if src is None else scale[src]

    def write_grouped(self, data, scale, dst, src, group_dst, group_src):
        self.write(data, scale.reshape(*data.shape[:2], scale.shape[-1]), dst, src)  # [B*F, G, nb] -> [B, F*G, nb]

    def view(self, n_rows):
        return QuantizedTensor(self.codes[:, :n_rows], self.scale[:, :n_rows], self.fmt, self.scale_fmt,
                               self.granularity, self.width, token_group=1)

    def _scale_nbytes(self, lengths):
        return int(lengths.sum()) * self.scale.shape[-1] * self.scale.element_size()


class FrozenScales(PartPolicy):
    """Codes plus one scale tensor (`[1 | B, 1, blocks]`), taken from the first append and then kept."""

    layout = "shared"

    def _write_scale(self, scale, dst, src):
        if self.scale is None:
            self.scale = scale.clone()  # frozen from the first append (the prefill)

    def frozen_scale(self):
        return None if self.scale is None else self.scale_fmt.decode(self.scale)

    def view(self, n_rows):
        batch = self.codes.shape[0]
        if self.scale.shape[0] not in (1, batch):
            raise ShapeError(f"frozen scale of shape {tuple(self.scale.shape)} does not match batch {batch}")
        return QuantizedTensor(self.codes[:, :n_rows], self.scale, self.fmt, self.scale_fmt, self.granularity,
                               self.width, token_group=None)

    def _scale_nbytes(self, lengths):
        return 0 if self.scale is None else self.scale.numel() * self.scale.element_size()

    def index_select(self, idx, in_place=False):
        if self.codes is None:
            return
        self.codes = select_rows(self.codes, idx, in_place)
        if self.scale is not None and self.scale.shape[0] > 1:  # a scale shared by the batch stays as it is
            self.scale = select_rows(self.scale, idx, in_place)


class GroupScales(PartPolicy):
    """Codes plus one scale row per `group` tokens (`scale [B, capacity / group, width]`), written per group."""

    layout = "group"

    def __init__(self, fmt, width, granularity, scale_fmt, group: int) -> None:
        super().__init__(fmt, width, granularity, scale_fmt)
        self.group = group

    def _allocate_scale(self, batch, rows, like_scale):
        if like_scale is not None:
            self.scale = like_scale.new_zeros(batch, math.ceil(rows / self.group), like_scale.shape[-1])

    def _grow_scale(self, capacity):
        self.scale = grow_rows(self.scale, capacity // self.group)

    def write_grouped(self, data, scale, dst, src, group_dst, group_src):
        self.write(data, None, dst, src)
        self.scale[group_dst] = scale.reshape(data.shape[0], -1, scale.shape[-1])[group_src]  # [B*F, 1, w] -> [B, F, w]

    def view(self, n_rows):
        n_groups = math.ceil(n_rows / self.group)
        return QuantizedTensor(self.codes[:, :n_rows], self.scale[:, :n_groups], self.fmt, self.scale_fmt,
                               self.granularity, self.width, token_group=self.group)

    def _scale_nbytes(self, lengths):
        return int((lengths // self.group).sum()) * self.scale.shape[-1] * self.scale.element_size()


def part_policy(config: KVQuantConfig, part: str, width: int, scale_fmt) -> PartPolicy:
    """The policy that stores `part` ("nope" | "rope") of a quantized (non-identity) `config`."""
    fmt, gran = config.part_format(part), config.part_granularity(part)
    if not fmt.is_quantized or (part == "rope" and config.rope_prescale):
        return PassThrough(fmt, width, gran)
    if gran in ("per_token", "per_token_block"):
        return RowScales(fmt, width, gran, scale_fmt)
    if gran == "per_channel" and config.token_group is not None:
        return GroupScales(fmt, width, gran, scale_fmt, config.token_group)
    return FrozenScales(fmt, width, gran, scale_fmt)  # per_tensor_static / _dynamic / per_channel over the sequence


class KiviWindow:
    """KIVI's residual window: each request's last `lengths % group` tokens, raw in the model's dtype.

    `tensors` = (latent [B, group, r], rope [B, group, d]); row k of request b is its (k+1)-th pending token.
    """

    def __init__(self, group: int, act_dtype: torch.dtype) -> None:
        self.group, self.act_dtype = group, act_dtype
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def pending(self, latent: torch.Tensor, rope: torch.Tensor, counts: torch.Tensor, held: torch.Tensor):
        """The window's `held[b]` tokens followed by the first `counts[b]` new ones, in the model's dtype:
        (latent [B, P, r], rope [B, P, d], total [B]), rows past total[b] zero."""
        B, G, dev = latent.shape[0], self.group, latent.device
        r, d = latent.shape[-1], rope.shape[-1]
        if self.tensors is None:
            self.tensors = (latent.new_zeros(B, G, r).to(self.act_dtype), rope.new_zeros(B, G, d).to(self.act_dtype))
        total = held + counts
        p_max = max(int(total.max()) if B else 0, 1)
        pend_l = latent.new_zeros(B, p_max, r, dtype=self.act_dtype)
        pend_r = rope.new_zeros(B, p_max, d, dtype=self.act_dtype)
        cols = torch.arange(p_max, device=dev).view(1, -1)
        b_o, k_o = (cols < held.view(B, 1)).nonzero(as_tuple=True)
        pend_l[b_o, k_o] = self.tensors[0][b_o, k_o]
        pend_r[b_o, k_o] = self.tensors[1][b_o, k_o]
        b_n, k_n = ((cols >= held.view(B, 1)) & (cols < total.view(B, 1))).nonzero(as_tuple=True)
        src = k_n - held[b_n]
        pend_l[b_n, k_n] = latent[b_n, src].to(self.act_dtype)
        pend_r[b_n, k_n] = rope[b_n, src].to(self.act_dtype)
        return pend_l, pend_r, total

    def keep(self, pend_l: torch.Tensor, pend_r: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
        """The window becomes rows `[start[b], start[b] + count[b])` of the pending tokens."""
        res_l, res_r = self.tensors
        res_l.zero_()
        res_r.zero_()
        B, G = res_l.shape[0], self.group
        b_k, k_k = (torch.arange(G, device=res_l.device).view(1, G) < count.view(B, 1)).nonzero(as_tuple=True)
        src = start[b_k] + k_k
        res_l[b_k, k_k] = pend_l[b_k, src]
        res_r[b_k, k_k] = pend_r[b_k, src]

    def view(self, n_rows: int, fmt: ElementFormat) -> tuple[QuantizedTensor, QuantizedTensor]:
        """The first `n_rows` window rows as unscaled QuantizedTensors in `fmt` (the model's passthrough)."""
        res_l, res_r = self.tensors
        return (QuantizedTensor(res_l[:, :n_rows], None, fmt, None, "per_token", res_l.shape[-1], 1),
                QuantizedTensor(res_r[:, :n_rows], None, fmt, None, "per_token", res_r.shape[-1], 1))

    def nbytes(self, tokens: int) -> int:
        if self.tensors is None:
            return 0
        res_l, res_r = self.tensors
        return tokens * (res_l.shape[-1] + res_r.shape[-1]) * res_l.element_size()

    def index_select(self, idx: torch.Tensor) -> None:
        if self.tensors is not None:
            self.tensors = tuple(t.index_select(0, idx) for t in self.tensors)


def select_rows(t: torch.Tensor, idx: torch.Tensor, in_place: bool) -> torch.Tensor:
    """`t[idx]` along the batch; in place when the shape is unchanged (a preallocated buffer keeps its memory,
    which CUDA graphs read)."""
    picked = t.index_select(0, idx.to(t.device))
    if in_place and picked.shape == t.shape:
        return t.copy_(picked)
    return picked


def grow_rows(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """`t [B, rows, ...]` with at least `capacity` rows (doubling, in whole pages), the old rows kept."""
    cap = max(PAGE_SIZE, t.shape[1])
    while cap < capacity:
        cap *= 2
    cap = math.ceil(cap / PAGE_SIZE) * PAGE_SIZE
    out = t.new_zeros(t.shape[0], cap, *t.shape[2:])
    out[:, : t.shape[1]] = t
    return out
