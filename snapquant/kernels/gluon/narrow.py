"""The <= 16-row snapmla page loop with register MMA operands, no fp16 tile (Gluon, Hopper only).

The default at <= 16 query rows on Hopper with kv_lora_rank 512 (the snapmla layout, fp8 query and P).
`narrow_tile.py` widens every page into a 64 KB fp16 tile in shared memory that both fp16 MMAs read;
that tile leaves room for one page slot per program (converted in place), so each of the two programs
on an SM has at most one page in flight and none while it computes. Here the page never leaves its TMA
slot: each product's A operand is loaded from the fp8 boxes straight into registers (16-byte
`ld.shared` for QK, 4-byte for PV, each in the minimum number of shared-memory wavefronts), widened
there (`cvt.rn.f16x2.e4m3x2`, exact) and fed to the same exact fp16 wgmma:

  * S^T = C Q^T: A = the page [64 tokens, 128 channels] per box. wgmma's register fragment holds, per
    thread, channel pairs 2q, 2q+1 (+8, +16 ...) of two tokens; the MMA's K order is ours to choose, so
    logical channel k = 16 s + 8 h + 2 q + e of a box is physical channel 32 q + 4 s + 2 h + e
    (`box_views.qk_channel`): each thread's 64 codes per token row are 32 contiguous bytes. The query is
    stored in the same order, so the dot product is unchanged (up to fp32 summation order).
  * O^T += C^T P^T: A = the page read channel-major, [128 channels, 64 tokens] per box. Here the M
    order (output channels) is ours: logical row m of a box is physical channel `box_views.pv_channel(m)`,
    the four rows a thread holds being four contiguous bytes; the epilogue stores each row at its
    physical channel. One accumulator per box (4 x 16 registers) bounds the live A registers to one box.
  * both are plain reinterpretations of the TMA box ([64, 128] e4m3, 128-byte swizzle) as a
    `SharedLinearLayout` (`box_views.box_view_bases`): the permutation costs nothing at run time.

With the fp16 tile gone a program needs ~105 KB for STAGES = 2 page slots (40 KB each: latent and
RoPE) and its query operands, so two programs still share an SM, each with the next page in flight
while it computes this one. On a request's last page the tokens past its length are zeroed in the slot
before the products (P = 0 does not cancel a NaN code). The softmax, P quantization (P_DIV) and
epilogue are `common`'s.
"""

from __future__ import annotations

