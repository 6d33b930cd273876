"""What the native FP8 Gluon kernels (`narrow8.py`, `wide8.py`; opt-in `fp8_mma=True`) share.

Both run QK and PV on the tensor cores' e4m3 path straight from the TMA page slots (no fp16 widening):

  * a page slot is the page's four 128-channel latent boxes stacked ([4 x 64, 128] e4m3, 32 KB) plus
    its RoPE rows; `native8_smem` allocates the slots, the e4m3 query, the RoPE query, P^ and the
    barriers and puts the run's first pages in flight, `issue_slot` refills one, `page_start` waits
    for the current page, zeroes a request's tail codes in its slot (P = 0 does not cancel a NaN) and
    loads the next page's token scales;
  * PV is swapped, O^T = V^T P^T, with V^T (an 8-bit MMA operand, which must be K-major: K is the
    page's token axis, stored channel-major) read from the slot into registers: `vt_operand` loads 8
    contiguous bytes per token row through a `SharedLinearLayout` view (`box_views.slot_view_bases`)
    and one 4 x 4 byte transpose (`_transpose4x4`, `prmt`) per four registers yields wgmma's fragment;
    the MMA's row order is `box_views.pv8_channel`, put back in channel order by `store_vt`'s reshape;
  * the softmax and P^ are `common.page_p` in its fewest instructions (`page_p_native`: the same
    bits; no position test on pages every row of the tile sees whole, `fewest_visible`).
"""

from __future__ import annotations

from ..common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from ..common import LN2, NEW_REINTERPRET, cta_barrier, page_p, tma_load


