"""Triton kernel grouping a decode step's (token, slot) pairs by expert: order, its inverse and the offsets.

`snapquant.models.experts.group_by_expert` ranks each pair's key (expert * S + pair index) against every
other key and counts the pairs of each expert with torch operations: about eight small kernels per MoE
layer and step (arange, add, an [S, S] compare, a sum, a scatter, an [E, S] compare, a sum), ~200 launches
in a 27-layer step that each cost a few microseconds of a graph replay whatever their size. Here one launch
does it: program i ranks pairs [64 i, 64 i + 64) against all S keys (`pos`), stores `order[pos] = pair`,
and the first ceil(E / 64) programs count the pairs at or below each of their experts (`offs`). Integer
arithmetic only: the outputs are the torch operations' exactly (tests compare them on every input).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import for_device, interpreting
from .common import rsum

BLOCK_I = 64  # pairs (or experts) per program
BLOCK_J = 256  # keys compared per step


@triton.jit
def _group_kernel(FLAT, ORDER, POS, OFFS, S, E, BI: tl.constexpr, BJ: tl.constexpr, NATIVE: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BI + tl.arange(0, BI)
    i_ok = i < S
    fi = tl.load(FLAT + i, mask=i_ok, other=0).to(tl.int64)
    ki = fi * S + i
    rank = tl.full([BI], 0, tl.int64)
    for j0 in range(0, S, BJ):
        j = j0 + tl.arange(0, BJ)
        fj = tl.load(FLAT + j, mask=j < S, other=0).to(tl.int64)
        kj = fj * S + j
        less = (kj[None, :] < ki[:, None]) & (j < S)[None, :]
        rank += rsum(less.to(tl.int64), 1, NATIVE)
    tl.store(POS + i, rank, mask=i_ok)
    tl.store(ORDER + rank, i.to(tl.int64), mask=i_ok)
    e = pid * BI + tl.arange(0, BI)
    if pid * BI < E:
        e_ok = e < E
        cnt = tl.full([BI], 0, tl.int32)
        for j0 in range(0, S, BJ):
            j = j0 + tl.arange(0, BJ)
            fj = tl.load(FLAT + j, mask=j < S, other=E).to(tl.int64)
            cnt += rsum((fj[None, :] <= e[:, None]).to(tl.int32), 1, NATIVE)
        tl.store(OFFS + e, cnt, mask=e_ok)


def group_pairs(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flat [S]` expert ids of the (token, slot) pairs -> `(order, pos, offs)` as `group_by_expert` defines
    them: `order` the pairs grouped by expert (pair order kept within an expert), `pos` its inverse, `offs`
    int32 the end of each expert's rows. One kernel launch; no host sync."""
    if flat.dim() != 1:
        raise ValueError(f"group_pairs: flat must be [S], got {tuple(flat.shape)}")
    S = flat.numel()
    order = torch.empty(S, dtype=torch.long, device=flat.device)
    pos = torch.empty(S, dtype=torch.long, device=flat.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    grid = (max(triton.cdiv(S, BLOCK_I), triton.cdiv(num_experts, BLOCK_I)),)
    for_device(_group_kernel, flat.device)[grid](flat.contiguous(), order, pos, offs, S, num_experts,
                                                 BI=BLOCK_I, BJ=BLOCK_J,
                                                 NATIVE=not interpreting(flat.device))
    return order, pos, offs
