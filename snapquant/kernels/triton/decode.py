"""Triton kernels of the split-KV absorbed MLA decode, stage 1 (host side: `snapquant.kernels.decode`).

Stage 1 runs programs over (work unit, tile of BLOCK_M query rows, output chunk). Rows are
(query token, head) pairs, so several query tokens per request (s_q > 1, speculative verification)
share every KV page the way heads do. A program walks a run of one request's pages (64 tokens = one
online-softmax block, the reference's pv_block) in `_attend`, which follows
`snapquant.mla_decode_reference` (docs/numerics.md) step by step:

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
  result  out = acc / l, lse = m + log2(l pi) (per work unit; natural log when it is the whole request)

One deliberate difference from the paper's formula, in fp8_scale_fused only (the reference does the
same since it was aligned with this kernel): pi is floored at max(2^-40 * (largest earlier pi,
rescaled to the current max), 2^-100), so pi_old / pi cannot overflow when a block's peak lies far
below an earlier one's.

Work schedules (`schedule=`):
  uniform   (default) every request is cut into `num_splits` equal
            runs of pages; grid (B, row tiles, splits x chunks). Short requests in a mixed batch
            leave most of their programs idle.
  balanced  FlashMLA-style: the pages of the whole batch, request after request, are cut into
            `num_splits` parts of equal page count (default 2 per SM per row tile); a part may
            finish one request and start the next. `balanced_metadata` writes the page prefix sum
            on the device (no host sync, CUDA-graph safe); a program finds its first request by
            binary search. A run that covers a whole request writes the final output directly;
            the others write partials at slot part + b (unique: along the batch, part and request
            indices never both stand still), merged by `combine._mla_decode_combine_balanced`.
  Both schedules run the same page-run helper (`_attend`, or `_attend_tokens` with tile="tokens");
  only which pages form a run differs, i.e. exactly the freedom that `num_splits` already has (each
  run has its own running max). With one part, every request is one run: bit-identical to one split.

FP8 knobs (compile-time variants, so a benchmark can compare them side by side):
  fp8_mma   False (default): fp8 x fp8 products run as exact fp16 MMAs of the e4m3 values;
            "qk" / "pv" / True: Hopper's native FP8 MMA for that product (less precise, see `common`).
  tile      (which one runs: `snapquant.kernels.dispatch`; tile="gluon" is the separate Gluon kernels)
            "rows": query rows are the MMA's M dimension. At H = 16 that is BLOCK_M = 16,
            compiled to Ampere-style mma.sync, and there Triton does not software-pipeline an
            8-bit tile (it does a 16-bit one): `block_m=64` pads the rows to get Hopper wgmma and a
            pipelined FP8 tile (docs/kernels.md). "tokens": swap AB (`_attend_tokens`), the
            page's 64 tokens are M and the query rows N, no padded rows. "pairs" (`_attend_pairs`): rows,
            the fp8 latent read as int16 code pairs (pipelined) and widened once per page.
  p_div     "exact": P^ = e4m3(f / pi) with a correctly rounded division per element; "fma" (the
            launcher's default): one reciprocal per row plus one fma correction, the same bits;
            "rcp": e4m3(f * (1 / pi)), one division per row. f * rn(1/pi) is within ~1 ulp of
            f / pi, so it rounds to a different e4m3 value only when f / pi lies within ~2^-22
            (relative) of an e4m3 rounding midpoint: rare single-element flips, not bit-exact.

The ds_v32 layout scales each block of `block_size` latent channels separately, so V's scale
varies along both axes of the PV product: each program then owns one output chunk of block_size
channels with its own P (and pi), as the reference does, and computes the full-width scores
(r / block_size times the QK work: a compile-time variant for comparisons, not tuned).

On a GPU the MMAs are bf16 (bf16 query / P) or fp16 over e4m3 values (fp8 query / P): both have
exact products and fp32 accumulation, i.e. the reference's arithmetic.

Numerical contract against the reference (tested in tests/test_kernels_decode.py): with one split
the kernel performs the reference's arithmetic (only fp32 summation order differs); with several
splits or parts each run's running max differs, so bf16 / fp8 P are rounded from differently
scaled values. Interpreter mode (CPU) holds every narrow value as its exact fp32 value (see `common`).

The launcher (`snapquant.kernels.decode`) picks the constexprs; `snapquant.kernels.compile_stats` and
`scripts/dump_ptx.py` compile these kernels for a GPU target on a machine without one. The split
partials are merged by `combine.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    BF16_MAX,
    E4M3_MAX,
    LN2,
    PI_ABS_FLOOR,
    PI_REL_FLOOR,
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
def _add_i32(a, b):
    return a + b


@triton.jit
def _query_rows(
    Q, b64, rows, length, stride_qb, stride_qs, stride_qh, H, S: tl.constexpr, R: tl.constexpr,
    D: tl.constexpr, Q_FP8: tl.constexpr, Q_BITS16: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, NATIVE: tl.constexpr,
):
    """Prologue shared by `_attend` and `_attend_tokens`: per query row, whether it exists, its
    pointer, how many cache positions it sees, the full NoPE query, its fp8 scale sigma (1 for a
    16-bit query) and the RoPE query divided by sigma and rounded to bf16 (as fp32 values)."""
    row_ok = rows < S * H
    q_ptr = Q + b64 * stride_qb + (rows // H) * stride_qs + (rows % H) * stride_qh
    if CAUSAL:  # query token i of S sees cache positions < length - (S - 1 - i)
        limit = length - (S - 1 - rows // H)
    else:
        limit = length + 0 * rows
    limit = tl.where(row_ok, limit, 0)
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
    return row_ok, q_ptr, limit, q_full, sigma, round_bf16(q_rope, NATIVE)


@triton.jit
def _run_state(BLOCK_M: tl.constexpr):
    """Online-softmax state of a run of pages, per query row: (m = -inf, l = 0, pi = 1, pi_max = 0);
    pi_max is the largest P scale so far, in the current max's units (the floor of `_page_weights`)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    pi_i = tl.full([BLOCK_M], 1.0, tl.float32)
    pi_max = tl.full([BLOCK_M], 0.0, tl.float32)
    return m_i, l_i, pi_i, pi_max


