"""Triton kernel of the MoE combine: each token's k expert outputs, weighted and summed, in one pass.

transformers' `grouped_mm` experts end with

    out.index_select(0, pos).view(T, k, H) * top_k_weights.unsqueeze(-1)   # [T, k, H] in fp32
    .sum(dim=1).to(hidden dtype)

three passes over a [T, k, H] tensor, two of them in fp32: at a batch-128 1K-token prefill of the
DeepSeek-V2-Lite shape (T = 131072, k = 6, H = 2048) that is ~25 GB of traffic per MoE layer. Here one
program reads each token's k rows straight from the grouped GEMM's output (by `pos`), multiplies each by
its fp32 routing weight (one correctly rounded fp32 product each, as the promoted `*` gives) and adds
the k products in fp32 in a fixed order, then rounds once to the output dtype: 3.7 GB per layer.

Summation order (`ORDER`), which decides the last bits of the fp32 sum:
  * 0, "sequential": ((0 + p0) + p1) + ... + p_{k-1};
  * 1, "lanes4": four accumulators, lane i holding p_i + p_{i+4} + ... in that order, combined as
    ((l0 + l1) + l2) + l3: the order of torch's CUDA reduction over a dimension that is not the
    innermost (ATen's `Reduce.cuh`: one thread per output, `vt0 = 4` accumulators), which is the
    `.sum(dim=1)` above on a GPU. Every accumulator starts at 0.0, as there (so -0 sums give +0).
The launch disables fp contraction (`enable_fp_fusion=False`): an fma would round product and sum once,
not twice. `snapquant.models.experts` calls it through `combine_slots`; its reference is the torch
expression above with the same order (`combine_slots_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import for_device, interpreting
from .common import bf16_bits_to_f32, store_bf16_bits

ORDERS = {"sequential": 0, "lanes4": 1}


@triton.jit
def _combine_slots_kernel(
    Y, POS, W, OUT, T, H, stride_y, stride_o,
    K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, ORDER: tl.constexpr,
    Y_BF16_BITS: tl.constexpr, OUT_BF16_BITS: tl.constexpr, NATIVE: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok = t < T
    m = t_ok[:, None] & (h < H)[None, :]
    t64 = t.to(tl.int64)
    l0 = tl.full([BT, BH], 0.0, tl.float32)
    l1 = tl.full([BT, BH], 0.0, tl.float32)
    l2 = tl.full([BT, BH], 0.0, tl.float32)
    l3 = tl.full([BT, BH], 0.0, tl.float32)
    for j in tl.static_range(K):
        row = tl.load(POS + t64 * K + j, mask=t_ok, other=0).to(tl.int64)
        y = tl.load(Y + row[:, None] * stride_y + h[None, :], mask=m, other=0)
        if Y_BF16_BITS:
            y = bf16_bits_to_f32(y)
        else:
            y = y.to(tl.float32)
        w = tl.load(W + t64 * K + j, mask=t_ok, other=0.0)
        p = y * w[:, None]
        if ORDER == 0:
            l0 = l0 + p
        elif j % 4 == 0:
            l0 = l0 + p
        elif j % 4 == 1:
            l1 = l1 + p
        elif j % 4 == 2:
            l2 = l2 + p
        else:
            l3 = l3 + p
    if ORDER == 0:
        acc = l0
    else:
        acc = ((l0 + l1) + l2) + l3
    o_ptrs = OUT + t64[:, None] * stride_o + h[None, :]
    if OUT_BF16_BITS:
        tl.store(o_ptrs, store_bf16_bits(acc, NATIVE), mask=m)
    else:
        tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=m)


def combine_slots(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype,
                  order: str = "lanes4") -> torch.Tensor:
    """`y [T*k, H]` (rows in grouped order), `pos [T*k]` (pair t*k + j -> its row of y), fp32 `weights [T, k]`
    -> `[T, H]` in `out_dtype`: sum_j y[pos[t*k + j]] * weights[t, j], fp32 products and sums in `order`."""
    T, k = weights.shape
    H = y.shape[1]
    if order not in ORDERS:
        raise ValueError(f"order must be one of {sorted(ORDERS)}, got {order!r}")
    if weights.dtype != torch.float32 or y.dim() != 2 or y.shape[0] != T * k or pos.shape != (T * k,):
        raise ValueError(f"combine_slots: y [T*k, H], pos [T*k], fp32 weights [T, k]; got y {tuple(y.shape)}, "
                         f"pos {tuple(pos.shape)}, weights {tuple(weights.shape)} {weights.dtype}")
    y = y if y.stride(1) == 1 else y.contiguous()
    out = torch.empty(T, H, dtype=out_dtype, device=y.device)
    native = not interpreting(y.device)
    y_bits = y.dtype == torch.bfloat16 and not native
    o_bits = out_dtype == torch.bfloat16
    BT, BH = 16, 256
    grid = (triton.cdiv(T, BT), triton.cdiv(H, BH))
    kernel = for_device(_combine_slots_kernel, y.device)
    extra = {"enable_fp_fusion": False, "num_warps": 4} if native else {}
    kernel[grid](
        y.view(torch.int16) if y_bits else y, pos.contiguous(), weights.contiguous(),
        out.view(torch.int16) if o_bits else out, T, H, y.stride(0), out.stride(0),
        K=k, BT=BT, BH=BH, ORDER=ORDERS[order], Y_BF16_BITS=y_bits, OUT_BF16_BITS=o_bits, NATIVE=native,
        **extra,
    )
    return out


def combine_slots_reference(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype,
                            order: str = "lanes4") -> torch.Tensor:
    """`combine_slots` in torch operations, the same fp32 products and summation order."""
    T, k = weights.shape
    p = y.index_select(0, pos).view(T, k, -1).float() * weights.unsqueeze(-1)
    if order == "sequential":
        acc = torch.zeros_like(p[:, 0])
        for j in range(k):
            acc = acc + p[:, j]
        return acc.to(out_dtype)
    if order != "lanes4":
        raise ValueError(f"order must be one of {sorted(ORDERS)}, got {order!r}")
    lanes = [torch.zeros_like(p[:, 0]) for _ in range(4)]
    for j in range(k):
        lanes[j % 4] = lanes[j % 4] + p[:, j]
    return (((lanes[0] + lanes[1]) + lanes[2]) + lanes[3]).to(out_dtype)