if HAVE_GLUON:

    @gluon.jit
    def fewest_visible(limit, row0, n_rows, BN: gl.constexpr, srow_l: gl.constexpr):
        """The fewest cache positions a real row of the tile sees (rows past n_rows aside; a row may see
        none): pages below it need no position test in `page_p_native`."""
        return gl.min(gl.where(row0 + gl.arange(0, BN, layout=srow_l) < n_rows, limit, 1 << 30), 0)

    @gluon.jit
    def page_p_native(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s, whole, P_DIV: gl.constexpr,
                       AX: gl.constexpr):
        """`common.page_p` in the fewest instructions, the same bits: no position test when `whole` (every
        row sees the whole page), the e4m3 conversion's own saturation (cvt.satfinite) for the clamp, and
        max f / 448 by a reciprocal with Markstein's correction."""
        if whole:
            p8, rescale, m_i, l_i, pi_i, pi_max = page_p(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s,
                                                          P_DIV, AX, False, False, True)
        else:
            p8, rescale, m_i, l_i, pi_i, pi_max = page_p(raw, s_cur, coef, pos, limit, m_i, l_i, pi_i, pi_max, zero_s,
                                                          P_DIV, AX, True, False, True)
        return p8, rescale, m_i, l_i, pi_i, pi_max

    @gluon.jit
    def issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, slot, page, lat_page_rows, rope_page_rows, pred,
                    NBOX: gl.constexpr, BOXW: gl.constexpr, PAGE: gl.constexpr):
        """One page into slot `slot`: its NBOX latent boxes stacked in lat4[slot] (rows k * PAGE..) and its
        RoPE rows."""
        bar = bars.index(slot)
        lat_row = (page * lat_page_rows).to(gl.int32)
        mbarrier.expect(bar, NBOX * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=pred)
        for k in gl.static_range(NBOX):
            tma_load(lat_desc, [lat_row, k * BOXW], bar, lat4.index(slot).slice(k * PAGE, PAGE, dim=0), pred=pred)
        tma_load(rope_desc, [(page * rope_page_rows).to(gl.int32), 0], bar, rope_smem.index(slot), pred=pred)

    @gluon.jit
    def native8_smem(lat_desc, rope_desc, bt_row, n_run, lat_page_rows, rope_page_rows, STAGES: gl.constexpr,
                      NBOX: gl.constexpr, BOXW: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr, R: gl.constexpr,
                      D: gl.constexpr):
        """The native FP8 kernels' shared memory: STAGES page slots of 40 KB (latent boxes stacked, RoPE
        rows), the e4m3 query [BN, R], the RoPE query, P^ [BN, 64] and the slots' barriers; the run's first
        STAGES pages put in flight."""
        lat4 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, NBOX * PAGE, BOXW], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, R],
                                           gl.NVMMASharedLayout.get_default_for([BN, R], gl.float8e4nv))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, PAGE],
                                           gl.NVMMASharedLayout.get_default_for([BN, PAGE], gl.float8e4nv))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES):
            page = gl.load(bt_row + s, mask=s < n_run, other=0).to(gl.int64)
            issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, s, page, lat_page_rows, rope_page_rows,
                        s < n_run, NBOX, BOXW, PAGE)
        return lat4, rope_smem, q_smem, qr_smem, p_smem, bars

    @gluon.jit
    def zero_tail_slot(lat4, slot, base, length, NBOX: gl.constexpr, PAGE: gl.constexpr, cvt_l: gl.constexpr):
        """A request's last page: the codes of tokens past its length -> 0 in the slot, before any product
        reads it (they may be NaN, and P = 0 does not cancel a NaN)."""
        keep = gl.expand_dims((base + gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))) < length, 1)
        for k in gl.static_range(NBOX):
            box = lat4.index(slot).slice(k * PAGE, PAGE, dim=0)
            c8 = box.load(cvt_l)
            box.store(gl.where(keep, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True))

    @gluon.jit
    def page_start(lat4, bars, bt_row, SCALE, it, p_lo, n_run, length, offs_t, stride_sp, stride_st,
                    STAGES: gl.constexpr, NBOX: gl.constexpr, PAGE: gl.constexpr, cvt_l: gl.constexpr, after=0,
                    AHEAD: gl.constexpr = False):
        """Page `it` of the run: waits for its slot, zeroes a request's last page's tail codes there (before
        any product reads them), and returns (slot, first token, the page to refill the slot with, the next
        page's token scales, `after` for the next call). AHEAD: `after` is the next page's index, loaded by
        the previous call, so the scales' address does not wait on a block-table load; the page after that
        is loaded here for the next call (with two slots it is also the refill)."""
        slot = it % STAGES
        base = (p_lo + it) * PAGE
        if AHEAD:
            page_after = after
            after = gl.load(bt_row + it + 2, mask=it + 2 < n_run, other=0).to(gl.int64)
            if STAGES == 2:
                page_refill = after
            else:
                page_refill = gl.load(bt_row + it + STAGES, mask=it + STAGES < n_run, other=0).to(gl.int64)
        else:
            page_refill = gl.load(bt_row + it + STAGES, mask=it + STAGES < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
        s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                         mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
        mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
        if base + PAGE > length:
            zero_tail_slot(lat4, slot, base, length, NBOX, PAGE, cvt_l)
            fence_async_shared()  # the QK MMAs read the slot through the async proxy
            cta_barrier()
        return slot, base, page_refill, s_next, after

    @gluon.jit
    def _transpose4x4(v8):
        """Two 4 x 4 byte transposes per 8 registers (eight prmt): register 2 r + c, byte b -> register
        2 b + c, byte r, for 32 consecutive e4m3 codes in register order (`box_views.v_load_bases`: bytes =
        tokens bits 0-1, c = m's top bit, r = the two m bits the transposed view traded with the bytes;
        `box_views.transposed_register`)."""
        return gl.inline_asm_elementwise(
            """{ .reg .b32 t<8>;
            prmt.b32 t0, $8, $10, 0x5140; prmt.b32 t1, $8, $10, 0x7362;
            prmt.b32 t2, $12, $14, 0x5140; prmt.b32 t3, $12, $14, 0x7362;
            prmt.b32 $0, t0, t2, 0x5410; prmt.b32 $2, t0, t2, 0x7632;
            prmt.b32 $4, t1, t3, 0x5410; prmt.b32 $6, t1, t3, 0x7632;
            prmt.b32 t4, $9, $11, 0x5140; prmt.b32 t5, $9, $11, 0x7362;
            prmt.b32 t6, $13, $15, 0x5140; prmt.b32 t7, $13, $15, 0x7362;
            prmt.b32 $1, t4, t6, 0x5410; prmt.b32 $3, t4, t6, 0x7632;
            prmt.b32 $5, t5, t7, 0x5410; prmt.b32 $7, t5, t7, 0x7632; }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r", [v8.to(gl.int8, bitcast=True)], dtype=gl.int8,
            is_pure=True, pack=32)

    @gluon.jit
    def vt_operand(boxes, VIEW: gl.constexpr, LOAD: gl.constexpr, M: gl.constexpr, PAGE: gl.constexpr,
                    a_l: gl.constexpr):
        """Stacked TMA boxes (a slot, or a pair of its boxes) as PV's A operand V^T [M, PAGE] in registers
        (e4m3, wgmma layout a_l): 8-byte loads through the transposed view VIEW in the layout LOAD
        (`box_views.slot_view_bases`, `v_load_bases`), a 4 x 4 byte transpose per four registers, whose
        result is already the MMA's layout up to register names."""
        if NEW_REINTERPRET:
            view = boxes.reinterpret(gl.float8e4nv, [M, PAGE], VIEW)
        else:
            view = boxes._reinterpret(gl.float8e4nv, [M, PAGE], VIEW)
        v8 = _transpose4x4(view.load(LOAD))
        return gl.convert_layout(v8.to(gl.float8e4nv, bitcast=True), a_l)

    @gluon.jit
    def store_vt(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, n_rows, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL: gl.constexpr, BM: gl.constexpr, o_l: gl.constexpr,
                  W: gl.constexpr, st_l: gl.constexpr, CH0: gl.constexpr = 0, STORE_LSE: gl.constexpr = True):
        """The epilogue of O^T [64 W m, BM rows] (`pv8_channel` order, W warps along M, output channels CH0..):
        out = O / l, lse = m + log2(l pi) (rows that saw nothing: 0 and -inf). m = 16 W j + 16 w + 8 e + g
        is channel 64 w + 8 g + 2 j + e, so reshaping m to (j, w, e, g) and permuting to (w, g, j, e) puts
        the channels in order without moving data; st_l then only renames registers so that each thread's
        8 contiguous channels of a row are consecutive (16-byte stores, whole sectors per warp)."""
        orow_l: gl.constexpr = gl.SliceLayout(0, o_l)
        NM: gl.constexpr = 64 * W
        l_o = gl.convert_layout(l_i, orow_l)
        empty = l_o == 0.0
        out = acc / gl.expand_dims(gl.where(empty, 1.0, l_o), 0)
        if STORE_LSE:
            m_o = gl.convert_layout(m_i, orow_l)
            lse = gl.where(empty, float("-inf"),
                           m_o + gl.log2(gl.where(empty, 1.0, l_o * gl.convert_layout(pi_i, orow_l))))
            if LSE_NATURAL:
                lse = lse * LN2
            rows = row0 + gl.arange(0, BM, layout=orow_l)
            gl.store(LSE_PART + b64 * stride_lb + rows * stride_lm + split * stride_ls, lse, mask=rows < n_rows)
        out = gl.reshape(gl.permute(gl.reshape(out, [4, W, 2, 8, BM]), [1, 3, 0, 2, 4]), [NM, BM])
        out = gl.convert_layout(out, st_l)  # registers renamed only
        offs_c = CH0 + gl.arange(0, NM, layout=gl.SliceLayout(1, st_l))
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, st_l))
        o_ptr = (O_PART + b64 * stride_ob + split * stride_os + gl.expand_dims(rows * stride_om, 0)
                 + gl.expand_dims(offs_c, 1))
        gl.store(o_ptr, out, mask=gl.expand_dims(rows < n_rows, 0))