@triton.jit
def _page_of(BT, b64, stride_bt, p, length, PAGE: tl.constexpr):
    """Page id (int64) of page p of request b, its token positions, and which of them are cached."""
    page = tl.load(BT + b64 * stride_bt + p).to(tl.int64)
    pos = p * PAGE + tl.arange(0, PAGE)
    return page, pos, pos < length


@triton.jit
def _online_softmax(x, m_i, AXIS: tl.constexpr, NATIVE: tl.constexpr):
    """One page of the log2-domain online softmax, tokens along AXIS: (m_new, e, alpha). Rows with
    nothing visible yet keep m = -inf (their e and alpha are then exp2(-inf) = 0)."""
    m_new = tl.maximum(m_i, rmax(x, AXIS, NATIVE))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    e = tl.exp2(x - tl.expand_dims(m_ref, AXIS))
    alpha = tl.exp2(m_i - m_ref)
    return m_new, e, alpha


@triton.jit
def _page_weights(e, f, alpha, l_i, pi_i, pi_max, AXIS: tl.constexpr, P_FP8: tl.constexpr,
                  P_DIV: tl.constexpr, NATIVE: tl.constexpr):
    """P of one page (values exact in the PV operand type) and the running state it implies:
    (p, rescale of the accumulator, l, pi, pi_max); f = e times the token scales, tokens along AXIS.
    fp8_scale_fused: pi = max_j f / 448 (floored), P^ = e4m3(f / pi), rescale = beta = alpha pi_old / pi.
    P_DIV says how f / pi is computed: 0 div_rn per element; 1 f * rn(1 / pi) (within ~1 ulp);
    2 the same plus one fma correction, q' = q + fma(-q, pi, f) rn(1 / pi), which is the correctly
    rounded quotient when rn(1 / pi) is correctly rounded and q faithful (Markstein's theorem;
    overflow cannot occur, f / pi <= 448, and subnormal quotients round to e4m3 zero either way)."""
    if P_FP8:
        f_max = rmax(f, AXIS, NATIVE)
        pi_floor = tl.maximum(pi_max * alpha * PI_REL_FLOOR, PI_ABS_FLOOR)
        pi_new = tl.where(f_max > 0, tl.maximum(tl.math.div_rn(f_max, E4M3_MAX), pi_floor), pi_i)
        pi_max = tl.maximum(pi_max * alpha, pi_new)
        if P_DIV == 0:  # a correctly rounded division per element
            y = tl.math.div_rn(f, tl.expand_dims(pi_new, AXIS))
        else:  # one correctly rounded reciprocal per row, a multiply per element
            r_inv = tl.expand_dims(tl.math.div_rn(pi_new * 0.0 + 1.0, pi_new), AXIS)
            y = f * r_inv
            if P_DIV == 2:  # one fma-based correction: the correctly rounded quotient (Markstein)
                pi_b = tl.expand_dims(pi_new, AXIS)
                y = tl.math.fma(tl.math.fma(-y, pi_b, f), r_inv, y)
        p = round_e4m3(tl.clamp(y, -E4M3_MAX, E4M3_MAX), NATIVE)
        rescale = tl.math.div_rn(alpha * pi_i, pi_new)
        l_i = rescale * l_i + tl.math.div_rn(rsum(e, AXIS, NATIVE), pi_new)
        pi_i = pi_new
    else:
        p = round_bf16(f, NATIVE)
        rescale = alpha
        l_i = alpha * l_i + rsum(e, AXIS, NATIVE)
    return p, rescale, l_i, pi_i, pi_max


