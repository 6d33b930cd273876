"""The split-KV combine (`triton/combine.py`, uniform schedule) against a float64 model, in the Triton interpreter.

out = sum_s w_s out_s / sum_s w_s with w_s = 2^(lse_s - max lse) and lse = max + log2(sum w) (as ln). The kernel
reads the partial rows SB splits at a time; what must hold whatever the block size: split counts that are not a
multiple of it, empty splits (lse = -inf) whose partial rows hold NaN (never read into the sum), rows that saw
nothing anywhere (out 0, lse -inf), and the fp32 error of a sum of NSPLIT terms."""

from __future__ import annotations

import math

import pytest
import torch
import triton

from snapquant.kernels._launch import for_device
from snapquant.kernels.triton.combine import mla_decode_combine

BW = 64  # channels per program (the kernel's chunk)


def _combine(o_part, lse_part, sb):
    B, rows, nsplit, r = o_part.shape
    out = torch.empty(B, rows, r)
    lse = torch.empty(B, rows)
    nb = r // BW
    # [B, rows, splits, chunks], as stage 1 writes it; every chunk of a row carries the row's LSE
    lse_rep = lse_part.unsqueeze(-1).expand(B, rows, nsplit, nb).contiguous()
    kernel = for_device(mla_decode_combine, o_part.device)
    kernel[(B, rows, nb)](o_part, lse_rep, out, lse,
                          o_part.stride(0), o_part.stride(1), o_part.stride(2),
                          lse_rep.stride(0), lse_rep.stride(1), lse_rep.stride(2),
                          out.stride(0), out.stride(1), lse.stride(0), nsplit,
                          NSPLIT_P2=triton.next_power_of_2(nsplit), NB=nb, BW=BW, NATIVE=False, SB=sb)
    return out, lse


def _model(o_part, lse_part):
    """The same formula in float64, over the non-empty splits only."""
    lse = lse_part.double()
    mx = lse.amax(-1, keepdim=True)
    mx_ref = torch.where(torch.isinf(mx) & (mx < 0), torch.zeros_like(mx), mx)
    w = torch.exp2(lse - mx_ref)
    o = torch.where(w.unsqueeze(-1) > 0, o_part.double(), torch.zeros((), dtype=torch.float64))
    total = w.sum(-1)
    out = (w.unsqueeze(-1) * o).sum(-2) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    bound = (w.unsqueeze(-1) * o.abs()).sum(-2) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    lse_out = torch.where(total > 0, (mx.squeeze(-1) + torch.log2(torch.where(total > 0, total, 1.0))) * math.log(2),
                          torch.tensor(float("-inf"), dtype=torch.float64))
    return out, lse_out, bound


@pytest.mark.parametrize("nsplit,sb", [(1, 8), (5, 8), (8, 8), (13, 8), (33, 8), (70, 8), (33, 4), (9, 16)])
def test_combine_matches_the_float64_formula(nsplit, sb):
    seed = torch.seed()  # fresh inputs every run; the seed is in every failure message
    g = torch.Generator().manual_seed(seed)
    B, rows, r = 2, 3, 2 * BW
    o_part = torch.randn(B, rows, nsplit, r, generator=g)
    lse_part = torch.randn(B, rows, nsplit, generator=g) * 4
    # empty splits (a split past the request's pages, or a row that saw none of its tokens): lse = -inf and a
    # partial row that may be anything, NaN included
    empty = torch.rand(B, rows, nsplit, generator=g) < 0.3
    empty[0, 0] = True  # a row that saw nothing anywhere
    lse_part[empty] = float("-inf")
    o_part[empty] = float("nan")
    out, lse = _combine(o_part, lse_part, sb)
    ref, ref_lse, bound = _model(o_part, lse_part)
    assert torch.isfinite(out).all(), seed
    assert torch.equal(out[0, 0], torch.zeros(r)) and lse[0, 0] == float("-inf"), seed
    # fp32: each of the <= nsplit products and additions, the exp2 weights (a few ulp each) and the division
    # move the result by a few units of 2^-24 of sum_s w_s |o_s| / sum_s w_s
    tol = (nsplit + 8) * 2.0 ** -24 * 4
    assert ((out.double() - ref).abs() <= tol * bound + 1e-30).all(), seed
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), seed
    assert ((lse.double() - ref_lse)[seen].abs() <= 1e-5).all(), seed
