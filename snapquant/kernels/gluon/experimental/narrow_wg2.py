"""`gluon.narrow` on two warpgroups: twice the warps per SM for the <= 16-row page loop (experimental).

`gluon.narrow` runs each page as one dependent chain (widen, QK, softmax, PV) on one warpgroup, two programs
per SM: 2 warps per scheduler, and its profile stalls on fixed-latency dependencies (`wait`), not on DRAM or
the conversion unit (docs/performance.md, "Widening by integers"). Here a program has 8 warps on the same two
TMA slots, with at most 128 registers per thread so that two programs still share an SM (4 warps per
scheduler):

  * QK (S^T = C Q^T, [64 tokens, 16 rows]): the two warpgroups split N, the query rows (8 each); each widens
    the whole page into its A operand (the same registers `gluon.narrow` loads, duplicated per warpgroup).
  * PV (O^T += C^T P^T, [128 channels, 16 rows] per box): the warpgroups split M, the channels (64 each);
    each widens half of every box, and holds half of the accumulators (8 + 8 registers per box and thread).
  * the softmax of a page runs on both warpgroups, each warp two rows ([64 tokens, 16 rows] spread over 8
    warps): half the per-thread work of the one-warpgroup kernel.

Each output element is computed by the same MMA instructions' arithmetic as `gluon.narrow` (a split of N or
M does not change an element's K order), so the output is that kernel's bit for bit; the GPU test checks it.
Selected by `tile="gluon", num_warps=8` at <= 16 rows (snapmla, fp8 query and P, exact MMAs, r = 512).
"""

from __future__ import annotations

from ..box_views import box_view_bases
from ..common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from ..common import (
        NEW_REINTERPRET,
        cta_barrier,
        e4m3_to_f16,
        issue_page,
        page_p_smem,
        query_operands,
        row_state,
        split_run,
        start_ring,
        store_result,
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
    def _zero_tail(lat_smem, box0, base, length, NBOX: gl.constexpr, PAGE: gl.constexpr, cvt_l: gl.constexpr):
        """A request's last page: the codes of tokens past its length -> 0 in the slot (they may be NaN)."""
        keep = gl.expand_dims((base + gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))) < length, 1)
        for k in gl.static_range(NBOX):
            c8 = lat_smem.index(box0 + k).load(cvt_l)
            lat_smem.index(box0 + k).store(
                gl.where(keep, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True))

    @gluon.jit
    def _pv_box(lat_smem, box, pt, acc, beta, a_l: gl.constexpr, BOXW: gl.constexpr, PAGE: gl.constexpr):
        a16 = e4m3_to_f16(_box_view(lat_smem, box, PV_VIEW, [BOXW, PAGE]).load(a_l))
        return warpgroup_mma(a16, pt, acc * beta, is_async=True)

    @gluon.jit
    def _snapmla_decode_gluon_wg2(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        gl.static_assert(num_warps == 8)
        gl.static_assert(R == 512)
        gl.static_assert(PAGE == 64)
        BN: gl.constexpr = 16
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW

        # QK: warpgroups split N (rows); PV: warpgroups split M (channels)
        qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 8, 16])
        pv_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 16])
        aqk_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=qk_l, k_width=2)
        apv_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pv_l, k_width=2)
        tok_l: gl.constexpr = gl.SliceLayout(1, pv_l)  # along M of PV (channels)
        row_l: gl.constexpr = gl.SliceLayout(0, pv_l)  # along N of PV (query rows)
        sm_l: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, 8], [0, 1])  # a warp per two rows
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
        q_smem = gl.allocate_shared_memory(gl.float16, [BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float16, [BN, PAGE], gl.NVMMASharedLayout.get_default_for([BN, PAGE], gl.float16))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())

        bt_row = BT + b64 * stride_bt + p_lo
        start_ring(lat_desc, rope_desc, lat_smem, rope_smem, bars, bt_row, n_run, lat_page_rows, rope_page_rows,
                    STAGES, STAGES - 1, NBOX, BOXW, 0)

        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN,
                                False, q_l, True, True)
        rows = row0 + gl.arange(0, BN, layout=row_l)
        row_ok = rows < S * H
        limit, coef, m_i, l_i, pi_i, pi_max = row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
        acc0 = gl.zeros([BOXW, BN], gl.float32, pv_l)
        acc1 = gl.zeros([BOXW, BN], gl.float32, pv_l)
        acc2 = gl.zeros([BOXW, BN], gl.float32, pv_l)
        acc3 = gl.zeros([BOXW, BN], gl.float32, pv_l)
        zero_s = gl.zeros([PAGE, BN], gl.float32, qk_l)
        zero_sm = gl.zeros([PAGE, BN], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        fence_async_shared()
        cta_barrier()

        page_next = gl.load(bt_row + STAGES - 1, mask=STAGES - 1 < n_run, other=0).to(gl.int64)
        s_cur = gl.load(SCALE + gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64) * stride_sp
                        + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        for it in range(n_run):
            slot = it % STAGES
            nxt = it + STAGES - 1
            box0 = slot * NBOX
            issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, nxt % STAGES, page_next, lat_page_rows,
                        rope_page_rows, nxt < n_run, NBOX, BOXW, 0)
            page_next = gl.load(bt_row + nxt + 1, mask=nxt + 1 < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            base = (p_lo + it) * PAGE
            s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
            mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
            if base + PAGE > length:
                _zero_tail(lat_smem, box0, base, length, NBOX, PAGE, cvt_l)
                cta_barrier()

            rd = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            qk = warpgroup_mma(e4m3_to_f16(_box_view(lat_smem, box0, QK_VIEW, [PAGE, BOXW]).load(aqk_l)),
                               q_smem.slice(0, BOXW, dim=1).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            for k in gl.static_range(1, NBOX):
                # one box's codes and A operand live at a time (128 registers: ptxas serializes every wgmma
                # when a second box is loaded while the previous MMA runs)
                qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
                a16 = e4m3_to_f16(_box_view(lat_smem, box0 + k, QK_VIEW, [PAGE, BOXW]).load(aqk_l))
                qk = warpgroup_mma(a16, q_smem.slice(k * BOXW, BOXW, dim=1).permute((1, 0)), qk, is_async=True)
            qk, rd = warpgroup_mma_wait(num_outstanding=0, deps=(qk, rd))
            qk = qk + rd

            rescale, m_i, l_i, pi_i, pi_max = page_p_smem(gl.convert_layout(qk, sm_l), s_cur, coef, base + offs_t,
                                                           limit, m_i, l_i, pi_i, pi_max, zero_sm, p_smem, P_DIV)
            cta_barrier()
            beta = gl.expand_dims(gl.convert_layout(rescale, row_l), 0)
            pt = p_smem.permute((1, 0))
            acc0 = _pv_box(lat_smem, box0, pt, acc0, beta, apv_l, BOXW, PAGE)
            acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
            acc1 = _pv_box(lat_smem, box0 + 1, pt, acc1, beta, apv_l, BOXW, PAGE)
            acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1,))
            acc2 = _pv_box(lat_smem, box0 + 2, pt, acc2, beta, apv_l, BOXW, PAGE)
            acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2,))
            acc3 = _pv_box(lat_smem, box0 + 3, pt, acc3, beta, apv_l, BOXW, PAGE)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
            cta_barrier()
            s_cur = s_next

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

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