@triton.jit
def _attend(
    Q, LAT, ROPE, SCALE, BT, b, rows, length, p_lo, p_hi, chunk, sm_scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk, stride_bt,
    H, S: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
    LAYOUT: tl.constexpr, Q_FP8: tl.constexpr, P_FP8: tl.constexpr, Q_BITS16: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, NATIVE: tl.constexpr,
    QK_KIND: tl.constexpr, PV_KIND: tl.constexpr, R_KIND: tl.constexpr, P_DIV: tl.constexpr,
):
    """Online softmax of query rows `rows` of request b over its pages [p_lo, p_hi), output chunk
    `chunk`. Returns (acc [BLOCK_M, R / NB], m, l, pi): out = acc / l, lse2 = m + log2(l pi)."""
    BW: tl.constexpr = R // NB  # channels per scale block = width of this program's output chunk
    b64 = tl.cast(b, tl.int64)  # a Python int in the interpreter when b comes from a loop
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, D)
    # ---- query: per-row scale (fp8) and the RoPE operand, once per run of pages
    row_ok, q_ptr, limit, q_full, sigma, q_rope = _query_rows(
        Q, b64, rows, length, stride_qb, stride_qs, stride_qh, H, S, R, D, Q_FP8, Q_BITS16, CAUSAL,
        BLOCK_M, NATIVE)
    q_rope = operand(q_rope, R_KIND)
    if NB == 1:
        q_nope = operand(_quantize_q(q_full, sigma, Q_FP8, NATIVE), QK_KIND)
    coef = sm_scale_log2 * sigma  # [BLOCK_M]: scores go straight to the log2 domain

    offs_n = tl.arange(0, PAGE)
    offs_w = tl.arange(0, BW)
    m_i, l_i, pi_i, pi_max = _run_state(BLOCK_M)
    acc = tl.full([BLOCK_M, BW], 0.0, tl.float32)
    zero_qk = tl.full([BLOCK_M, PAGE], 0.0, tl.float32)

    for p in range(p_lo, p_hi):
        page, pos, tok_ok = _page_of(BT, b64, stride_bt, p, length, PAGE)
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

        m_new, e, alpha = _online_softmax(x, m_i, 1, NATIVE)

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
        p, rescale, l_i, pi_i, pi_max = _page_weights(e, f, alpha, l_i, pi_i, pi_max, 1, P_FP8, P_DIV, NATIVE)
        acc = mma(operand(p, PV_KIND), operand(v, PV_KIND), acc * rescale[:, None], PV_KIND)
        m_i = m_new
    return acc, m_i, l_i, pi_i


