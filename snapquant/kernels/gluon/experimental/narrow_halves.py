"""The <= 16-row snapmla page loop on two warpgroups that split each page's channels (Gluon, Hopper; opt-in).

`narrow.py` runs a page as one chain of dependent steps on four warps: QK over four boxes, the softmax and
P quantization, PV over four boxes. Two programs per SM are its only overlap, and the chain (not the bytes,
not the issue slots) is what bounds it at H = 16 (docs/performance.md). Here a program has eight warps, and
the two warpgroups share every step of the chain, each doing half of it, so the chain is about half as long
at the same two programs (and two 40 KB slots each) per SM:

  * QK: warpgroup h multiplies latent boxes 2j + h (j = 0, 1) and RoPE channels 32 h .. 32 h + 31. One
    wgmma tile [128, 32] carries both: its rows 0-63 (warpgroup 0) read box 2j, rows 64-127 (warpgroup 1)
    box 2j + 1, through one view of the two boxes (`box_views.pair_view_bases`), and the B operand holds q^
    of box 2j in columns 0-15 and of box 2j + 1 in 16-31; each warpgroup keeps its own columns. The two
    partial scores meet in one cross-warpgroup sum (shared memory), so both warpgroups hold all of S;
  * the softmax and P: every warp owns two query rows (`common.page_p_smem`, as `narrow.py`);
  * PV: warpgroup h computes rows 64 h .. 64 h + 63 of each box's O^T accumulator (channel order
    `box_views.pv_channel_halves`): half of every box.

Products are exact (fp16 MMAs on e4m3 values, fp32 sums): the reference's arithmetic up to fp32 summation
order (the scores sum two 256-channel chains, each starting from its half of RoPE). Registers: two programs of
256 threads share an SM at <= 128 registers a thread (`NARROW_HALVES_MAXNREG`); so each box's MMA is waited
for before the next box is loaded (one box's operand live, as `narrow.py` with one slot).
"""

from __future__ import annotations