from .box_views import box_view_bases
from .common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .common import (
        NEW_REINTERPRET,
        WIDEN_INT_SCALE_C,
        cta_barrier,
        issue_page,
        page_p_smem,
        prefetch_run_page,
        query_operands,
        row_state,
        split_run,
        start_ring,
        store_result,
        widen_e4m3,
    )

    QK_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=box_view_bases("qk")))
    PV_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=box_view_bases("pv")))

    @gluon.jit
    def _box_view(lat_smem, box, VIEW: gl.constexpr, SHAPE: gl.constexpr):
        if NEW_REINTERPRET:
            return lat_smem.index(box).reinterpret(gl.float8e4nv, SHAPE, VIEW)
        else:
            return lat_smem.index(box)._reinterpret(gl.float8e4nv, SHAPE, VIEW)

    @gluon.jit
    def _next_operand(acc, lat_smem, box, VIEW: gl.constexpr, SHAPE: gl.constexpr, a_l: gl.constexpr,
                      INT: gl.constexpr, ONE_LIVE: gl.constexpr):
        """The next box's widened A operand, with the MMA in flight (`acc`) waited for: after the load (two
        boxes' operands live, the load under the MMA) or, ONE_LIVE, before it (one box live, fewer registers)."""
        if ONE_LIVE:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            a16 = widen_e4m3(_box_view(lat_smem, box, VIEW, SHAPE).load(a_l), INT)
        else:
            a16 = widen_e4m3(_box_view(lat_smem, box, VIEW, SHAPE).load(a_l), INT)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        return acc, a16

    @gluon.jit
    def _zero_tail(lat_smem, box0, base, length, NBOX: gl.constexpr, PAGE: gl.constexpr, cvt_l: gl.constexpr):
        """A request's last page: the codes of tokens past its length -> 0 in the slot (they may be NaN)."""
        keep = gl.expand_dims((base + gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))) < length, 1)
        for k in gl.static_range(NBOX):
            c8 = lat_smem.index(box0 + k).load(cvt_l)
            lat_smem.index(box0 + k).store(
                gl.where(keep, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True))

    @gluon.jit
    def _snapmla_decode_gluon_regs(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT, LAT, ROPE, lat_page_bytes, rope_page_bytes, lat_span, rope_span,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr,
        num_warps: gl.constexpr, QK_INT: gl.constexpr = False, PV_INT: gl.constexpr = 0, PF: gl.constexpr = 0,
        QK_FP8: gl.constexpr = False,
    ):
        gl.static_assert(num_warps == 4)
        gl.static_assert(PV_INT >= 0)
        gl.static_assert(PV_INT <= 4)
        gl.static_assert(R == 512)  # four boxes, four PV accumulators (the host checks)
        gl.static_assert(PAGE == 64)
        gl.static_assert(not (QK_FP8 and QK_INT))  # a native QK widens nothing
        BN: gl.constexpr = 16  # query rows (wgmma N)
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW

        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        mma8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 32])  # e4m3 wgmma's k step
        tok_l: gl.constexpr = gl.SliceLayout(1, mma_l)  # along M (tokens / channels)
        row_l: gl.constexpr = gl.SliceLayout(0, mma_l)  # along N (query rows)
        sm_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])  # as narrow_tile: a warp per row
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        b = gl.program_id(0)
        row0 = gl.program_id(1) * BN
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)

        lat_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * NBOX, PAGE, BOXW], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        if QK_FP8:  # q^ as e4m3 in the natural channel order: the B operand of the native QK
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, R],
                                               gl.NVMMASharedLayout.get_default_for([BN, R], gl.float8e4nv))
        else:
            q_smem = gl.allocate_shared_memory(gl.float16, [BN, R],
                                               gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float16, [BN, PAGE], gl.NVMMASharedLayout.get_default_for([BN, PAGE], gl.float16))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())

        # ---- prologue: STAGES - 1 pages in flight before anything else (one slot: the first page, which the
        # slot's refill inside the loop then follows)
        AHEAD: gl.constexpr = STAGES - 1 if STAGES > 1 else 1
        bt_row = BT + b64 * stride_bt + p_lo
        start_ring(lat_desc, rope_desc, lat_smem, rope_smem, bars, bt_row, n_run, lat_page_rows, rope_page_rows,
                    STAGES, AHEAD, NBOX, BOXW, 0)
        # L2 prefetch (PF > 0): the pages the ring asks for before the loop's first prefetch lands
        for j in gl.static_range(1, PF):
            prefetch_run_page(LAT, ROPE, bt_row, AHEAD + j, n_run, lat_page_bytes, rope_page_bytes,
                              lat_span, rope_span, num_warps)

        # ---- query: q^ as fp16 in the QK view's channel order, q~r as bf16; sigma per row
        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN,
                                QK_FP8, q_l, True, not QK_FP8, Q_RCP=True)
        rows = row0 + gl.arange(0, BN, layout=row_l)
        row_ok = rows < S * H
        limit, coef, m_i, l_i, pi_i, pi_max = row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
        acc0 = gl.zeros([BOXW, BN], gl.float32, mma_l)  # O^T, one accumulator per box (logical rows)
        acc1 = gl.zeros([BOXW, BN], gl.float32, mma_l)
        acc2 = gl.zeros([BOXW, BN], gl.float32, mma_l)
        acc3 = gl.zeros([BOXW, BN], gl.float32, mma_l)
        zero_s = gl.zeros([PAGE, BN], gl.float32, mma_l)
        zero_s8 = gl.zeros([PAGE, BN], gl.float32, mma8_l)
        zero_sm = gl.zeros([PAGE, BN], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        fence_async_shared()
        cta_barrier()

        page_next = gl.load(bt_row + AHEAD, mask=AHEAD < n_run, other=0).to(gl.int64)
        s_cur = gl.load(SCALE + gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64) * stride_sp
                        + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        for it in range(n_run):
            slot = it % STAGES
            nxt = it + AHEAD
            box0 = slot * NBOX
            if STAGES > 1:  # the slot of page it - 1 is free: its last reads were before last iteration's barrier
                issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, nxt % STAGES, page_next, lat_page_rows,
                            rope_page_rows, nxt < n_run, NBOX, BOXW, 0)
            if PF > 0:  # and the page PF after it into L2: when its slot asks for it, it comes from L2
                prefetch_run_page(LAT, ROPE, bt_row, nxt + PF, n_run, lat_page_bytes, rope_page_bytes, lat_span,
                                  rope_span, num_warps)
            page_ask = page_next  # page nxt (one slot: asked for once this page's codes are in registers)
            page_next = gl.load(bt_row + nxt + 1, mask=nxt + 1 < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            base = (p_lo + it) * PAGE
            s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
            mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
            if base + PAGE > length:
                _zero_tail(lat_smem, box0, base, length, NBOX, PAGE, cvt_l)
                if QK_FP8:  # the native QK reads the zeroed codes through the async proxy
                    fence_async_shared()
                cta_barrier()

            # scores^T [PAGE, BN] = C Q^T (NoPE: products of e4m3 values) + R Q_r^T (RoPE, bf16), fp32 accumulation
            rd = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            if QK_FP8:
                # native e4m3 wgmma straight from the TMA boxes (K-major as they land): no register operand,
                # no widening. Two chains of 256 channels (boxes 0-1, 2-3) summed in fp32, as gluon.narrow8's QK:
                # Hopper's FP8 MMA keeps ~14 bits inside a chain, and the reference models exactly this structure
                # (`reference.mma.MMANumerics.for_kernel`)
                q8 = q_smem.permute((1, 0))
                k0 = warpgroup_mma(lat_smem.index(box0), q8.slice(0, BOXW), zero_s8, use_acc=False, is_async=True)
                k0 = warpgroup_mma(lat_smem.index(box0 + 1), q8.slice(BOXW, BOXW), k0, is_async=True)
                k1 = warpgroup_mma(lat_smem.index(box0 + 2), q8.slice(2 * BOXW, BOXW), zero_s8, use_acc=False,
                                   is_async=True)
                k1 = warpgroup_mma(lat_smem.index(box0 + 3), q8.slice(3 * BOXW, BOXW), k1, is_async=True)
                k0, k1, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, rd))
                qk = gl.convert_layout(k0 + k1, mma_l) + rd  # the same registers (no data movement)
            else:
                # four boxes of e4m3 values widened in registers (exact fp16 products). An async wgmma holds its
                # register operands until it completes, so each MMA is waited for before the box after next is
                # loaded (two boxes' operands live); with one slot (168 registers, three programs per SM) before
                # the next box is loaded (one box live: ptxas would otherwise serialize every wgmma, C7512)
                qk = warpgroup_mma(widen_e4m3(_box_view(lat_smem, box0, QK_VIEW, [PAGE, BOXW]).load(a_l), QK_INT),
                                   q_smem.slice(0, BOXW, dim=1).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
                for k in gl.static_range(1, NBOX):
                    qk, a16 = _next_operand(qk, lat_smem, box0 + k, QK_VIEW, [PAGE, BOXW], a_l, QK_INT, STAGES == 1)
                    qk = warpgroup_mma(a16, q_smem.slice(k * BOXW, BOXW, dim=1).permute((1, 0)), qk, is_async=True)
                qk, rd = warpgroup_mma_wait(num_outstanding=0, deps=(qk, rd))
                if QK_INT:  # the integer widening gave the codes' values times 2^-8: one exact fma undoes it
                    qk = qk * WIDEN_INT_SCALE_C + rd
                else:
                    qk = qk + rd

            rescale, m_i, l_i, pi_i, pi_max = page_p_smem(gl.convert_layout(qk, sm_l), s_cur, coef, base + offs_t,
                                                           limit, m_i, l_i, pi_i, pi_max, zero_sm, p_smem, P_DIV)
            cta_barrier()
            # O^T [R, BN] += C^T P^T, box by box (rows in the PV view's order)
            beta = gl.expand_dims(gl.convert_layout(rescale, row_l), 0)
            pt = p_smem.permute((1, 0))
            # boxes below PV_INT widen by integer operations (their accumulators hold O^T times 2^-8)
            acc0 = warpgroup_mma(widen_e4m3(_box_view(lat_smem, box0, PV_VIEW, [BOXW, PAGE]).load(a_l), PV_INT > 0),
                                 pt, acc0 * beta, is_async=True)
            acc0, a16 = _next_operand(acc0, lat_smem, box0 + 1, PV_VIEW, [BOXW, PAGE], a_l, PV_INT > 1, STAGES == 1)
            acc1 = warpgroup_mma(a16, pt, acc1 * beta, is_async=True)
            acc1, a16 = _next_operand(acc1, lat_smem, box0 + 2, PV_VIEW, [BOXW, PAGE], a_l, PV_INT > 2, STAGES == 1)
            acc2 = warpgroup_mma(a16, pt, acc2 * beta, is_async=True)
            acc2, a16 = _next_operand(acc2, lat_smem, box0 + 3, PV_VIEW, [BOXW, PAGE], a_l, PV_INT > 3, STAGES == 1)
            if STAGES == 1:
                # one slot: its last reads (box 3's codes, now in registers) are done once every warp is here, so
                # the next page is asked for now and lands under PV's last MMA and the next page's prologue; the
                # programs beside this one on the SM (three with one slot each) stream theirs meanwhile
                cta_barrier()
                issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, 0, page_ask, lat_page_rows,
                            rope_page_rows, nxt < n_run, NBOX, BOXW, 0)
            acc3 = warpgroup_mma(a16, pt, acc3 * beta, is_async=True)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
            cta_barrier()  # every warp's reads of this slot (and of P) are done: the slot may be refilled
            s_cur = s_next

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        if PV_INT > 0:  # exact: a power of two on fp32 sums of the 2^-8-scaled products
            acc0 = acc0 * WIDEN_INT_SCALE_C
        if PV_INT > 1:
            acc1 = acc1 * WIDEN_INT_SCALE_C
        if PV_INT > 2:
            acc2 = acc2 * WIDEN_INT_SCALE_C
        if PV_INT > 3:
            acc3 = acc3 * WIDEN_INT_SCALE_C
        m_o = gl.convert_layout(m_i, row_l)
        l_o = gl.convert_layout(l_i, row_l)
        pi_o = gl.convert_layout(pi_i, row_l)
        store_result(acc0, m_o, l_o, pi_o, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om,
                      stride_os, stride_lb, stride_lm, stride_ls, BOXW, LSE_NATURAL, tok_l, AX=1, CH0=0,
                      STORE_LSE=True, PV_PERM=True)
        store_result(acc1, m_o, l_o, pi_o, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om,
                      stride_os, stride_lb, stride_lm, stride_ls, BOXW, LSE_NATURAL, tok_l, AX=1, CH0=BOXW,
                      STORE_LSE=False, PV_PERM=True)
        store_result(acc2, m_o, l_o, pi_o, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om,
                      stride_os, stride_lb, stride_lm, stride_ls, BOXW, LSE_NATURAL, tok_l, AX=1, CH0=2 * BOXW,
                      STORE_LSE=False, PV_PERM=True)
        store_result(acc3, m_o, l_o, pi_o, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om,
                      stride_os, stride_lb, stride_lm, stride_ls, BOXW, LSE_NATURAL, tok_l, AX=1, CH0=3 * BOXW,
                      STORE_LSE=False, PV_PERM=True)