@triton.jit
def _attend_tokens(
    Q, LAT, ROPE, SCALE, BT, b, rows, length, p_lo, p_hi, sm_scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_bt,
    H, S: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
    LAYOUT: tl.constexpr, Q_FP8: tl.constexpr, P_FP8: tl.constexpr, Q_BITS16: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, NATIVE: tl.constexpr,
    QK_KIND: tl.constexpr, PV_KIND: tl.constexpr, R_KIND: tl.constexpr, P_DIV: tl.constexpr,
):
    """`_attend` with the products transposed ("swap AB", tile="tokens"; one scale block only):
    scores^T = [c | r] [q^ | q~r]^T is [PAGE, BLOCK_M] and acc^T = c^T P^T is [R, BLOCK_M], so the
    page's 64 tokens fill the MMA's M dimension (Hopper's wgmma needs M = 64) while the query rows
    become N (>= 16). Same arithmetic per (row, token) as `_attend`: exact products, fp32
    accumulation, softmax and P quantization per query row (here a column). Returns acc untransposed."""
    b64 = tl.cast(b, tl.int64)
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, D)
    _, _, limit, q_full, sigma, q_rope = _query_rows(
        Q, b64, rows, length, stride_qb, stride_qs, stride_qh, H, S, R, D, Q_FP8, Q_BITS16, CAUSAL,
        BLOCK_M, NATIVE)
    q_rope_t = tl.trans(operand(q_rope, R_KIND))  # [D, BLOCK_M]
    q_nope_t = tl.trans(operand(_quantize_q(q_full, sigma, Q_FP8, NATIVE), QK_KIND))  # [R, BLOCK_M]
    coef = sm_scale_log2 * sigma

    offs_n = tl.arange(0, PAGE)
    m_i, l_i, pi_i, pi_max = _run_state(BLOCK_M)
    acc_t = tl.full([R, BLOCK_M], 0.0, tl.float32)
    zero_s = tl.full([PAGE, BLOCK_M], 0.0, tl.float32)

    for p in range(p_lo, p_hi):
        page, pos, tok_ok = _page_of(BT, b64, stride_bt, p, length, PAGE)
        c = _load_latent(LAT + page * stride_lp + offs_n[:, None] * stride_lt + offs_r[None, :], tok_ok[:, None],
                         LAYOUT)
        if LAYOUT == 0:
            c = bits16(c, NATIVE)
        qk = mma(operand(c, QK_KIND), q_nope_t, zero_s, QK_KIND)  # [PAGE, BLOCK_M]
        r_bits = tl.load(ROPE + page * stride_rp + offs_n[:, None] * stride_rt + offs_d[None, :],
                         mask=tok_ok[:, None], other=0)
        rope_dot = mma(operand(bits16(r_bits, NATIVE), R_KIND), q_rope_t, zero_s, R_KIND)
        if LAYOUT == 1:
            s_v = tl.load(SCALE + page * stride_sp + offs_n * stride_st, mask=tok_ok, other=0.0)
            raw = s_v[:, None] * (qk + rope_dot)
        else:
            raw = qk + rope_dot
        x = raw * coef[None, :]
        x = tl.where(pos[:, None] < limit[None, :], x, float("-inf"))

        m_new, e, alpha = _online_softmax(x, m_i, 0, NATIVE)
        if LAYOUT == 0:
            f = e
        else:
            f = e * s_v[:, None]
        v_t = tl.trans(operand(c, PV_KIND))  # [R, PAGE]: the same latent tile
        p, rescale, l_i, pi_i, pi_max = _page_weights(e, f, alpha, l_i, pi_i, pi_max, 0, P_FP8, P_DIV, NATIVE)
        acc_t = mma(v_t, operand(p, PV_KIND), acc_t * rescale[None, :], PV_KIND)
        m_i = m_new
    return tl.trans(acc_t), m_i, l_i, pi_i


