"""What the Gluon decode kernels share (Gluon: Triton's explicit-layout dialect; Hopper only).

Host side: `make_descriptors`, the TMA descriptors of the latent and RoPE rows (a paged cache or the
patch's dense rows, both one table of rows). Kernel side (`gluon.jit` helpers, inlined):

  * the TMA page ring: `issue_page` asks the copy engine for one page (latent boxes of 128 bytes,
    the widest swizzle, and the bf16 RoPE rows) into a slot, an mbarrier counting its bytes in;
    `start_ring` puts a run's first pages in flight; `issue_tile_page` does the same into a [64, r]
    tile (bf16 boxes as its 64-channel column blocks, or fp8 boxes into the upper half of an fp16 tile);
  * the query: `query_operands` (sigma = amax / 448, q^ = e4m3(q / sigma), q~r = bf16(q_r / sigma),
    stored in shared memory as MMA operands), `split_run` (a program's pages in the uniform schedule,
    as `triton/decode.py`'s stage 1) and `row_state` (per-row causal limits and softmax state);
  * the page's arithmetic: `page_p` is the online softmax and the fp8_scale_fused P of
    `triton/decode.py` (`_online_softmax`, `_page_weights`) written in Gluon, with the fma-corrected
    division (`_div_markstein`); `page_p_smem` stores P^ for the swap-AB kernels; `page_p16` is the bf16
    layout's page (P = bf16(e)) and `zero_tail_rows` zeroes a bf16 tile's tokens past a request's length;
  * `widen_boxes` (fp8 boxes -> an exact fp16 tile, a request's tail tokens zeroed) and
    `store_result` (out = acc / l, lse = m + log2(l pi), into the split's partials); `store_rows` is the
    64-row kernels' epilogue around it.

Every Gluon kernel's program is one (request, row tile, split) of the uniform schedule: its partial
output and LSE go to the buffers `triton/combine.py` merges. Gluon has no interpreter: these compile
for sm_90 on any machine (tests compile them) and run on a Hopper GPU only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import constants
from ..layouts import GLUON_BOX
from .box_views import pv_channel, pv_channel_pair, qk_channel

try:  # Gluon ships with triton >= 3.5; older installs simply have no tile="gluon"
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the TMA load was renamed between triton 3.6 and 3.9
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed likewise
    NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # 3.6: _reinterpret
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

BOX = GLUON_BOX  # fp8 codes per TMA box row: 128 bytes, the widest swizzle

# e4m3 -> fp16 by integer operations instead of Hopper's conversion unit (F2FP): four codes (one 32-bit
# register) -> two f16x2 registers holding the codes' values times 2^-8. `gluon.narrow`'s `widen` knob; on an
# H100 no mode was faster than cvt (docs/performance.md, "Against FlashMLA"), so cvt stays the default.
# An e4m3 byte s.eeee.mmm placed at bits 7..14 of a 16-bit half reads as the fp16 s'=0, e'=0.s.eeee (wrong
# sign position); adding the sign bit once more first, (b + (b & 0x80)) << 7, carries it to bit 15 and clears
# bit 14, leaving s.0eeee.mmm0000000: exponent bias 15 instead of 7 and the same mantissa, i.e. value * 2^-8
# exactly, e4m3 subnormals included (they land on fp16 subnormals, >= 2^-17). Nothing crosses a half
# (b + 0x80 <= 0x17F, and 0x17F << 7 < 2^16). The NaN codes (s.1111.111) become +-1.875 (value 480 * 2^-8)
# where cvt gives NaN; the quantizer never writes them (it saturates at 448) and the kernels zero the codes
# past a request's length. Per register, twice: prmt (bytes 0, 1 -> the halves' low bytes), and, add, shl;
# ptxas runs the add and shl as IMADs, on the FMA pipe (`tests/test_widen_int.py` runs these instructions
# through a small emulator over every code).
E4M3_TO_F16_INT_PTX = (
    "{ .reg .b32 z, h, m, u; mov.b32 z, 0; "
    "prmt.b32 h, $2, z, 0x4140; and.b32 m, h, 0x00800080; add.u32 u, h, m; shl.b32 $0, u, 7; "
    "prmt.b32 h, $2, z, 0x4342; and.b32 m, h, 0x00800080; add.u32 u, h, m; shl.b32 $1, u, 7; }")
WIDEN_INT_SCALE = 256.0  # what undoes the 2^-8: exact in fp32, applied to the accumulators, not the codes
# div.rn.f32's fast path (what ptxas emits ahead of its FCHK-guarded slow-path call): r = rcp.approx(b), one
# Newton step r' = r + r (1 - b r), q = a r', then one fma correction q + r' (a - b q): the correctly rounded
# quotient whenever r' is within an ulp of 1 / b and nothing is subnormal or overflows (Markstein's theorem)
DIV_RN_FAST_PTX = ("{ .reg .f32 r, e, nb, q, s; neg.f32 nb, $2; rcp.approx.ftz.f32 r, $2; "
                   "fma.rn.f32 e, nb, r, 0f3F800000; fma.rn.f32 r, r, e, r; mul.rn.f32 q, $1, r; "
                   "fma.rn.f32 s, nb, q, $1; fma.rn.f32 $0, r, s, q; }")
# One thread asks the L2 to fetch a byte range ahead of its TMA load (Hopper's bulk prefetch: no shared memory, no
# barrier, nothing waits on it). The ring's two slots keep at most two pages in flight per program; a page
# already in L2 when its slot asks for it arrives in L2 latency, not DRAM's.
L2_PREFETCH_PTX = ("{ .reg .pred p; setp.ne.s32 p, $1, 0; "
                   "@p cp.async.bulk.prefetch.L2.global [$2], $3; mov.u32 $0, 0; }")
E4M3_TO_F16_CVT_PTX = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"


def _rows_view(t: torch.Tensor, row_stride: int) -> tuple[list[int], list[int]]:
    """Shape and strides of `t` seen as one 2-D table of rows (every row start a multiple of
    `row_stride` elements from the first): what the TMA descriptor addresses by row index."""
    last = sum((n - 1) * s for n, s in zip(t.shape[:-1], t.stride()[:-1], strict=True))
    return [last // row_stride + 1, t.shape[-1]], [row_stride, 1]


def make_descriptors(lat: torch.Tensor, lat_row: int, rope_bf16: torch.Tensor, rope_row: int,
                     fp8: bool = True) -> tuple[Any, Any]:
    """TMA descriptors of the latent (fp8 boxes [64, 128], or bf16 boxes [64, 64] for `wide.py`'s bf16
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
    # globals read inside Gluon functions must be constexpr; the values are snapquant.constants'
    LN2 = gl.constexpr(math.log(2.0))
    E4M3_MAX = gl.constexpr(constants.E4M3_MAX)
    E4M3_RCP = gl.constexpr(constants.E4M3_RCP)  # RN_f32(1 / 448)
    BF16_MAX = gl.constexpr(constants.BF16_MAX)
    SCALE_FLOOR = gl.constexpr(constants.SCALE_FLOOR)
    PI_REL_FLOOR = gl.constexpr(constants.PI_REL_FLOOR)
    PI_ABS_FLOOR = gl.constexpr(constants.PI_ABS_FLOOR)

    E4M3_TO_F16_CVT_PTX_C = gl.constexpr(E4M3_TO_F16_CVT_PTX)
    DIV_RN_FAST_PTX_C = gl.constexpr(DIV_RN_FAST_PTX)
    E4M3_TO_F16_INT_PTX_C = gl.constexpr(E4M3_TO_F16_INT_PTX)
    L2_PREFETCH_PTX_C = gl.constexpr(L2_PREFETCH_PTX)
    WIDEN_INT_SCALE_C = gl.constexpr(WIDEN_INT_SCALE)

    _qk_channel = gluon.jit(qk_channel)
    _pv_channel = gluon.jit(pv_channel)
    _pv_channel_pair = gluon.jit(pv_channel_pair)

    @gluon.jit
    def issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, slot, page, lat_page_rows, rope_page_rows,
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
    def prefetch_l2(base, nbytes, go, num_warps: gl.constexpr):
        """`cp.async.bulk.prefetch.L2` of `nbytes` (a multiple of 16) from byte address `base` (int64, 16-byte
        aligned), issued by thread 0 of the program when `go`: the rows of a page the ring will ask for later."""
        tid_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        tid = gl.arange(0, 32 * num_warps, layout=tid_l)  # one element per thread: its index
        flag = ((tid == 0) & go).to(gl.int32)
        gl.inline_asm_elementwise(L2_PREFETCH_PTX_C, "=r,r,l,r",
                                  [flag, gl.zeros_like(tid).to(gl.int64) + base, gl.zeros_like(tid) + nbytes],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def prefetch_page(LAT, ROPE, page, lat_page_bytes, rope_page_bytes, lat_span, rope_span, go,
                      num_warps: gl.constexpr):
        """Ask the L2 for a page's latent and RoPE rows (`*_span` bytes from the page's first row; the page
        strides `*_page_bytes`), e.g. the page a ring slot will load a few iterations later."""
        prefetch_l2(LAT.to(gl.int64, bitcast=True) + page * lat_page_bytes, lat_span, go, num_warps)
        prefetch_l2(ROPE.to(gl.int64, bitcast=True) + page * rope_page_bytes, rope_span, go, num_warps)

    @gluon.jit
    def prefetch_run_page(LAT, ROPE, bt_row, idx, n_run, lat_page_bytes, rope_page_bytes, lat_span, rope_span,
                          num_warps: gl.constexpr):
        """`prefetch_page` of the run's page `idx` (its id from the block table row `bt_row`), if the run has it."""
        ok = idx < n_run
        page = gl.load(bt_row + idx, mask=ok, other=0).to(gl.int64)
        prefetch_page(LAT, ROPE, page, lat_page_bytes, rope_page_bytes, lat_span, rope_span, ok, num_warps)

    @gluon.jit
    def issue_tile_page(lat_desc, rope_desc, box_smem, tile_smem, rope_smem, bars, slot, page, lat_page_rows,
                    rope_page_rows, pred, FP8: gl.constexpr, NBOX: gl.constexpr, BOXW: gl.constexpr):
        """Ask the TMA unit for one page into slot `slot`: fp8 boxes into the upper half of the slot's fp16
        tile (`box_smem` views it as boxes), or bf16 boxes straight into its 64-channel column blocks."""
        bar = bars.index(slot)
        lat_row = (page * lat_page_rows).to(gl.int32)
        rope_row = (page * rope_page_rows).to(gl.int32)
        mbarrier.expect(bar, NBOX * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=pred)
        for k in gl.static_range(NBOX):
            if FP8:
                tma_load(lat_desc, [lat_row, k * BOXW], bar, box_smem.index((2 * slot + 1) * NBOX + k), pred=pred)
            else:
                tma_load(lat_desc, [lat_row, k * BOXW], bar, tile_smem.index(slot).slice(k * BOXW, BOXW, dim=1),
                         pred=pred)
        tma_load(rope_desc, [rope_row, 0], bar, rope_smem.index(slot), pred=pred)

    @gluon.jit
    def e4m3_to_f16(c8):
        """e4m3 codes -> exact fp16 values, four codes (one 32-bit register) per asm instance: two
        cvt.rn.f16x2.e4m3x2 on the register's halves (the generic cast shuffles bytes first)."""
        return gl.inline_asm_elementwise(E4M3_TO_F16_CVT_PTX_C, "=r,=r,r", [c8.to(gl.int8, bitcast=True)],
                                         dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def e4m3_to_f16_int(c8):
        """e4m3 codes -> exact fp16 values times 2^-8 by integer operations (E4M3_TO_F16_INT_PTX): no
        conversion-unit instruction; the caller multiplies what it accumulates by WIDEN_INT_SCALE."""
        return gl.inline_asm_elementwise(E4M3_TO_F16_INT_PTX_C, "=r,=r,r", [c8.to(gl.int8, bitcast=True)],
                                         dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def widen_e4m3(c8, INT: gl.constexpr):
        """`e4m3_to_f16_int` when INT (values times 2^-8), else `e4m3_to_f16` (exact values)."""
        if INT:
            return e4m3_to_f16_int(c8)
        else:
            return e4m3_to_f16(c8)

    @gluon.jit
    def query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S: gl.constexpr,
                        R: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, QK_FP8: gl.constexpr, q_l: gl.constexpr,
                        Q8: gl.constexpr = True, QK_PERM: gl.constexpr = False, Q_RCP: gl.constexpr = False):
        """Stores q^ = e4m3(q / sigma) (as fp16, or e4m3 for a native fp8 QK) and q~r = bf16(q_r / sigma)
        of the program's BN query rows into shared memory; returns sigma = amax(q) / 448 per row.
        Q8=False (the bf16 layout): bf16(q) and bf16(q_r), sigma = 1. QK_PERM: q^'s channels in
        `narrow.py`'s QK order (column k holds channel qk_channel(k)). Q_RCP: q / sigma as q times 1 / sigma
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
    def split_run(LENS, b, split, NSPLIT, PAGE: gl.constexpr):
        """Request b's length and the pages of its split `split` of NSPLIT (uniform schedule): the first page
        p_lo and how many to run (0 for a split past the request's pages)."""
        length = gl.load(LENS + b)
        n_pages = (length + PAGE - 1) // PAGE
        per_split = (n_pages + NSPLIT - 1) // NSPLIT
        p_lo = split * per_split
        return length, p_lo, gl.maximum(gl.minimum(p_lo + per_split, n_pages) - p_lo, 0)

    @gluon.jit
    def row_state(length, row0, sigma, sm_scale_log2, H, S: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
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
    def div_rn_fast(a, b):
        """a / b as div.rn's fast path, without its slow-path call (DIV_RN_FAST_PTX): the same bits wherever
        div.rn would not take the call (a, b and the quotient normal, or a = 0). A call site makes ptxas keep
        registers free around it, which spills a kernel that needs all 255 (`seesaw_fp8.py`)."""
        return gl.inline_asm_elementwise(DIV_RN_FAST_PTX_C, "=r,r,r", [a, b], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def online_softmax(x, m_i, AX: gl.constexpr):
        """One page of the log2-domain online softmax, tokens along AX (`triton/decode.py`'s `_online_softmax`):
        (m_new, e, alpha); rows with nothing visible yet keep m = -inf (their e and alpha are 0)."""
        m_new = gl.maximum(m_i, gl.max(x, AX))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, gl.exp2(x - gl.expand_dims(m_ref, AX)), gl.exp2(m_i - m_ref)

    @gluon.jit
    def page_p(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s, P_DIV: gl.constexpr,
                AX: gl.constexpr = 0, MASK: gl.constexpr = True, CLAMP: gl.constexpr = True,
                PI_RCP: gl.constexpr = False, DIV_FAST: gl.constexpr = False):
        """One page of the online softmax and of fp8_scale_fused P, tokens along axis AX (the arithmetic
        of `triton/decode.py`'s `_online_softmax` and `_page_weights`): raw = <q^, c^> + <q~r, r~> per
        (token, row) -> (P^ as e4m3, accumulator rescale beta, m, l, pi, pi_max). MASK=False: the caller
        knows every row sees every token of the page (no position test). CLAMP=False: the e4m3
        conversion's own saturation (cvt.satfinite) bounds f / pi, the same codes for finite values.
        PI_RCP: max f / 448 as a multiply by RN(1 / 448) with Markstein's correction, the correctly
        rounded quotient (pi is floored at >= 2^-100, far above where that could differ). DIV_FAST: the
        per-row divisions by pi (1 / pi, beta, l's increment) as `div_rn_fast`: div_rn's bits except where
        beta or an increment of l is subnormal (below 2^-126, where it no longer moves O or l)."""
        RA: gl.constexpr = 1 - AX  # the rows' axis
        if MASK:
            x = (gl.expand_dims(s_cur, RA) * raw) * gl.expand_dims(coef, AX)
            x = gl.where(gl.expand_dims(pos, RA) < gl.expand_dims(limit, AX), x, float("-inf"))
        else:  # mul.rn: not contracted with the softmax's x - m into an fma (the masked path's bits)
            x = _mul_rn(gl.expand_dims(s_cur, RA) * raw, gl.expand_dims(coef, AX) + zero_s)
        m_new, e, alpha = online_softmax(x, m_i, AX)
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
            if DIV_FAST:
                r_row = div_rn_fast(gl.full_like(pi_new, 1.0), pi_new)
            else:
                r_row = gl.div_rn(gl.full_like(pi_new, 1.0), pi_new)
            r_inv = gl.expand_dims(r_row, AX) + zero_s
            if P_DIV == 2:  # Markstein: one fma correction gives the correctly rounded quotient
                y = _div_markstein(f, pi_b, r_inv)
            else:
                y = f * r_inv
        if CLAMP:
            y = gl.minimum(gl.maximum(y, -E4M3_MAX), E4M3_MAX)
        p8 = y.to(gl.float8e4nv)
        if DIV_FAST:
            rescale = div_rn_fast(alpha * pi_i, pi_new)
            l_i = rescale * l_i + div_rn_fast(gl.sum(e, AX), pi_new)
        else:
            rescale = gl.div_rn(alpha * pi_i, pi_new)
            l_i = rescale * l_i + gl.div_rn(gl.sum(e, AX), pi_new)
        return p8, rescale, m_new, l_i, pi_new, pi_max

    @gluon.jit
    def page_p16(raw, coef, pos, limit, m_i, l_i, AX: gl.constexpr):
        """The bf16 layout's page of the online softmax, tokens along axis AX (the 16-bit branch of
        `triton/decode.py`'s `_page_weights`): (P = bf16(e), alpha, m, l)."""
        RA: gl.constexpr = 1 - AX  # the rows' axis
        x = raw * gl.expand_dims(coef, AX)
        x = gl.where(gl.expand_dims(pos, RA) < gl.expand_dims(limit, AX), x, float("-inf"))
        m_new, e, alpha = online_softmax(x, m_i, AX)
        l_i = alpha * l_i + gl.sum(e, AX)
        return e.to(gl.bfloat16), alpha, m_new, l_i

    @gluon.jit
    def zero_tail_rows(tile, base, length, R: gl.constexpr, PAGE: gl.constexpr, z_l: gl.constexpr):
        """Tokens past the request's length (a last page's tail) -> exact zeros in a bf16 tile [PAGE, R] (P = 0
        there, but 0 x NaN is NaN), 64 channels (one TMA box) at a time."""
        offs_t = gl.arange(0, PAGE, layout=gl.SliceLayout(1, z_l))
        keep = gl.expand_dims((base + offs_t) < length, 1)
        for k in gl.static_range(R // 64):
            part = tile.slice(k * 64, 64, dim=1)
            v = part.load(z_l)
            part.store(gl.where(keep, v, gl.zeros_like(v)))

    @gluon.jit
    def start_ring(lat_desc, rope_desc, lat_smem, rope_smem, bars, bt_row, n_run, lat_page_rows, rope_page_rows,
                    STAGES: gl.constexpr, AHEAD: gl.constexpr, NBOX: gl.constexpr, BOXW: gl.constexpr,
                    BOX0: gl.constexpr):
        """Initialise the ring's STAGES barriers and put the run's first AHEAD pages in flight (slots 0..)."""
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(AHEAD):
            ok = s < n_run
            page = gl.load(bt_row + s, mask=ok, other=0).to(gl.int64)
            issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, s, page, lat_page_rows, rope_page_rows,
                        ok, NBOX, BOXW, BOX0)

    @gluon.jit
    def page_p_smem(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s, p_smem, P_DIV: gl.constexpr):
        """`page_p` for the swap-AB kernels (tokens along axis 0), then P^ as fp16 [rows, tokens] into p_smem,
        the PV MMA's B operand (16-byte stores)."""
        p8, rescale, m_i, l_i, pi_i, pi_max = page_p(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max,
                                                      zero_s, P_DIV)
        p_smem.store(gl.permute(p8.to(gl.float16), [1, 0]))
        fence_async_shared()
        return rescale, m_i, l_i, pi_i, pi_max

    @gluon.jit
    def store_result(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om, stride_os,
                      stride_lb, stride_lm, stride_ls, R: gl.constexpr, LSE_NATURAL: gl.constexpr, ch_l: gl.constexpr,
                      AX: gl.constexpr = 1, CH0: gl.constexpr = 0, STORE_LSE: gl.constexpr = True,
                      PV_PERM: gl.constexpr = False):
        """out = acc / l (rows along axis AX of acc: 1 for O^T), lse = m + log2(l pi); rows that saw
        nothing give 0 and -inf. acc holds output channels CH0..CH0 + R - 1 (PV_PERM: in `narrow.py`'s
        PV order, row m being channel CH0 + pv_channel(m); PV_PERM=2: `pv_channel_pair(m)`)."""
        CA: gl.constexpr = 1 - AX  # the channels' axis
        empty = l_i == 0.0
        out = acc / gl.expand_dims(gl.where(empty, 1.0, l_i), CA)
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i * pi_i)))
        if LSE_NATURAL:
            lse = lse * LN2
        offs_c = gl.arange(0, R, layout=ch_l)
        if PV_PERM == 2:  # `narrow_halves.py`'s eight-warp order
            offs_c = _pv_channel_pair(offs_c)
        elif PV_PERM:
            offs_c = _pv_channel(offs_c)
        o_ptr = (O_PART + b64 * stride_ob + split * stride_os + gl.expand_dims(rows * stride_om, CA)
                 + gl.expand_dims(CH0 + offs_c, AX))
        gl.store(o_ptr, out, mask=gl.expand_dims(row_ok, CA) & gl.expand_dims(offs_c < R, AX))
        if STORE_LSE:
            gl.store(LSE_PART + b64 * stride_lb + rows * stride_lm + split * stride_ls, lse, mask=row_ok)

    @gluon.jit
    def store_rows(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, n_rows, stride_ob, stride_om, stride_os,
                    stride_lb, stride_lm, stride_ls, R: gl.constexpr, LSE_NATURAL: gl.constexpr, BM: gl.constexpr,
                    o_l: gl.constexpr, CH0: gl.constexpr = 0, STORE_LSE: gl.constexpr = True):
        """The 64-row kernels' epilogue: O [BM, R] (rows along axis 0, in the PV accumulator's layout; output
        channels CH0 .. CH0 + R - 1, as a seesaw warpgroup's half) and the softmax state -> the split's
        partial output and (STORE_LSE) LSE (`store_result`)."""
        orow_l: gl.constexpr = gl.SliceLayout(1, o_l)
        rows = row0 + gl.arange(0, BM, layout=orow_l)
        store_result(acc, gl.convert_layout(m_i, orow_l), gl.convert_layout(l_i, orow_l),
                      gl.convert_layout(pi_i, orow_l), O_PART, LSE_PART, b64, split, rows, rows < n_rows,
                      stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls, R, LSE_NATURAL,
                      gl.SliceLayout(0, o_l), 0, CH0, STORE_LSE)

    @gluon.jit
    def widen_boxes(lat_smem, c16_smem, box0, K_LO: gl.constexpr, K_HI: gl.constexpr, base, length, offs_tc,
                     cvt_l: gl.constexpr, INPLACE: gl.constexpr, NBOX: gl.constexpr, BOXW: gl.constexpr,
                     PAGE: gl.constexpr):
        """fp8 boxes K_LO..K_HI - 1 of the page -> fp16 chunks of the tile; on a request's last page the
        tokens past its length become exact zeros (only there: the select costs one op per code)."""
        if base + PAGE <= length:
            for k in gl.static_range(K_LO, K_HI):
                c8 = lat_smem.index(box0 + k).load(cvt_l)
                if INPLACE and 2 * k + 1 >= NBOX:  # chunk k overwrites upper-half boxes 2k - NBOX, 2k - NBOX + 1
                    cta_barrier()  # ... which may include box k, just read by the other warps
                c16_smem.slice(k * BOXW, BOXW, dim=1).store(e4m3_to_f16(c8))
        else:
            tok_ok_c = gl.expand_dims((base + offs_tc) < length, 1)
            for k in gl.static_range(K_LO, K_HI):
                c8 = lat_smem.index(box0 + k).load(cvt_l)
                c8 = gl.where(tok_ok_c, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True)
                if INPLACE and 2 * k + 1 >= NBOX:
                    cta_barrier()
                c16_smem.slice(k * BOXW, BOXW, dim=1).store(e4m3_to_f16(c8))
