"""The snapmla decode's page loop written in Gluon (Triton's explicit-layout dialect), Hopper only.

Plain Triton leaves the H = 16 FP8 page loop latency-bound (docs/perf-notes.md sections 6 and 10):
one 8-warp program per SM spends ~800 instructions per page on conversions, layout shuffles and
barriers. Gluon lets the kernel say what plain Triton decides for it:

  * TMA: the page's fp8 latent ([64, r], as r / 128 boxes of 128 codes) and bf16 RoPE rows land in
    shared memory, an mbarrier counting the bytes in.
  * one conversion per page: fp8 codes -> an fp16 tile in shared memory (exact: fp16 holds every
    e4m3 value; `cvt.rn.f16x2.e4m3x2` on four codes per register), read by both products; on a
    request's last page, tokens past its length become exact zeros (the TMA box may hold the next
    request's rows, or codes such as NaN).
  * swap AB, so no rows are padded: the page's 64 tokens are wgmma's M dimension and the query rows
    (16) its N. S^T = C Q^T ([64, r] x [r, 16], plus R Q_r^T for RoPE), then the softmax in a layout
    where each warp owns whole rows (shuffle reductions), then O^T += C^T P^T with A = the same fp16
    tile read transposed (wgmma reads 16-bit A operands in either major order), P^T in shared memory.
  * the softmax and P quantization are `decode_kernels._page_weights`'s arithmetic, with the
    fma-corrected division (P_DIV 2) by default: the same numbers as tile="pairs" up to fp32
    summation order inside the MMAs.

Ring slots (STAGES, the launcher's num_stages): 1 is one slot converted in place, TMA writing the fp8
boxes into the upper half of the fp16 tile's 64 KB: ~98 KB of shared memory, so two programs share an
SM and hide each other's latency. 2 or 3 keep separate fp8 slots and prefetch STAGES - 1 pages (one
program per SM); only the opt-in native FP8 QK (QK_FP8) uses them here: with exact MMAs the launcher
runs `gluon_regs.py` for two or more slots, which never widens the page into a tile and is the default
at r = 512 (1.29x faster than one slot in place at B=128 H=16 L=4K, H200); this kernel's single slot is
the default at other widths.
Every wgmma is waited for within its own page: a wait deferred across the loop made ptxas serialize
all of them (advisory C7515; `compile_stats` reports `wgmma_waits` and `ptxas_advice`).

One program = one (request, 16-row tile, split) as in the uniform schedule of
`decode_kernels._mla_decode_stage1`; its partial output and LSE go to the same buffers and the same
combine kernel merges them. The launcher is `mla_decode.plan_decode(tile="gluon")` (the default where
it runs); eligibility (`gluon_unsupported_reason`) is checked on the host. Gluon has no interpreter:
this file compiles for sm_90 on any machine (tests compile it), and it runs on a Hopper GPU only.
ABLATE (default 0) drops parts of the page loop for `scripts/probe_gluon_decode.py`'s timing only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .box_views import pv_channel, qk_channel
from .layouts import GLUON_ROWS

try:  # Gluon ships with triton >= 3.5; older installs simply have no tile="gluon"
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the TMA load was renamed between triton 3.6 (the H200 image) and 3.9 (CI)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed likewise
    NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # 3.6: _reinterpret
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

BOX = 128  # fp8 codes per TMA box row: 128 bytes, the widest swizzle
ROWS = GLUON_ROWS  # query rows per program (wgmma N)


def gluon_unsupported_reason(layout: str, q_fp8: bool, p_fp8: bool, rows: int, r: int, d: int,
                             lat: torch.Tensor, lat_strides: tuple[int, int], rope: torch.Tensor,
                             rope_strides: tuple[int, int]) -> str | None:
    """Why tile="gluon" cannot run these operands (None when it can). Up to ROWS query rows it is
    this module's kernel (snapmla, fp8 query and P); past that `gluon_wide`'s 64-row tiles, which
    also run the bf16 layout (bf16 query and P)."""
    if not HAVE_GLUON:
        return "this triton has no Gluon (triton.experimental.gluon)"
    snapmla8 = layout == "snapmla" and q_fp8 and p_fp8
    if rows <= ROWS and not snapmla8:
        return (f"tile='gluon' at <= {ROWS} query rows runs the snapmla layout with an fp8 query and fp8 P, got "
                f"{layout} (q fp8 {q_fp8}, P fp8 {p_fp8})")
    if rows > ROWS and not (snapmla8 or (layout == "bf16" and not q_fp8 and not p_fp8)):
        return (f"tile='gluon' at > {ROWS} query rows runs the snapmla layout (fp8 query and P) or the bf16 layout "
                f"(bf16 query and P), got {layout} (q fp8 {q_fp8}, P fp8 {p_fp8})")
    if r % BOX or r > 512 or d * 2 > 128 or d < 8:
        return f"tile='gluon' needs kv_lora_rank a multiple of {BOX} up to 512 and 8 <= rope_dim <= 64, got {r}, {d}"
    lat_size = 2 if layout == "bf16" else 1
    for name, t, (sp, st), size in (("latent", lat, lat_strides, lat_size), ("rope", rope, rope_strides, 2)):
        if t.stride(-1) != 1 or (st * size) % 16 or t.data_ptr() % 16 or sp % st:
            return (f"tile='gluon' needs the {name} rows 16-byte aligned, contiguous and a page stride that is a "
                    f"multiple of the row stride (TMA), got strides {tuple(t.stride())}")
    return None


def _rows_view(t: torch.Tensor, row_stride: int) -> tuple[list[int], list[int]]:
    """Shape and strides of `t` seen as one 2-D table of rows (every row start a multiple of
    `row_stride` elements from the first): what the TMA descriptor addresses by row index."""
    last = sum((n - 1) * s for n, s in zip(t.shape[:-1], t.stride()[:-1], strict=True))
    return [last // row_stride + 1, t.shape[-1]], [row_stride, 1]


def make_descriptors(lat: torch.Tensor, lat_row: int, rope_bf16: torch.Tensor, rope_row: int,
                     fp8: bool = True) -> tuple[Any, Any]:
    """TMA descriptors of the latent (fp8 boxes [64, 128], or bf16 boxes [64, 64] for `gluon_wide`'s bf16
    layout: both 128 bytes wide, the widest swizzle) and of the bf16 RoPE rows (boxes [64, d])."""
    dtype, width = (gl.float8e4nv, BOX) if fp8 else (gl.bfloat16, BOX // 2)
    shape, strides = _rows_view(lat, lat_row)
    lat_desc = TensorDescriptor(lat, shape, strides, [64, width], gl.NVMMASharedLayout.get_default_for([64, width], dtype))
    shape, strides = _rows_view(rope_bf16, rope_row)
    d = rope_bf16.shape[-1]
    rope_layout = gl.NVMMASharedLayout.get_default_for([64, d], gl.bfloat16)
    rope_desc = TensorDescriptor(rope_bf16, shape, strides, [64, d], rope_layout)
    return lat_desc, rope_desc


if HAVE_GLUON:
    # globals read inside Gluon functions must be constexpr
    LN2 = gl.constexpr(math.log(2.0))
    E4M3_MAX = gl.constexpr(448.0)
    E4M3_RCP = gl.constexpr(0.0022321429569274187)  # RN_f32(1 / 448), exact in fp32
    BF16_MAX = gl.constexpr(3.3895313892515355e38)  # largest finite bf16
    SCALE_FLOOR = gl.constexpr(2.0**-86)  # snapquant.quant.scales.SCALE_FLOOR
    PI_REL_FLOOR = gl.constexpr(2.0**-40)  # decode_kernels: P scale floors
    PI_ABS_FLOOR = gl.constexpr(2.0**-100)

    _qk_channel = gluon.jit(qk_channel)
    _pv_channel = gluon.jit(pv_channel)

    @gluon.jit
    def _issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, slot, page, lat_page_rows, rope_page_rows,
                    pred, NBOX: gl.constexpr, BOXW: gl.constexpr, BOX0: gl.constexpr):
        """Ask the TMA unit for one page (latent boxes and RoPE rows) into ring slot `slot` (its boxes
        start at box BOX0 + slot * NBOX of `lat_smem`)."""
        bar = bars.index(slot)
        lat_row = (page * lat_page_rows).to(gl.int32)
        rope_row = (page * rope_page_rows).to(gl.int32)
        mbarrier.expect(bar, NBOX * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=pred)
        for k in gl.static_range(NBOX):
            tma_load(lat_desc, [lat_row, k * BOXW], bar, lat_smem.index(BOX0 + slot * NBOX + k), pred=pred)
        tma_load(rope_desc, [rope_row, 0], bar, rope_smem.index(slot), pred=pred)

    @gluon.jit
    def _e4m3_to_f16(c8):
        """e4m3 codes -> exact fp16 values, four codes (one 32-bit register) per asm instance: two
        cvt.rn.f16x2.e4m3x2 on the register's halves (the generic cast shuffles bytes first)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [c8.to(gl.int8, bitcast=True)], dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def _query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S: gl.constexpr,
                        R: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, QK_FP8: gl.constexpr, q_l: gl.constexpr,
                        Q8: gl.constexpr = True, QK_PERM: gl.constexpr = False, Q_RCP: gl.constexpr = False):
        """Stores q^ = e4m3(q / sigma) (as fp16, or e4m3 for a native fp8 QK) and q~r = bf16(q_r / sigma)
        of the program's BN query rows into shared memory; returns sigma = amax(q) / 448 per row.
        Q8=False (the bf16 layout): bf16(q) and bf16(q_r), sigma = 1. QK_PERM: q^'s channels in
        `gluon_regs`' QK order (column k holds channel qk_channel(k)). Q_RCP: q / sigma as q times 1 / sigma
        with one fma correction (Markstein: the correctly rounded quotient, as div_rn, in 3 instructions)."""
        rows_q = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, q_l))
        rq_ok = rows_q < S * H
        q_row = Q + b64 * stride_qb + (rows_q // H) * stride_qs + (rows_q % H) * stride_qh
        offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, q_l))
        if QK_PERM:
            offs_r = _qk_channel(offs_r)
        q = gl.load(q_row[:, None] + offs_r[None, :], mask=rq_ok[:, None], other=0.0).to(gl.float32)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
        qr = gl.load(q_row[:, None] + R + offs_d[None, :], mask=rq_ok[:, None], other=0.0).to(gl.float32)
        if Q8:
            amax = gl.max(gl.abs(q), 1)
            sigma = gl.div_rn(amax, gl.full_like(amax, E4M3_MAX))
            sigma = gl.where(amax == 0, 1.0, gl.maximum(sigma, SCALE_FLOOR))
            if Q_RCP:
                s_inv = gl.expand_dims(gl.div_rn(gl.full_like(sigma, 1.0), sigma), 1)
                qn = _div_markstein(q, gl.expand_dims(sigma, 1) + gl.zeros_like(q), s_inv + gl.zeros_like(q))
            else:
                qn = gl.div_rn(q, gl.expand_dims(sigma, 1) + gl.zeros_like(q))
            qn = gl.minimum(gl.maximum(qn, -E4M3_MAX), E4M3_MAX)
            if QK_FP8:
                q_smem.store(qn.to(gl.float8e4nv))
            else:
                q_smem.store(qn.to(gl.float8e4nv).to(gl.float16))
            if Q_RCP:
                qr = _div_markstein(qr, gl.expand_dims(sigma, 1) + gl.zeros_like(qr), s_inv + gl.zeros_like(qr))
            else:
                qr = gl.div_rn(qr, gl.expand_dims(sigma, 1) + gl.zeros_like(qr))
            qr_smem.store(gl.minimum(gl.maximum(qr, -BF16_MAX), BF16_MAX).to(gl.bfloat16))
        else:
            sigma = gl.full([BN], 1.0, gl.float32, gl.SliceLayout(1, q_l))
            q_smem.store(q.to(gl.bfloat16))
            qr_smem.store(qr.to(gl.bfloat16))
        return sigma

    @gluon.jit
    def _split_run(LENS, b, split, NSPLIT, PAGE: gl.constexpr):
        """Request b's length and the pages of its split `split` of NSPLIT (uniform schedule): the first page
        p_lo and how many to run (0 for a split past the request's pages)."""
        length = gl.load(LENS + b)
        n_pages = (length + PAGE - 1) // PAGE
        per_split = (n_pages + NSPLIT - 1) // NSPLIT
        p_lo = split * per_split
        return length, p_lo, gl.maximum(gl.minimum(p_lo + per_split, n_pages) - p_lo, 0)

    @gluon.jit
    def _row_state(length, row0, sigma, sm_scale_log2, H, S: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
                   srow_l: gl.constexpr):
        """Per query row of the program's BN: how many cache positions it sees (causal: query token i of S
        sees positions < length - (S - 1 - i); rows past S * H none), its score coefficient (log2 domain,
        times sigma) and the online-softmax state (m = -inf, l = 0, pi = 1, pi_max = 0)."""
        rows_s = row0 + gl.arange(0, BN, layout=srow_l)
        if CAUSAL:
            limit = length - (S - 1 - rows_s // H)
        else:
            limit = length + 0 * rows_s
        limit = gl.where(rows_s < S * H, limit, 0)
        coef = sm_scale_log2 * gl.convert_layout(sigma, srow_l)
        m_i = gl.full([BN], float("-inf"), gl.float32, srow_l)
        l_i = gl.zeros([BN], gl.float32, srow_l)
        pi_i = gl.full([BN], 1.0, gl.float32, srow_l)
        pi_max = gl.zeros([BN], gl.float32, srow_l)
        return limit, coef, m_i, l_i, pi_i, pi_max

    @gluon.jit
    def _mul_rn(a, b):
        """a * b rounded on its own: PTX never contracts mul.rn into an fma with a following add."""
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _div_markstein(a, b, r_inv):
        """a / b correctly rounded (as div_rn) from r_inv = div_rn(1, b): a * r_inv, then one fma correction
        (Markstein's theorem; finite, non-underflowing quotients)."""
        y = a * r_inv
        return gl.fma(gl.fma(-y, b, a), r_inv, y)

    @gluon.jit
    def _online_softmax(x, m_i, AX: gl.constexpr):
        """One page of the log2-domain online softmax, tokens along AX (`decode_kernels._online_softmax`):
        (m_new, e, alpha); rows with nothing visible yet keep m = -inf (their e and alpha are 0)."""
        m_new = gl.maximum(m_i, gl.max(x, AX))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, gl.exp2(x - gl.expand_dims(m_ref, AX)), gl.exp2(m_i - m_ref)

    @gluon.jit
    def _page_p(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s, P_DIV: gl.constexpr,
                AX: gl.constexpr = 0, MASK: gl.constexpr = True, CLAMP: gl.constexpr = True,
                PI_RCP: gl.constexpr = False):
        """One page of the online softmax and of fp8_scale_fused P, tokens along axis AX (the arithmetic
        of `decode_kernels._online_softmax` and `_page_weights`): raw = <q^, c^> + <q~r, r~> per
        (token, row) -> (P^ as e4m3, accumulator rescale beta, m, l, pi, pi_max). MASK=False: the caller
        knows every row sees every token of the page (no position test). CLAMP=False: the e4m3
        conversion's own saturation (cvt.satfinite) bounds f / pi, the same codes for finite values.
        PI_RCP: max f / 448 as a multiply by RN(1 / 448) with Markstein's correction, the correctly
        rounded quotient (pi is floored at >= 2^-100, far above where that could differ)."""
        RA: gl.constexpr = 1 - AX  # the rows' axis
        if MASK:
            x = (gl.expand_dims(s_cur, RA) * raw) * gl.expand_dims(coef, AX)
            x = gl.where(gl.expand_dims(pos, RA) < gl.expand_dims(limit, AX), x, float("-inf"))
        else:  # mul.rn: not contracted with the softmax's x - m into an fma (the masked path's bits)
            x = _mul_rn(gl.expand_dims(s_cur, RA) * raw, gl.expand_dims(coef, AX) + zero_s)
        m_new, e, alpha = _online_softmax(x, m_i, AX)
        # pi = max f / 448 (floored), P^ = e4m3(f / pi), f = e times the token scale
        f = e * gl.expand_dims(s_cur, RA)
        f_max = gl.max(f, AX)
        pi_floor = gl.maximum(pi_max * alpha * PI_REL_FLOOR, PI_ABS_FLOOR)
        seen = f_max > 0
        if PI_RCP:  # Markstein: exact for normal quotients, and below 2^-100 the floor wins either way
            q448 = _div_markstein(f_max, gl.full_like(f_max, E4M3_MAX), gl.full_like(f_max, E4M3_RCP))
        else:
            q448 = gl.div_rn(f_max, gl.full_like(f_max, E4M3_MAX))
        pi_new = gl.where(seen, gl.maximum(q448, pi_floor), pi_i)
        pi_max = gl.maximum(pi_max * alpha, pi_new)
        pi_b = gl.expand_dims(pi_new, AX) + zero_s
        if P_DIV == 0:
            y = gl.div_rn(f, pi_b)
        else:
            r_inv = gl.expand_dims(gl.div_rn(gl.full_like(pi_new, 1.0), pi_new), AX) + zero_s
            if P_DIV == 2:  # Markstein: one fma correction gives the correctly rounded quotient
                y = _div_markstein(f, pi_b, r_inv)
            else:
                y = f * r_inv
        if CLAMP:
            y = gl.minimum(gl.maximum(y, -E4M3_MAX), E4M3_MAX)
        p8 = y.to(gl.float8e4nv)
        rescale = gl.div_rn(alpha * pi_i, pi_new)
        l_i = rescale * l_i + gl.div_rn(gl.sum(e, AX), pi_new)
        return p8, rescale, m_new, l_i, pi_new, pi_max

    @gluon.jit
    def _fewest_visible(limit, row0, n_rows, BN: gl.constexpr, srow_l: gl.constexpr):
        """The fewest cache positions a real row of the tile sees (rows past n_rows aside; a row may see
        none): pages below it need no position test in `_page_p_native`."""
        return gl.min(gl.where(row0 + gl.arange(0, BN, layout=srow_l) < n_rows, limit, 1 << 30), 0)

    @gluon.jit
    def _page_p_native(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s, whole, P_DIV: gl.constexpr,
                       AX: gl.constexpr, FAST: gl.constexpr):
        """`_page_p` for the native FP8 kernels. FAST: the same bits in fewer instructions, no position test
        when `whole` (every row sees the whole page), the e4m3 conversion's saturation for the clamp, and
        max f / 448 by a reciprocal with Markstein's correction."""
        if FAST and whole:
            p8, rescale, m_i, l_i, pi_i, pi_max = _page_p(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s,
                                                          P_DIV, AX, False, False, FAST)
        else:
            p8, rescale, m_i, l_i, pi_i, pi_max = _page_p(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s,
                                                          P_DIV, AX, True, not FAST, FAST)
        return p8, rescale, m_i, l_i, pi_i, pi_max

    @gluon.jit
    def _start_ring(lat_desc, rope_desc, lat_smem, rope_smem, bars, bt_row, n_run, lat_page_rows, rope_page_rows,
                    STAGES: gl.constexpr, AHEAD: gl.constexpr, NBOX: gl.constexpr, BOXW: gl.constexpr,
                    BOX0: gl.constexpr):
        """Initialise the ring's STAGES barriers and put the run's first AHEAD pages in flight (slots 0..)."""
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(AHEAD):
            ok = s < n_run
            page = gl.load(bt_row + s, mask=ok, other=0).to(gl.int64)
            _issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, s, page, lat_page_rows, rope_page_rows,
                        ok, NBOX, BOXW, BOX0)

    @gluon.jit
    def _page_p_smem(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s, p_smem, P_DIV: gl.constexpr,
                     ABLATE: gl.constexpr, BN: gl.constexpr, srow_l: gl.constexpr):
        """`_page_p` for the swap-AB kernels (tokens along axis 0), then P^ as fp16 [rows, tokens] into p_smem,
        the PV MMA's B operand (16-byte stores). ABLATE 8 skips the softmax (timing probes only)."""
        if ABLATE & 8:
            p8 = raw.to(gl.float8e4nv)
            rescale = gl.full([BN], 1.0, gl.float32, srow_l)
        else:
            p8, rescale, m_i, l_i, pi_i, pi_max = _page_p(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max,
                                                          zero_s, P_DIV)
        p_smem.store(gl.permute(p8.to(gl.float16), [1, 0]))
        fence_async_shared()
        return rescale, m_i, l_i, pi_i, pi_max

    @gluon.jit
    def _store_result(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om, stride_os,
                      stride_lb, stride_lm, stride_ls, R: gl.constexpr, LSE_NATURAL: gl.constexpr, ch_l: gl.constexpr,
                      AX: gl.constexpr = 1, CH0: gl.constexpr = 0, STORE_LSE: gl.constexpr = True,
                      PV_PERM: gl.constexpr = False):
        """out = acc / l (rows along axis AX of acc: 1 for O^T), lse = m + log2(l pi); rows that saw
        nothing give 0 and -inf. acc holds output channels CH0..CH0 + R - 1 (PV_PERM: in `gluon_regs`'
        PV order, row m being channel CH0 + pv_channel(m))."""
        CA: gl.constexpr = 1 - AX  # the channels' axis
        empty = l_i == 0.0
        out = acc / gl.expand_dims(gl.where(empty, 1.0, l_i), CA)
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i * pi_i)))
        if LSE_NATURAL:
            lse = lse * LN2
        offs_c = gl.arange(0, R, layout=ch_l)
        if PV_PERM:
            offs_c = _pv_channel(offs_c)
        o_ptr = (O_PART + b64 * stride_ob + split * stride_os + gl.expand_dims(rows * stride_om, CA)
                 + gl.expand_dims(CH0 + offs_c, AX))
        gl.store(o_ptr, out, mask=gl.expand_dims(row_ok, CA) & gl.expand_dims(offs_c < R, AX))
        if STORE_LSE:
            gl.store(LSE_PART + b64 * stride_lb + rows * stride_lm + split * stride_ls, lse, mask=row_ok)

    @gluon.jit
    def _widen_boxes(lat_smem, c16_smem, box0, K_LO: gl.constexpr, K_HI: gl.constexpr, base, length, offs_tc,
                     cvt_l: gl.constexpr, INPLACE: gl.constexpr, NBOX: gl.constexpr, BOXW: gl.constexpr,
                     PAGE: gl.constexpr):
        """fp8 boxes K_LO..K_HI - 1 of the page -> fp16 chunks of the tile; on a request's last page the
        tokens past its length become exact zeros (only there: the select costs one op per code)."""
        if base + PAGE <= length:
            for k in gl.static_range(K_LO, K_HI):
                c8 = lat_smem.index(box0 + k).load(cvt_l)
                if INPLACE and 2 * k + 1 >= NBOX:  # chunk k overwrites upper-half boxes 2k - NBOX, 2k - NBOX + 1
                    cta_barrier()  # ... which may include box k, just read by the other warps
                c16_smem.slice(k * BOXW, BOXW, dim=1).store(_e4m3_to_f16(c8))
        else:
            tok_ok_c = gl.expand_dims((base + offs_tc) < length, 1)
            for k in gl.static_range(K_LO, K_HI):
                c8 = lat_smem.index(box0 + k).load(cvt_l)
                c8 = gl.where(tok_ok_c, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True)
                if INPLACE and 2 * k + 1 >= NBOX:
                    cta_barrier()
                c16_smem.slice(k * BOXW, BOXW, dim=1).store(_e4m3_to_f16(c8))

    @gluon.jit
    def _snapmla_decode_gluon(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, QK_FP8: gl.constexpr, LSE_NATURAL: gl.constexpr,
        num_warps: gl.constexpr, ABLATE: gl.constexpr = 0,
    ):
        BN: gl.constexpr = 16  # query rows (wgmma N)
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW

        # ---- layouts: the MMA accumulator (tokens or channels x rows), and plain blocked tiles
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 16])
        mma8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 32])
        tok_l: gl.constexpr = gl.SliceLayout(1, mma_l)  # along M (tokens / channels)
        row_l: gl.constexpr = gl.SliceLayout(0, mma_l)  # along N (query rows)
        # The softmax runs in a layout where each warp owns whole query rows (8 lanes x 8 registers
        # over the page's 64 tokens): its reductions are shuffles, with no shared-memory round trip
        # and barrier each, and each row's scalars (divisions) are computed by 8 lanes, not 128
        # threads x 4 columns (measured: the softmax was the loop's largest cost, probe_gluon_decode).
        sm_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        gl.static_assert(num_warps == 4)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])  # 16 codes = 16 B
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        b = gl.program_id(0)
        row0 = gl.program_id(1) * BN
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = _split_run(LENS, b, split, NSPLIT, PAGE)

        # ---- shared memory: the TMA ring, the fp16 tile, the query operands, P^T, the barriers
        c16_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE, BOXW], gl.float16)
        INPLACE: gl.constexpr = STAGES == 1
        gl.static_assert(INPLACE or QK_FP8)  # exact MMAs with separate slots: gluon_regs (the launcher's choice)
        if INPLACE:
            # One slot, converted in place: TMA writes the fp8 boxes into the upper half of the fp16
            # tile's 64 KB; fp16 chunk k (channels 128k.., bytes 16K k..) only overwrites boxes already
            # read. ~100 KB of shared memory: two programs share an SM and hide each other's waits.
            c16_all = gl.allocate_shared_memory(gl.float16, [1, PAGE, R], c16_l)
            c16_smem = c16_all.index(0)
            if NEW_REINTERPRET:
                lat_smem = c16_all.reinterpret(gl.float8e4nv, [2 * NBOX, PAGE, BOXW], lat_desc.layout)
            else:
                lat_smem = c16_all._reinterpret(gl.float8e4nv, [2 * NBOX, PAGE, BOXW], lat_desc.layout)
            BOX0: gl.constexpr = NBOX
        else:
            lat_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * NBOX, PAGE, BOXW], lat_desc.layout)
            c16_smem = gl.allocate_shared_memory(gl.float16, [PAGE, R], c16_l)
            BOX0: gl.constexpr = 0
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        if QK_FP8:  # native e4m3 QK straight from the TMA slots (opt-in, fp8_mma="qk")
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, R],
                                               gl.NVMMASharedLayout.get_default_for([BN, R], gl.float8e4nv))
        else:
            q_smem = gl.allocate_shared_memory(gl.float16, [BN, R],
                                               gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float16, [BN, PAGE], gl.NVMMASharedLayout.get_default_for([BN, PAGE], gl.float16))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())

        # ---- prologue: the first max(STAGES - 1, 1) pages in flight before anything else
        bt_row = BT + b64 * stride_bt + p_lo
        ahead: gl.constexpr = 1 if INPLACE else STAGES - 1
        _start_ring(lat_desc, rope_desc, lat_smem, rope_smem, bars, bt_row, n_run, lat_page_rows, rope_page_rows,
                    STAGES, ahead, NBOX, BOXW, BOX0)

        # ---- query: per-row fp8 scale sigma, q^ = e4m3(q / sigma) as fp16, q~r = bf16(q_r / sigma)
        sigma = _query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN, QK_FP8,
                                q_l)
        rows = row0 + gl.arange(0, BN, layout=row_l)
        row_ok = rows < S * H
        limit, coef, m_i, l_i, pi_i, pi_max = _row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
        acc = gl.zeros([R, BN], gl.float32, mma_l)  # O^T
        zero_s = gl.zeros([PAGE, BN], gl.float32, mma_l)
        zero_s8 = gl.zeros([PAGE, BN], gl.float32, mma8_l)
        zero_sm = gl.zeros([PAGE, BN], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        offs_tc = gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))
        fence_async_shared()

        # page ids one iteration ahead of the TMA issue, scales one page ahead of their use
        page_next = gl.load(bt_row + ahead, mask=ahead < n_run, other=0).to(gl.int64)
        page_cur = gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64)
        s_cur = gl.load(SCALE + page_cur * stride_sp + offs_t * stride_st,
                        mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        for it in range(n_run):
            slot = it % STAGES
            nxt = it + ahead
            if not INPLACE:  # the slot of page it - 1 is free (its reads finished before last iteration's barriers)
                _issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, nxt % STAGES, page_next, lat_page_rows,
                            rope_page_rows, (nxt < n_run) & (ABLATE & 16 == 0), NBOX, BOXW, BOX0)
                page_next = gl.load(bt_row + nxt + 1, mask=nxt + 1 < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            base = (p_lo + it) * PAGE
            s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)

            if ABLATE & 16 == 0:
                mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
            if QK_FP8:  # the tensor cores start on QK while the warps convert the tile for PV
                gl.static_assert(NBOX == 4)  # four boxes, four accumulators (the host checks r = 512)
                q8 = q_smem.permute((1, 0))
                # one accumulator per 128-channel box, summed in fp32: Hopper's FP8 MMA keeps ~14 bits
                # inside an accumulation chain (DeepSeek-V3 promotes every 128 products the same way)
                k0 = warpgroup_mma(lat_smem.index(BOX0 + slot * NBOX), q8.slice(0, BOXW), zero_s8, use_acc=False,
                                   is_async=True)
                k1 = warpgroup_mma(lat_smem.index(BOX0 + slot * NBOX + 1), q8.slice(BOXW, BOXW), zero_s8, use_acc=False,
                                   is_async=True)
                k2 = warpgroup_mma(lat_smem.index(BOX0 + slot * NBOX + 2), q8.slice(2 * BOXW, BOXW), zero_s8,
                                   use_acc=False, is_async=True)
                k3 = warpgroup_mma(lat_smem.index(BOX0 + slot * NBOX + 3), q8.slice(3 * BOXW, BOXW), zero_s8,
                                   use_acc=False, is_async=True)
                rd = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            # fp8 codes -> fp16 tile; on a request's last page, tokens past its length -> 0
            if ABLATE & 1 == 0:
                _widen_boxes(lat_smem, c16_smem, BOX0 + slot * NBOX, 0, NBOX // 2, base, length, offs_tc, cvt_l,
                             INPLACE, NBOX, BOXW, PAGE)
            if QK_FP8 and INPLACE:  # the in-place chunks below overwrite the fp8 boxes the QK reads
                k0, k1, k2, k3, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, k2, k3, rd))
            if ABLATE & 1 == 0:
                _widen_boxes(lat_smem, c16_smem, BOX0 + slot * NBOX, NBOX // 2, NBOX, base, length, offs_tc, cvt_l,
                             INPLACE, NBOX, BOXW, PAGE)
            fence_async_shared()

            # scores^T [PAGE, BN]: NoPE (products of e4m3 values) + RoPE (bf16), fp32 accumulation
            if ABLATE & 2:  # (timing probes only, scripts/probe_gluon_decode.py: wrong results)
                qk = zero_s + it
                rd = zero_s
            elif QK_FP8:
                if not INPLACE:
                    k0, k1, k2, k3, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, k2, k3, rd))
                qk = gl.convert_layout(((k0 + k1) + (k2 + k3)), mma_l)  # the same registers (no data movement)
            else:
                qk = warpgroup_mma(c16_smem, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                rd = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
                qk, rd = warpgroup_mma_wait(num_outstanding=0, deps=(qk, rd))

            rescale, m_i, l_i, pi_i, pi_max = _page_p_smem(gl.convert_layout(qk + rd, sm_l), s_cur, coef,
                                                           base + offs_t, limit, m_i, l_i, pi_i, pi_max, zero_sm,
                                                           p_smem, P_DIV, ABLATE, BN, srow_l)
            # O^T [R, BN] += C^T P^T: the same fp16 tile, read transposed
            beta = gl.expand_dims(gl.convert_layout(rescale, row_l), 0)
            if ABLATE & 4:
                acc = acc * beta
            else:
                # waited for right away: a wait deferred into the next iteration made ptxas serialize
                # every wgmma of the kernel (advisory C7515: the loop-carried accumulator)
                acc = warpgroup_mma(c16_smem.permute((1, 0)), p_smem.permute((1, 0)), acc * beta, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if INPLACE:  # the tile is read: the next page may land in it
                cta_barrier()
                _issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, 0, page_next, lat_page_rows,
                            rope_page_rows, (nxt < n_run) & (ABLATE & 16 == 0), NBOX, BOXW, BOX0)
                page_next = gl.load(bt_row + nxt + 1, mask=nxt + 1 < n_run, other=0).to(gl.int64)
            s_cur = s_next

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        _store_result(acc, gl.convert_layout(m_i, row_l), gl.convert_layout(l_i, row_l), gl.convert_layout(pi_i, row_l),
                      O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om, stride_os,
                      stride_lb, stride_lm, stride_ls, R, LSE_NATURAL, tok_l)