@triton.jit
def _e4m3_pairs_to_f16(c2, NATIVE: tl.constexpr):
    """int16 holding two e4m3 codes (channel 2k in the low byte, 2k + 1 in the high byte) -> the two
    channels' exact values: fp16 on a GPU, fp32 in the interpreter.

    GPU: one `cvt.rn.f16x2.e4m3x2` per pair (exact: fp16 has e4m3's values), written as
    non-pure inline asm on purpose: Triton may then not rematerialize the conversion in each
    product's operand layout (it does for pure ops, doubling the work); the fp16 tile is converted
    once and shared by QK and PV. Interpreter: integer bit moves (fp16 bits of c / 256: sign and
    the 7 magnitude bits shift into place, the bias difference 15 - 7 = 8 is the 2^-8), times 256."""
    if NATIVE:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [c2], dtype=(tl.float16, tl.float16), is_pure=False, pack=1)
        return lo, hi
    else:
        u = c2.to(tl.int32) & 0xFFFF
        lo = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
        hi = ((u & 0x8000) | ((u & 0x7F00) >> 1)).to(tl.int16).to(tl.float16, bitcast=True)
        return lo.to(tl.float32) * 256.0, hi.to(tl.float32) * 256.0


@triton.jit
def _attend_pairs(
    Q, LAT16, ROPE, SCALE, BT, b, rows, length, p_lo, p_hi, sm_scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_bt,
    H, S: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
    Q_FP8: tl.constexpr, P_FP8: tl.constexpr, Q_BITS16: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, NATIVE: tl.constexpr,
    KIND: tl.constexpr, R_KIND: tl.constexpr, P_DIV: tl.constexpr,
):
    """`_attend` for the snapmla layout with fp8 query and fp8 P (tile="pairs"): the latent tile is
    loaded as int16 pairs of e4m3 codes, a 16-bit tile that Triton software-pipelines (it does not
    pipeline an 8-bit tile at BLOCK_M = 16, docs/kernels.md), and widened once per page to exact
    fp16 values (`_e4m3_pairs_to_f16`). Even and odd channels become two halves of each product: QK
    sums two K = R / 2 MMAs, PV keeps two [BLOCK_M, R / 2] accumulators, interleaved once at the end
    (keeping the channels interleaved instead saves ~3 % of the loop's instructions but costs ~50
    registers; static, sm_90). Same arithmetic as `_attend`: exact products, fp32 accumulation."""
    HALF: tl.constexpr = R // 2
    b64 = tl.cast(b, tl.int64)
    offs_d = tl.arange(0, D)
    offs_h = tl.arange(0, HALF)
    _, _, limit, q_full, sigma, q_rope = _query_rows(
        Q, b64, rows, length, stride_qb, stride_qs, stride_qh, H, S, R, D, Q_FP8, Q_BITS16, CAUSAL,
        BLOCK_M, NATIVE)
    q_rope = operand(q_rope, R_KIND)
    q_even, q_odd = tl.split(tl.reshape(_quantize_q(q_full, sigma, Q_FP8, NATIVE), [BLOCK_M, HALF, 2]))
    q_even = operand(q_even, KIND)
    q_odd = operand(q_odd, KIND)
    coef = sm_scale_log2 * sigma

    offs_n = tl.arange(0, PAGE)
    m_i, l_i, pi_i, pi_max = _run_state(BLOCK_M)
    acc_even = tl.full([BLOCK_M, HALF], 0.0, tl.float32)
    acc_odd = tl.full([BLOCK_M, HALF], 0.0, tl.float32)
    zero_qk = tl.full([BLOCK_M, PAGE], 0.0, tl.float32)

    for p in range(p_lo, p_hi):
        page, pos, tok_ok = _page_of(BT, b64, stride_bt, p, length, PAGE)
        c2 = tl.load(LAT16 + page * stride_lp + offs_n[:, None] * stride_lt + offs_h[None, :],
                     mask=tok_ok[:, None], other=0)
        c_even, c_odd = _e4m3_pairs_to_f16(c2, NATIVE)
        c_even = operand(c_even, KIND)
        c_odd = operand(c_odd, KIND)
        qk = mma(q_even, tl.trans(c_even), zero_qk, KIND)
        qk = mma(q_odd, tl.trans(c_odd), qk, KIND)
        s_v = tl.load(SCALE + page * stride_sp + offs_n * stride_st, mask=tok_ok, other=0.0)
        r_bits = tl.load(ROPE + page * stride_rp + offs_n[:, None] * stride_rt + offs_d[None, :],
                         mask=tok_ok[:, None], other=0)
        rope_dot = mma(q_rope, tl.trans(operand(bits16(r_bits, NATIVE), R_KIND)), zero_qk, R_KIND)
        x = (s_v[None, :] * (qk + rope_dot)) * coef[:, None]
        x = tl.where(pos[None, :] < limit[:, None], x, float("-inf"))
        m_new, e, alpha = _online_softmax(x, m_i, 1, NATIVE)
        f = e * s_v[None, :]
        p_w, rescale, l_i, pi_i, pi_max = _page_weights(e, f, alpha, l_i, pi_i, pi_max, 1, P_FP8, P_DIV, NATIVE)
        p_op = operand(p_w, KIND)
        acc_even = mma(p_op, c_even, acc_even * rescale[:, None], KIND)
        acc_odd = mma(p_op, c_odd, acc_odd * rescale[:, None], KIND)
        m_i = m_new
    acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_M, R])
    return acc, m_i, l_i, pi_i


