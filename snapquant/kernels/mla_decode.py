"""Split-KV absorbed MLA decode over the paged cache, with an LSE combine.

Stage 1, one program per (request, tile of BLOCK_M query rows, KV split, output chunk). Rows are
(query token, head) pairs, so several query tokens per request (s_q > 1, speculative verification)
share every KV page the way heads do. Each program walks its split's pages (64 tokens = one
online-softmax block, the reference's pv_block) and follows `snapquant.mla_decode_reference`
(numerics.md) step by step:

  query   fp8: sigma = amax(q_c) / 448, q^ = e4m3(q_c / sigma), q~r = bf16(q_r / sigma)
          bf16: sigma = 1, q^ = bf16(q_c), q~r = bf16(q_r)
  scores  snapmla: x = s_j * (<q^, c^_j> + <q~r, r~_j>) * sigma * tau * log2(e)
          ds_v32:  x = (sum_k s_jk <q^_k, c^_jk> + <q~r, r_j>) * sigma * tau * log2(e)
          bf16:    x = (<q^, c_j> + <q~r, r_j>) * tau * log2(e)
          The token scale multiplies score columns, never the latent tile, so converting the
          tile for the MMA is an exact widening.
  softmax m_new = max(m, max_j x), e = exp2(x - m_new), alpha = exp2(m - m_new)
  PV      bf16: P = bf16(e * s_j); acc = alpha acc + P @ c^; l = alpha l + sum e
          fp8_scale_fused: f = e * s_j, pi = max_j f / 448, P^ = e4m3(f / pi),
          beta = alpha pi_old / pi; acc = beta acc + P^ @ c^; l = beta l + sum e / pi
  result  out = acc / l, lse = m + log2(l pi) (per split; natural log when there is one split)

One deliberate difference, in fp8_scale_fused only: pi is floored at
max(2^-40 * (largest earlier pi, rescaled to the current max), 2^-100). The acc is kept in units of
the current block's pi, so a block whose peak is far below an earlier one's makes pi_old / pi
overflow fp32 (or f_max / 448 underflow to 0), and the reference returns inf / NaN there (score
ranges beyond ~90 in log2 units). The relative floor engages only for blocks whose whole
contribution is < 2^-34 of the total (their P then rounds toward 0); the absolute one only for
latents whose amax is below ~1e-24 (token scales near the 2^-86 floor). Elsewhere: no change.

The ds_v32 layout scales each block of `block_size` latent channels separately, so V's scale
varies along both axes of the PV product: each program then owns one output chunk of block_size
channels with its own P (and pi), as the reference does, and computes the full-width scores
(r / block_size times the QK work: a compile-time variant for comparisons, not tuned).

Stage 2 (only with more than one split) merges the splits by their LSE.

On a GPU the MMAs are bf16 (bf16 query / P) or fp16 over e4m3 values (fp8 query / P): both have
exact products and fp32 accumulation, i.e. the reference's arithmetic; `fp8_mma=True` switches the
fp8 x fp8 products to Hopper's native FP8 MMA, which is less precise (see `_tl`).

Numerical contract against the reference (tested in tests/test_kernels_decode.py): with one split
the kernel performs the reference's arithmetic (only fp32 summation order differs); with several
splits each split's running max differs, so bf16 / fp8 P are rounded from differently scaled
values. Interpreter mode (CPU) holds every narrow value as its exact fp32 value (see `_tl`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..config import KVQuantConfig
from ..errors import ConfigError, ShapeError
from ._checks import check_tensor
from ._launch import for_device, interpreting
from ._tl import (
    BF16_MAX,
    E4M3_MAX,
    OP_BF16,
    OP_F32,
    OP_FP8,
    OP_FP16,
    bf16_bits_to_f32,
    bits16,
    mma,
    operand,
    rmax,
    round_bf16,
    round_e4m3,
    rsum,
    scale_rule,
)
from .layouts import PAGE_SIZE, layout_of, unsupported_reason
from .paged import PagedMLACache

_LAYOUT_ID = {"bf16": 0, "snapmla": 1, "ds_v32": 2}
LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))
PI_REL_FLOOR = tl.constexpr(2.0**-40)
PI_ABS_FLOOR = tl.constexpr(2.0**-100)


@triton.jit
def _load_q(ptrs, mask, BITS16: tl.constexpr):
    if BITS16:
        return bf16_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_latent(ptrs, mask, LAYOUT: tl.constexpr):
    """Masked latent tile load; masked rows must read as exact zeros (they meet P = 0 in the MMA)."""
    if LAYOUT == 0:  # bf16 bits
        return tl.load(ptrs, mask=mask, other=0)
    else:  # fp8
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _quantize_q(q, sigma, Q_FP8: tl.constexpr, NATIVE: tl.constexpr):
    """NoPE query values: e4m3(q / sigma) or bf16(q)."""
    if Q_FP8:
        return round_e4m3(tl.clamp(tl.math.div_rn(q, sigma[:, None]), -E4M3_MAX, E4M3_MAX), NATIVE)
    else:
        return round_bf16(q, NATIVE)


@triton.jit
def _mla_decode_stage1(
    Q, LAT, ROPE, SCALE, BT, LENS, O_PART, LSE_PART,
    sm_scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk, stride_bt,
    stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
    S: tl.constexpr, H: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
    LAYOUT: tl.constexpr, Q_FP8: tl.constexpr, P_FP8: tl.constexpr, Q_BITS16: tl.constexpr,
    NSPLIT, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
    NATIVE: tl.constexpr, QK_KIND: tl.constexpr, PV_KIND: tl.constexpr, R_KIND: tl.constexpr,
    LSE_NATURAL: tl.constexpr,
):
    BW: tl.constexpr = R // NB  # channels per scale block = width of this program's output chunk
    b = tl.program_id(0)
    split = tl.program_id(2) // NB
    chunk = tl.program_id(2) % NB

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S * H
    q_ptr = Q + b.to(tl.int64) * stride_qb + (rows // H) * stride_qs + (rows % H) * stride_qh
    length = tl.load(LENS + b)
    if CAUSAL:  # query token i of S sees cache positions < length - (S - 1 - i)
        limit = length - (S - 1 - rows // H)
    else:
        limit = length + 0 * rows
    limit = tl.where(row_ok, limit, 0)

    # ---- query: per-row scale (fp8) and the RoPE operand, once per program
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, D)
    q_full = _load_q(q_ptr[:, None] + offs_r[None, :], row_ok[:, None], Q_BITS16)
    if Q_FP8:
        amax = rmax(tl.abs(q_full), 1, NATIVE)
        sigma = scale_rule(amax, False)
    else:
        sigma = tl.full([BLOCK_M], 1.0, tl.float32)
    q_rope = _load_q(q_ptr[:, None] + R + offs_d[None, :], row_ok[:, None], Q_BITS16)
    if Q_FP8:
        q_rope = tl.clamp(tl.math.div_rn(q_rope, sigma[:, None]), -BF16_MAX, BF16_MAX)
    q_rope = operand(round_bf16(q_rope, NATIVE), R_KIND)
    if NB == 1:
        q_nope = operand(_quantize_q(q_full, sigma, Q_FP8, NATIVE), QK_KIND)
    coef = sm_scale_log2 * sigma  # [BLOCK_M]: scores go straight to the log2 domain

    # ---- this split's pages
    n_pages = (length + PAGE - 1) // PAGE
    per_split = (n_pages + NSPLIT - 1) // NSPLIT
    p_lo = split * per_split
    p_hi = tl.minimum(p_lo + per_split, n_pages)

    offs_n = tl.arange(0, PAGE)
    offs_w = tl.arange(0, BW)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    pi_i = tl.full([BLOCK_M], 1.0, tl.float32)
    pi_max = tl.full([BLOCK_M], 0.0, tl.float32)  # largest pi so far, in the current max's units
    acc = tl.full([BLOCK_M, BW], 0.0, tl.float32)
    zero_qk = tl.full([BLOCK_M, PAGE], 0.0, tl.float32)

    for p in range(p_lo, p_hi):
        page = tl.load(BT + b.to(tl.int64) * stride_bt + p).to(tl.int64)
        pos = p * PAGE + offs_n
        tok_ok = pos < length
        lat_rows = LAT + page * stride_lp + offs_n[:, None] * stride_lt  # [PAGE, 1]
        s_ptr = SCALE + page * stride_sp + offs_n * stride_st

        # scores, [BLOCK_M, PAGE], in the latent's scaled domain
        if NB == 1:
            c = _load_latent(lat_rows + offs_r[None, :], tok_ok[:, None], LAYOUT)
            if LAYOUT == 0:
                c = bits16(c, NATIVE)
            qk = mma(q_nope, tl.trans(operand(c, QK_KIND)), zero_qk, QK_KIND)
            if LAYOUT != 0:  # the token's only scale (snapmla, or ds_v32 with one block)
                s_v = tl.load(s_ptr, mask=tok_ok, other=0.0)
            if LAYOUT == 2:
                qk = qk * s_v[None, :]
        else:
            qk = zero_qk
            for k in tl.static_range(NB):
                q_k = _load_q(q_ptr[:, None] + k * BW + offs_w[None, :], row_ok[:, None], Q_BITS16)
                q_k = operand(_quantize_q(q_k, sigma, Q_FP8, NATIVE), QK_KIND)
                c_k = _load_latent(lat_rows + k * BW + offs_w[None, :], tok_ok[:, None], LAYOUT)
                s_k = tl.load(s_ptr + k * stride_sk, mask=tok_ok, other=0.0)
                qk += mma(q_k, tl.trans(operand(c_k, QK_KIND)), zero_qk, QK_KIND) * s_k[None, :]
        r_bits = tl.load(ROPE + page * stride_rp + offs_n[:, None] * stride_rt + offs_d[None, :],
                         mask=tok_ok[:, None], other=0)
        rope_dot = mma(q_rope, tl.trans(operand(bits16(r_bits, NATIVE), R_KIND)), zero_qk, R_KIND)
        if LAYOUT == 1:  # pre-scaled RoPE shares the latent's scale: one rescale for both parts
            raw = s_v[None, :] * (qk + rope_dot)
        else:
            raw = qk + rope_dot
        x = raw * coef[:, None]
        x = tl.where(pos[None, :] < limit[:, None], x, float("-inf"))

        # online softmax (log2 domain); rows with nothing visible yet keep m = -inf, l = 0
        m_new = tl.maximum(m_i, rmax(x, 1, NATIVE))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.exp2(x - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)

        # V = this program's output chunk of the latent, with its token scale folded into P
        if NB == 1:
            v = c
        else:
            v = _load_latent(lat_rows + chunk * BW + offs_w[None, :], tok_ok[:, None], LAYOUT)
            s_v = tl.load(s_ptr + chunk * stride_sk, mask=tok_ok, other=0.0)
        if LAYOUT == 0:
            f = e
        else:
            f = e * s_v[None, :]
        if P_FP8:
            f_max = rmax(f, 1, NATIVE)
            pi_floor = tl.maximum(pi_max * alpha * PI_REL_FLOOR, PI_ABS_FLOOR)
            pi_new = tl.where(f_max > 0, tl.maximum(tl.math.div_rn(f_max, E4M3_MAX), pi_floor), pi_i)
            pi_max = tl.maximum(pi_max * alpha, pi_new)
            p_hat = round_e4m3(tl.clamp(tl.math.div_rn(f, pi_new[:, None]), -E4M3_MAX, E4M3_MAX), NATIVE)
            beta = tl.math.div_rn(alpha * pi_i, pi_new)
            acc = mma(operand(p_hat, PV_KIND), operand(v, PV_KIND), acc * beta[:, None], PV_KIND)
            l_i = beta * l_i + tl.math.div_rn(rsum(e, 1, NATIVE), pi_new)
            pi_i = pi_new
        else:
            p16 = round_bf16(f, NATIVE)
            acc = mma(operand(p16, PV_KIND), operand(v, PV_KIND), acc * alpha[:, None], PV_KIND)
            l_i = alpha * l_i + rsum(e, 1, NATIVE)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i * pi_i)))
    if LSE_NATURAL:
        lse = lse * LN2
    o_ptr = O_PART + b.to(tl.int64) * stride_ob + rows[:, None] * stride_om + split * stride_os + chunk * BW
    tl.store(o_ptr + offs_w[None, :], out, mask=row_ok[:, None])
    tl.store(LSE_PART + b.to(tl.int64) * stride_lb + rows * stride_lm + split * stride_ls + chunk, lse, mask=row_ok)


@triton.jit
def _mla_decode_combine(
    O_PART, LSE_PART, OUT, LSE_OUT,
    stride_pb, stride_pm, stride_ps, stride_lb, stride_lm, stride_ls,
    stride_ob, stride_om, stride_eb,
    NSPLIT, NSPLIT_P2: tl.constexpr, NB: tl.constexpr, BW: tl.constexpr, NATIVE: tl.constexpr,
):
    """out = sum_s w_s out_s / sum_s w_s with w_s = 2^(lse_s - max lse); lse = max + log2(sum w), as ln."""
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
    acc = tl.full([BW], 0.0, tl.float32)
    o_ptr = O_PART + b * stride_pb + row * stride_pm + chunk * BW + offs_w
    for s in range(NSPLIT):
        w = tl.exp2(tl.load(lse_ptr + s * stride_ls) - mx_ref)
        o = tl.load(o_ptr + s * stride_ps)
        acc += tl.where(w > 0, w * o, 0.0)
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(OUT + b * stride_ob + row * stride_om + chunk * BW + offs_w, out)
    if chunk == 0:
        lse_out = tl.where(total > 0, (mx + tl.log2(tl.where(total > 0, total, 1.0))) * LN2, float("-inf"))
        tl.store(LSE_OUT + b * stride_eb + row, lse_out)


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


def mla_decode(
    q_abs: torch.Tensor,
    paged_cache: PagedMLACache,
    softmax_scale: float,
    config: KVQuantConfig | None = None,
    num_splits: int | None = None,
    *,
    causal: bool = True,
    check_bounds: bool = True,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_mma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode of `q_abs` over a paged cache; same contract as `mla_decode_reference`.

    Args:
        q_abs: `[B, H, r + d]` or `[B, S, H, r + d]` (bf16, fp16 or fp32), last dim contiguous;
            the S query tokens are the last S of each request's `lengths` tokens.
        paged_cache: the cache (its `lengths` include the query tokens).
        softmax_scale: tau (e.g. 1 / sqrt(qk_head_dim) times the yarn mscale^2).
        config: decode knobs (query, pv); default the cache's config. Must match its layout.
        num_splits: KV splits per request (default: enough programs to fill the GPU).
        causal: with S > 1, query token i sees positions < length - (S - 1 - i).
        check_bounds: validate lengths and the block table first (one device sync).
        block_m, num_warps, num_stages: tuning knobs (rows per program; launch parameters).
        fp8_mma: run fp8 x fp8 products on Hopper's FP8 MMA (faster, but it accumulates each K=32
            step in ~14 bits) instead of exact fp16 MMAs of the same e4m3 values.

    Returns:
        (out `[B, (S,) H, r]` fp32, lse `[B, (S,) H]` fp32 natural log); rows that see no token
        give out = 0 and lse = -inf.
    """
    cache = _check_cache(paged_cache)
    config = cache.config if config is None else config
    _check_config(config, cache)
    if check_bounds:
        cache.check_bounds()
    return launch_decode(q_abs, KernelOperands.from_paged(cache), softmax_scale, config, num_splits,
                         causal=causal, block_m=block_m, num_warps=num_warps, num_stages=num_stages,
                         fp8_mma=fp8_mma)