from ..box_views import pair_view_bases, rope_halves_bases
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
        page_p_smem,
        prefetch_run_page,
        query_operands,
        row_state,
        split_run,
        store_result,
        widen_e4m3,
    )
    from .native8 import issue_slot, zero_tail_slot

    QK_PAIR = gl.constexpr(gl.SharedLinearLayout(offset_bases=pair_view_bases("qk")))
    PV_PAIR = gl.constexpr(gl.SharedLinearLayout(offset_bases=pair_view_bases("pv")))
    ROPE_HALVES = gl.constexpr(gl.SharedLinearLayout(offset_bases=rope_halves_bases(64)))

    @gluon.jit
    def _view(smem, dtype: gl.constexpr, SHAPE: gl.constexpr, VIEW: gl.constexpr):
        if NEW_REINTERPRET:
            return smem.reinterpret(dtype, SHAPE, VIEW)
        else:
            return smem._reinterpret(dtype, SHAPE, VIEW)

    @gluon.jit
    def _qk_pair(page_smem, BOX: gl.constexpr, a_l: gl.constexpr):
        """Boxes BOX, BOX + 1 of a slot as one [128 rows, 128 k] fp16 A operand (rows 64-127: the second box)."""
        pair = page_smem.slice(BOX * 64, 128, dim=0)
        return widen_e4m3(_view(pair, gl.float8e4nv, [128, 128], QK_PAIR).load(a_l), False)

    @gluon.jit
    def _pv_pair(page_smem, BOX: gl.constexpr, a_l: gl.constexpr):
        """Boxes BOX, BOX + 1 of a slot as the [256 m, 64 tokens] fp16 A operand of PV (m -> `pv_channel_pair`:
        the first warpgroup's rows read box BOX, the second's box BOX + 1)."""
        pair = page_smem.slice(BOX * 64, 128, dim=0)
        return widen_e4m3(_view(pair, gl.float8e4nv, [256, 64], PV_PAIR).load(a_l), False)

    @gluon.jit
    def _snapmla_decode_gluon_halves(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT, LAT, ROPE, lat_page_bytes, rope_page_bytes, lat_span, rope_span,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr,
        num_warps: gl.constexpr, PF: gl.constexpr = 0,
    ):
        gl.static_assert(num_warps == 8)
        gl.static_assert(R == 512)  # four boxes: two pairs
        gl.static_assert(D == 64)  # RoPE halves of 32 channels (`rope_halves_bases`)
        gl.static_assert(PAGE == 64)
        gl.static_assert(STAGES == 2)
        BN: gl.constexpr = 16  # query rows
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW

        # QK: [128, 32] tiles, warpgroup h's rows 64 h .., its columns 16 h ..; PV: [128, 16] per box
        qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, 2 * BN, 16])
        pv_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
        a_qk: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=qk_l, k_width=2)
        a_pv: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pv_l, k_width=2)
        ch_l: gl.constexpr = gl.SliceLayout(1, pv_l)  # along M (channels)
        row_l: gl.constexpr = gl.SliceLayout(0, pv_l)  # along N (query rows)
        sm_l: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, num_warps], [0, 1])  # a warp per two rows
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        ldr_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])

        b = gl.program_id(0)
        row0 = gl.program_id(1) * BN
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)

        lat4 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, NBOX * PAGE, BOXW], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.float16, [BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
        qr2_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * BN, D // 2],
                                             gl.NVMMASharedLayout.get_default_for([2 * BN, D // 2], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float16, [BN, PAGE], gl.NVMMASharedLayout.get_default_for([BN, PAGE], gl.float16))
        # the two warpgroups' partial scores [2 x 64, 16] fp32, where each reads the other's
        x_smem = gl.allocate_shared_memory(gl.float32, [2 * PAGE, BN], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # q2 [64, 128] reuses q's bytes (16 KB): q is read into registers before q2 is written
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([4 * BN, BOXW], gl.float16)
        if NEW_REINTERPRET:
            q2_smem = q_smem.reinterpret(gl.float16, [4 * BN, BOXW], q2_layout)
        else:
            q2_smem = q_smem._reinterpret(gl.float16, [4 * BN, BOXW], q2_layout)

        # ---- prologue: the first page in flight, then the query
        bt_row = BT + b64 * stride_bt + p_lo
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, 0, gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64),
                    lat_page_rows, rope_page_rows, n_run > 0, NBOX, BOXW, PAGE)
        for j in gl.static_range(1, PF):
            prefetch_run_page(LAT, ROPE, bt_row, STAGES - 1 + j, n_run, lat_page_bytes, rope_page_bytes,
                              lat_span, rope_span, num_warps)
        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN,
                                False, q_l, True, True, Q_RCP=True)
        cta_barrier()
        q_parts0 = q_smem.slice(0, BOXW, dim=1).load(ld_l)
        q_parts1 = q_smem.slice(BOXW, BOXW, dim=1).load(ld_l)
        q_parts2 = q_smem.slice(2 * BOXW, BOXW, dim=1).load(ld_l)
        q_parts3 = q_smem.slice(3 * BOXW, BOXW, dim=1).load(ld_l)
        # the RoPE query's halves by a register split (a slice inside the 128-byte swizzle is no place to load from)
        qr3 = gl.permute(gl.reshape(qr_smem.load(ldr_l), [BN, 2, D // 2]), (0, 2, 1))
        qr_lo, qr_hi = gl.split(gl.convert_layout(qr3, gl.BlockedLayout([1, 1, 2], [2, 16, 1], [num_warps, 1, 1],
                                                                        [2, 1, 0])))
        cta_barrier()
        q2_smem.slice(0, BN, dim=0).store(q_parts0)
        q2_smem.slice(BN, BN, dim=0).store(q_parts1)
        q2_smem.slice(2 * BN, BN, dim=0).store(q_parts2)
        q2_smem.slice(3 * BN, BN, dim=0).store(q_parts3)
        qr2_smem.slice(0, BN, dim=0).store(qr_lo)
        qr2_smem.slice(BN, BN, dim=0).store(qr_hi)

        rows = row0 + gl.arange(0, BN, layout=row_l)
        row_ok = rows < S * H
        limit, coef, m_i, l_i, pi_i, pi_max = row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
        acc_a = gl.zeros([2 * BOXW, BN], gl.float32, pv_l)  # O^T of boxes 0-1 (rows: pv_channel_pair)
        acc_b = gl.zeros([2 * BOXW, BN], gl.float32, pv_l)  # boxes 2-3
        zero_qk = gl.zeros([2 * PAGE, 2 * BN], gl.float32, qk_l)
        zero_sm = gl.zeros([PAGE, BN], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        # a QK tile's own entries: warpgroup h's rows (64 h ..) in its columns (16 h ..)
        own = (gl.expand_dims(gl.arange(0, 2 * PAGE, layout=gl.SliceLayout(1, qk_l)) >= PAGE, 1)
               == gl.expand_dims(gl.arange(0, 2 * BN, layout=gl.SliceLayout(0, qk_l)) >= BN, 0))
        fence_async_shared()
        cta_barrier()

        page_next = gl.load(bt_row + 1, mask=1 < n_run, other=0).to(gl.int64)
        s_cur = gl.load(SCALE + gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64) * stride_sp
                        + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        for it in range(n_run):
            slot = it % STAGES
            nxt = it + STAGES - 1
            # the slot of page it - 1 is free: its last reads were before last iteration's barrier
            issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, nxt % STAGES, page_next, lat_page_rows,
                        rope_page_rows, nxt < n_run, NBOX, BOXW, PAGE)
            if PF > 0:
                prefetch_run_page(LAT, ROPE, bt_row, nxt + PF, n_run, lat_page_bytes, rope_page_bytes, lat_span,
                                  rope_span, num_warps)
            page_next = gl.load(bt_row + nxt + 1, mask=nxt + 1 < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            base = (p_lo + it) * PAGE
            s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
            mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
            if base + PAGE > length:
                zero_tail_slot(lat4, slot, base, length, NBOX, PAGE, cvt_l)
                cta_barrier()
            page_smem = lat4.index(slot)

            # scores^T: warpgroup h's rows of the [128, 32] tile are <page, q^> over boxes h and 2 + h and RoPE
            # channels 32 h .. 32 h + 31, in its columns 16 h .. 16 h + 15; one box's operand live at a time
            a_r = _view(rope_smem.index(slot), gl.bfloat16, [2 * PAGE, D // 2], ROPE_HALVES).load(a_qk)
            qk = warpgroup_mma(a_r, qr2_smem.permute((1, 0)), zero_qk, use_acc=False, is_async=True)
            a16 = _qk_pair(page_smem, 0, a_qk)  # under the RoPE MMA
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            qk = warpgroup_mma(a16, q2_smem.slice(0, 2 * BN, dim=0).permute((1, 0)), qk, is_async=True)
            a16 = _qk_pair(page_smem, 2, a_qk)  # under the first pair's MMA (two pairs' operands live)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            qk = warpgroup_mma(a16, q2_smem.slice(2 * BN, 2 * BN, dim=0).permute((1, 0)), qk, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            # each warpgroup's own 16 columns, then the two halves' sum (one exchange through shared memory)
            # (the column halves are one thread's registers: adding the other half's zero is exact and local)
            x_smem.store(gl.sum(gl.reshape(gl.where(own, qk, 0.0), [2 * PAGE, 2, BN]), axis=1))
            cta_barrier()
            scores = x_smem.slice(0, PAGE, dim=0).load(sm_l) + x_smem.slice(PAGE, PAGE, dim=0).load(sm_l)

            rescale, m_i, l_i, pi_i, pi_max = page_p_smem(scores, s_cur, coef, base + offs_t, limit, m_i, l_i, pi_i,
                                                           pi_max, zero_sm, p_smem, P_DIV)
            cta_barrier()
            # O^T [R, BN] += C^T P^T, a pair of boxes at a time: warpgroup h multiplies boxes h and 2 + h
            beta = gl.expand_dims(gl.convert_layout(rescale, row_l), 0)
            pt = p_smem.permute((1, 0))
            acc_a = warpgroup_mma(_pv_pair(page_smem, 0, a_pv), pt, acc_a * beta, is_async=True)
            a16 = _pv_pair(page_smem, 2, a_pv)
            acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
            acc_b = warpgroup_mma(a16, pt, acc_b * beta, is_async=True)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
            cta_barrier()  # every warp's reads of this slot (and of P) are done: the slot may be refilled
            s_cur = s_next

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        m_o = gl.convert_layout(m_i, row_l)
        l_o = gl.convert_layout(l_i, row_l)
        pi_o = gl.convert_layout(pi_i, row_l)
        store_result(acc_a, m_o, l_o, pi_o, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om,
                      stride_os, stride_lb, stride_lm, stride_ls, 2 * BOXW, LSE_NATURAL, ch_l, AX=1, CH0=0,
                      STORE_LSE=True, PV_PERM=2)
        store_result(acc_b, m_o, l_o, pi_o, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om,
                      stride_os, stride_lb, stride_lm, stride_ls, 2 * BOXW, LSE_NATURAL, ch_l, AX=1, CH0=2 * BOXW,
                      STORE_LSE=False, PV_PERM=2)