@triton.jit
def _attend_run(
    Q, LAT, ROPE, SCALE, BT, b, rows, length, p_lo, p_hi, chunk, sm_scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk, stride_bt,
    H, S: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
    LAYOUT: tl.constexpr, Q_FP8: tl.constexpr, P_FP8: tl.constexpr, Q_BITS16: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr, NATIVE: tl.constexpr,
    QK_KIND: tl.constexpr, PV_KIND: tl.constexpr, R_KIND: tl.constexpr, P_DIV: tl.constexpr,
    TILE: tl.constexpr,
):
    """One run of pages of request b with the tile formulation TILE (0 rows, 1 tokens, 2 pairs)."""
    if TILE == 1:
        return _attend_tokens(
            Q, LAT, ROPE, SCALE, BT, b, rows, length, p_lo, p_hi, sm_scale_log2,
            stride_qb, stride_qs, stride_qh,
            stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_bt,
            H, S, R, D, LAYOUT, Q_FP8, P_FP8, Q_BITS16, CAUSAL, BLOCK_M, PAGE, NATIVE,
            QK_KIND, PV_KIND, R_KIND, P_DIV,
        )
    elif TILE == 2:
        return _attend_pairs(
            Q, LAT, ROPE, SCALE, BT, b, rows, length, p_lo, p_hi, sm_scale_log2,
            stride_qb, stride_qs, stride_qh,
            stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_bt,
            H, S, R, D, Q_FP8, P_FP8, Q_BITS16, CAUSAL, BLOCK_M, PAGE, NATIVE,
            QK_KIND, R_KIND, P_DIV,
        )
    else:
        return _attend(
            Q, LAT, ROPE, SCALE, BT, b, rows, length, p_lo, p_hi, chunk, sm_scale_log2,
            stride_qb, stride_qs, stride_qh,
            stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk, stride_bt,
            H, S, R, D, NB, LAYOUT, Q_FP8, P_FP8, Q_BITS16, CAUSAL, BLOCK_M, PAGE, NATIVE,
            QK_KIND, PV_KIND, R_KIND, P_DIV,
        )


