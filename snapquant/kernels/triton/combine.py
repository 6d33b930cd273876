"""Triton kernels that merge the split-KV partials of `decode.py` into the final output and LSE.

    mla_decode_combine            uniform schedule: request b's NSPLIT partials of one row and chunk
    mla_decode_combine_balanced   balanced schedule: the partials of the parts that cut request b

Both compute out = sum_s w_s out_s / sum_s w_s with w_s = 2^(lse_s - max lse), lse = max + log2(sum w)
(returned as a natural log); a row that saw no token anywhere gets out = 0, lse = -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .common import LN2, rmax, rsum
from .decode import part_range


@triton.jit
def mla_decode_combine(
    O_PART, LSE_PART, OUT, LSE_OUT,
    stride_pb, stride_pm, stride_ps, stride_lb, stride_lm, stride_ls,
    stride_ob, stride_om, stride_eb,
    NSPLIT, NSPLIT_P2: tl.constexpr, NB: tl.constexpr, BW: tl.constexpr, NATIVE: tl.constexpr,
    PDL: tl.constexpr = False, SB: tl.constexpr = 8,
):
    """out = sum_s w_s out_s / sum_s w_s with w_s = 2^(lse_s - max lse); lse = max + log2(sum w), as ln.
    PDL: launched as a programmatic dependent of stage 1, so wait for that grid (and its writes) first.
    The partial rows are read SB splits at a time, one [SB, BW] tile, so SB loads are in flight together: the
    one-split loop compiled to about two in flight (ncu: 82 % long_scoreboard, ~2 programs per SM)."""
    if PDL:
        gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    chunk = tl.program_id(2)
    offs_s = tl.arange(0, NSPLIT_P2)
    lse_ptr = LSE_PART + b * stride_lb + row * stride_lm + chunk
    lse = tl.load(lse_ptr + offs_s * stride_ls, mask=offs_s < NSPLIT, other=float("-inf"))
    mx = rmax(lse, 0, NATIVE)
    mx_ref = tl.where(mx == float("-inf"), 0.0, mx)
    total = rsum(tl.exp2(lse - mx_ref), 0, NATIVE)
    offs_w = tl.arange(0, BW)
    offs_b = tl.arange(0, SB)
    acc = tl.full([BW], 0.0, tl.float32)
    o_ptr = O_PART + b * stride_pb + row * stride_pm + chunk * BW + offs_w
    for s0 in range(0, NSPLIT, SB):
        split = s0 + offs_b
        w = tl.exp2(tl.load(lse_ptr + split * stride_ls, mask=split < NSPLIT, other=float("-inf")) - mx_ref)
        o = tl.load(o_ptr[None, :] + split[:, None] * stride_ps, mask=split[:, None] < NSPLIT, other=0.0)
        # w = 0 (an empty split, or past NSPLIT): its partial row is never read into the sum (it may be NaN)
        acc += rsum(tl.where(w[:, None] > 0, w[:, None] * o, 0.0), 0, NATIVE)
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(OUT + b * stride_ob + row * stride_om + chunk * BW + offs_w, out)
    if chunk == 0:
        lse_out = tl.where(total > 0, (mx + tl.log2(tl.where(total > 0, total, 1.0))) * LN2, float("-inf"))
        tl.store(LSE_OUT + b * stride_eb + row, lse_out)


@triton.jit
def mla_decode_combine_balanced(
    CUM, O_PART, LSE_PART, OUT, LSE_OUT,
    stride_ps, stride_pm, stride_ls, stride_lm, stride_ob, stride_om, stride_eb,
    B, NPARTS, BW: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge request b's partials (slots first + b .. last + b), as `mla_decode_combine` does.
    Requests that one part covered whole were written by stage 1; empty ones get out 0, lse -inf."""
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    row = tl.program_id(1)
    chunk = tl.program_id(2)
    offs_w = tl.arange(0, BW)
    out_ptr = OUT + b.to(tl.int64) * stride_ob + row * stride_om + chunk * BW + offs_w
    lse_out_ptr = LSE_OUT + b.to(tl.int64) * stride_eb + row
    start = tl.load(CUM + b)
    n = tl.load(CUM + b + 1) - start
    _, _, per = part_range(CUM, 0, B, NPARTS)
    first = start // per
    last = (start + n - 1) // per
    if n == 0:
        tl.store(out_ptr, tl.full([BW], 0.0, tl.float32))
        if chunk == 0:
            tl.store(lse_out_ptr, float("-inf"))
    elif first < last:
        lse_ptr = LSE_PART + row * stride_lm + chunk
        o_ptr = O_PART + row * stride_pm + chunk * BW + offs_w
        mx = float("-inf")
        for s in range(first, last + 1):
            mx = tl.maximum(mx, tl.load(lse_ptr + (s + b).to(tl.int64) * stride_ls))
        mx_ref = tl.where(mx == float("-inf"), 0.0, mx)
        total = 0.0
        acc = tl.full([BW], 0.0, tl.float32)
        for s in range(first, last + 1):
            w = tl.exp2(tl.load(lse_ptr + (s + b).to(tl.int64) * stride_ls) - mx_ref)
            o = tl.load(o_ptr + (s + b).to(tl.int64) * stride_ps)
            acc += tl.where(w > 0, w * o, 0.0)
            total += w
        tl.store(out_ptr, tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0))
        if chunk == 0:
            lse_out = tl.where(total > 0, (mx + tl.log2(tl.where(total > 0, total, 1.0))) * LN2, float("-inf"))
            tl.store(lse_out_ptr, lse_out)