def launch_decode(
    q_abs: torch.Tensor,
    ops: KernelOperands,
    softmax_scale: float,
    config: KVQuantConfig,
    num_splits: int | None = None,
    *,
    causal: bool = True,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_mma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the query and launch knobs, then run stage 1 (and the combine). `ops` is trusted."""
    q, single = _check_query(q_abs, ops)
    B, S, H, _ = q.shape
    r, d, dev, nb = ops.kv_lora_rank, ops.rope_dim, ops.device, ops.num_scale_blocks
    if not (isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
            and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ShapeError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    interp = interpreting(dev)
    bw = r // nb
    rows = S * H
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
    _check_pow2("block_m", block_m, 16)
    m_blocks = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = _default_splits(B * m_blocks * nb, ops.block_table.shape[1], dev)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ShapeError(f"num_splits must be a positive int, got {num_splits!r}")

    out = torch.empty(B, S, H, r, dtype=torch.float32, device=dev)
    if num_splits == 1:  # stage 1 writes the final result directly
        o_part = out.view(B, rows, 1, r)
        lse_part = torch.empty(B, rows, 1, nb, dtype=torch.float32, device=dev)
    else:
        o_part = torch.empty(B, rows, num_splits, r, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B, rows, num_splits, nb, dtype=torch.float32, device=dev)

    q_fp8, p_fp8 = config.query == "fp8_e4m3", config.pv == "fp8_scale_fused"
    if interp:
        qk_kind = pv_kind = r_kind = OP_F32
    else:
        # e4m3 values are exact in fp16 and an fp16 MMA accumulates exact products in fp32, which is
        # the reference's arithmetic; Hopper's FP8 MMA keeps only ~14 bits inside each K=32 step
        # (measured 4.5e-5 relative at M = 64 even when promoted every 32). Opt in with fp8_mma.
        r_kind = OP_BF16
        qk_kind = (OP_FP8 if fp8_mma and bw >= 32 else OP_FP16) if q_fp8 else OP_BF16
        pv_kind = (OP_FP8 if fp8_mma else OP_FP16) if p_fp8 else OP_BF16
    launch = {}
    if not interp:
        # 8 warps measured fastest on an H200 for every layout at H = 16 and 64 (e.g. bf16 280 -> 225 us)
        launch = {"num_warps": num_warps or 8, "num_stages": num_stages or 2}
    q_arg = q.view(torch.int16) if q.dtype == torch.bfloat16 else q
    for_device(_mla_decode_stage1, dev)[(B, m_blocks, num_splits * nb)](
        q_arg, ops.latent, ops.rope, ops.scale, ops.block_table, ops.lengths, o_part, lse_part,
        float(softmax_scale) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        *ops.lat_strides, *ops.rope_strides, *ops.scale_strides, ops.block_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        NSPLIT=num_splits, S=S, H=H, R=r, D=d, NB=nb, LAYOUT=_LAYOUT_ID[ops.layout], Q_FP8=q_fp8, P_FP8=p_fp8,
        Q_BITS16=q.dtype == torch.bfloat16, CAUSAL=bool(causal), BLOCK_M=block_m,
        PAGE=PAGE_SIZE, NATIVE=not interp, QK_KIND=qk_kind, PV_KIND=pv_kind, R_KIND=r_kind,
        LSE_NATURAL=num_splits == 1, **launch,
    )
    if num_splits == 1:
        lse = lse_part[:, :, 0, 0].reshape(B, S, H)
    else:
        lse = torch.empty(B, S, H, dtype=torch.float32, device=dev)
        out_v, lse_v = out.view(B, rows, r), lse.view(B, rows)
        for_device(_mla_decode_combine, dev)[(B, rows, nb)](
            o_part, lse_part, out_v, lse_v,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
            out_v.stride(0), out_v.stride(1), lse_v.stride(0), num_splits,
            NSPLIT_P2=triton.next_power_of_2(num_splits), NB=nb, BW=bw, NATIVE=not interp,
            **({} if interp else {"num_warps": 4}),
        )
    if single:
        return out[:, 0], lse[:, 0]
    return out, lse


# ---------------------------------------------------------------------------------------------- checks
def _check_cache(cache: object) -> PagedMLACache:
    if not isinstance(cache, PagedMLACache):
        raise ShapeError(f"paged_cache must be a PagedMLACache, got {type(cache).__name__}")
    return cache


def _check_config(config: KVQuantConfig, cache: PagedMLACache) -> None:
    if not isinstance(config, KVQuantConfig):
        raise ConfigError(f"config must be a KVQuantConfig, got {type(config).__name__}")
    reason = unsupported_reason(config, cache.kv_lora_rank, cache.rope_dim)
    if reason is not None:
        raise ConfigError(f"the Triton decode does not implement config {config.label()!r}: {reason}")
    same_blocks = cache.layout != "ds_v32" or config.block_size == cache.config.block_size
    if layout_of(config) != cache.layout or not same_blocks:
        raise ConfigError(f"config {config.label()!r} reads the {layout_of(config)} layout but the cache holds "
                          f"the {cache.layout} layout of {cache.config.label()!r}")


def _check_query(q: object, cache: KernelOperands) -> tuple[torch.Tensor, bool]:
    check_tensor("q_abs", q, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=(3, 4), device=cache.device)
    single = q.dim() == 3
    q4 = q.unsqueeze(1) if single else q
    B, S, H, D = q4.shape
    r, d = cache.kv_lora_rank, cache.rope_dim
    if D != r + d:
        raise ShapeError(f"q_abs's last dim is {D} but the cache has kv_lora_rank {r} + rope_dim {d} = {r + d}")
    if B != cache.block_table.shape[0]:
        raise ShapeError(f"q_abs has batch {B} but the cache's block_table has {cache.block_table.shape[0]} rows")
    if S < 1 or H < 1:
        raise ShapeError(f"q_abs must have at least one query token and one head, got shape {tuple(q.shape)}")
    return q4, single


def _check_pow2(name: str, v: object, lo: int) -> None:
    if not isinstance(v, int) or v < lo or v & (v - 1):
        raise ShapeError(f"{name} must be a power of two >= {lo}, got {v!r}")


def _default_splits(programs: int, max_pages: int, device: torch.device) -> int:
    """Enough splits for ~2 programs per SM, never more than the pages or 64 (combine cost)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_pages, 64))