@triton.jit
def _finish(acc, m_i, l_i, pi_i):
    """-> (out, lse in log2 units); rows that saw nothing give out = 0, lse = -inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i * pi_i)))
    return out, lse


@triton.jit
def mla_decode_stage1(
    Q, LAT, ROPE, SCALE, BT, LENS, O_PART, LSE_PART,
    sm_scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk, stride_bt,
    stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
    H, NSPLIT,
    S: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
    LAYOUT: tl.constexpr, Q_FP8: tl.constexpr, P_FP8: tl.constexpr, Q_BITS16: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
    NATIVE: tl.constexpr, QK_KIND: tl.constexpr, PV_KIND: tl.constexpr, R_KIND: tl.constexpr,
    P_DIV: tl.constexpr, TILE: tl.constexpr, LSE_NATURAL: tl.constexpr,
):
    """Uniform schedule: program (b, row tile, split * NB + chunk) owns split `split` of request b."""
    BW: tl.constexpr = R // NB
    b = tl.program_id(0)
    split = tl.program_id(2) // NB
    chunk = tl.program_id(2) % NB
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    length = tl.load(LENS + b)
    n_pages = (length + PAGE - 1) // PAGE
    per_split = (n_pages + NSPLIT - 1) // NSPLIT
    p_lo = split * per_split
    p_hi = tl.minimum(p_lo + per_split, n_pages)
    acc, m_i, l_i, pi_i = _attend_run(
        Q, LAT, ROPE, SCALE, BT, b, rows, length, p_lo, p_hi, chunk, sm_scale_log2,
        stride_qb, stride_qs, stride_qh,
        stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk, stride_bt,
        H, S, R, D, NB, LAYOUT, Q_FP8, P_FP8, Q_BITS16, CAUSAL, BLOCK_M, PAGE, NATIVE,
        QK_KIND, PV_KIND, R_KIND, P_DIV, TILE,
    )
    out, lse = _finish(acc, m_i, l_i, pi_i)
    if LSE_NATURAL:
        lse = lse * LN2
    row_ok = rows < S * H
    offs_w = tl.arange(0, BW)
    o_ptr = O_PART + b.to(tl.int64) * stride_ob + rows[:, None] * stride_om + split * stride_os + chunk * BW
    tl.store(o_ptr + offs_w[None, :], out, mask=row_ok[:, None])
    tl.store(LSE_PART + b.to(tl.int64) * stride_lb + rows * stride_lm + split * stride_ls + chunk, lse, mask=row_ok)


@triton.jit
def balanced_metadata(LENS, CUM, B, PAGE: tl.constexpr, BLOCK_B: tl.constexpr):
    """CUM[0] = 0, CUM[b + 1] = pages of requests 0..b (one program; B <= BLOCK_B)."""
    offs = tl.arange(0, BLOCK_B)
    ok = offs < B
    n = tl.load(LENS + offs, mask=ok, other=0)
    pages = (tl.maximum(n, 0) + PAGE - 1) // PAGE
    cum = tl.associative_scan(pages, 0, _add_i32)
    tl.store(CUM + 1 + offs, cum, mask=ok)
    tl.store(CUM + offs, 0 * offs, mask=offs == 0)


@triton.jit
def _first_index(A, x, n, GREATER: tl.constexpr):
    """Smallest i in [0, n) with A[i] > x (GREATER) or A[i] >= x, n if none; A non-decreasing."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        a = tl.load(A + mid)
        if GREATER:
            go_left = a > x
        else:
            go_left = a >= x
        hi = tl.where(go_left, mid, hi)
        lo = tl.where(go_left, lo, mid + 1)
    return lo


@triton.jit
def part_range(CUM, part, B, NPARTS):
    """Pages [lo, hi) of the batch's page sequence that part `part` owns."""
    total = tl.load(CUM + B)
    per = tl.maximum((total + NPARTS - 1) // NPARTS, 1)
    lo = part * per
    hi = tl.minimum(lo + per, total)
    return lo, hi, per


@triton.jit
def mla_decode_balanced(
    Q, LAT, ROPE, SCALE, BT, LENS, CUM, OUT, LSE_OUT, O_PART, LSE_PART,
    sm_scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk, stride_bt,
    stride_ob, stride_om, stride_eb, stride_ps, stride_pm, stride_ls, stride_lm,
    H, B, NPARTS,
    S: tl.constexpr, R: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
    LAYOUT: tl.constexpr, Q_FP8: tl.constexpr, P_FP8: tl.constexpr, Q_BITS16: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
    NATIVE: tl.constexpr, QK_KIND: tl.constexpr, PV_KIND: tl.constexpr, R_KIND: tl.constexpr,
    P_DIV: tl.constexpr, TILE: tl.constexpr,
):
    """Balanced schedule: program (part, row tile, chunk) owns pages [lo, hi) of the batch's page
    sequence, which may cover the end of one request and the start of the next ones."""
    BW: tl.constexpr = R // NB
    part = tl.program_id(0)
    chunk = tl.program_id(2)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S * H
    offs_w = tl.arange(0, BW)
    lo, hi, _ = part_range(CUM, part, B, NPARTS)
    b_first = _first_index(CUM + 1, lo, B, True)  # first request whose pages end after lo
    b_stop = _first_index(CUM, hi, B, False)  # first request starting at or after hi
    for b in range(b_first, b_stop):
        start = tl.load(CUM + b)
        n = tl.load(CUM + b + 1) - start
        s_lo = tl.maximum(lo - start, 0)
        s_hi = tl.minimum(hi - start, n)
        if s_lo < s_hi:
            length = tl.load(LENS + b)
            acc, m_i, l_i, pi_i = _attend_run(
                Q, LAT, ROPE, SCALE, BT, b, rows, length, s_lo, s_hi, chunk, sm_scale_log2,
                stride_qb, stride_qs, stride_qh,
                stride_lp, stride_lt, stride_rp, stride_rt, stride_sp, stride_st, stride_sk, stride_bt,
                H, S, R, D, NB, LAYOUT, Q_FP8, P_FP8, Q_BITS16, CAUSAL, BLOCK_M, PAGE, NATIVE,
                QK_KIND, PV_KIND, R_KIND, P_DIV, TILE,
            )
            out, lse = _finish(acc, m_i, l_i, pi_i)
            b64 = tl.cast(b, tl.int64)
            if (s_lo == 0) & (s_hi == n):  # the whole request: final output, natural-log LSE
                o_ptr = OUT + b64 * stride_ob + rows[:, None] * stride_om + chunk * BW
                tl.store(o_ptr + offs_w[None, :], out, mask=row_ok[:, None])
                if chunk == 0:
                    tl.store(LSE_OUT + b64 * stride_eb + rows, lse * LN2, mask=row_ok)
            else:  # a partial, in slot part + b (log2 LSE)
                slot = (part + b).to(tl.int64)
                o_ptr = O_PART + slot * stride_ps + rows[:, None] * stride_pm + chunk * BW
                tl.store(o_ptr + offs_w[None, :], out, mask=row_ok[:, None])
                tl.store(LSE_PART + slot * stride_ls + rows * stride_lm + chunk, lse, mask=row_ok)
