"""The 32-row decode page loop with native FP8 MMAs, two programs per SM (opt-in `fp8_mma=True`; Gluon, Hopper).

`wide8.py` runs 64 query rows per program on 8 warps; its 128-register accumulator and 131 KB of shared
memory leave room for one program per SM, so the per-page chain (QK MMAs, the softmax and P
quantization, PV MMAs) runs with nothing beside it. Here one warpgroup runs 32 rows, and both products
are swapped so that the 32 rows are wgmma's N:

  * S^T [64 tokens, 32 rows] = C Q^T: A = the page's e4m3 TMA boxes as they landed (K-major), B = q^T
    (e4m3, [32, 512] in shared memory), in two fp32 chains (boxes 0-1 and 2-3); RoPE a bf16 MMA;
  * the softmax with a warp per 8 rows (`native8.page_p_native`, tokens along axis 0), P^ as
    [rows, tokens] into shared memory: the K-major B operand P^T;
  * O^T [512, 32] += V^T P^T in two accumulators of 256 channels (a pair of boxes each, 64 registers),
    V^T from registers as in `wide8` (`native8.vt_operand`: 8-byte loads through a transposed view of
    the pair of boxes, one 4 x 4 byte transpose per four registers), each half's operand loaded while
    the other half's MMA runs;
  * the block-table index of the page after next is loaded a page early (`native8.page_start` with
    AHEAD), so the next page's scale loads do not wait on it.

Per program ~110 KB of shared memory (two 40 KB slots, the e4m3 query, P^, the softmax's conversion)
and 128 threads: two programs share an SM and run each other's MMAs under their softmax. Each page is
read by both row halves of a 64-row head group (the second read mostly from L2). Numerics as `wide8`
(FP8 accumulation inside the MMA).
"""

from __future__ import annotations

from ..box_views import slot_view_bases, v_load_bases, vt_store_bases
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

    from ..common import cta_barrier, query_operands, row_state, split_run
    from .native8 import (
        fewest_visible,
        issue_slot,
        native8_smem,
        page_p_native,
        page_start,
        store_vt,
        vt_operand,
    )

    # a pair of boxes (256 channels, 16 KB) read as V^T [256 m, 64 tokens] for 4 warps along M
    # (box_views.pv8_channel with two warp bits), rows m bits 3, 6 and tokens bits 0, 1 traded
    PAIR_VIEW_T = gl.constexpr(gl.SharedLinearLayout(offset_bases=slot_view_bases(True, 2, 2)))
    # wgmma's e4m3 A-operand layout for [256, 64] with 4 warps, registers reordered as wide8.V_LOAD
    V_LOAD4 = gl.constexpr(gl.DistributedLinearLayout(*v_load_bases(2), block_bases=[], shape=[256, 64]))
    # a half accumulator [256, 32] in physical channel order, each thread's 8 contiguous channels first
    VT_STORE4 = gl.constexpr(gl.DistributedLinearLayout(*vt_store_bases(2, 32), block_bases=[], shape=[256, 32]))
    VT_STORE4_16 = gl.constexpr(gl.DistributedLinearLayout(*vt_store_bases(2, 16), block_bases=[], shape=[256, 16]))


if HAVE_GLUON:

    @gluon.jit
    def _mla_decode_gluon_narrow8(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        STAGES: gl.constexpr = 2, BN: gl.constexpr = 32,
    ):
        gl.static_assert(num_warps == 4)
        gl.static_assert(R == 512)
        gl.static_assert(PAGE == 64)
        gl.static_assert(BN == 32 or BN == 16)  # query rows (wgmma N): past 16 rows, or at most 16
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW
        HALF: gl.constexpr = 256

        s8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
        if BN == 32:
            sm_l: gl.constexpr = gl.BlockedLayout([16, 1], [4, 8], [1, num_warps], [0, 1])  # a warp owns 8 rows
            st_l: gl.constexpr = VT_STORE4
        else:
            sm_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])  # a warp owns 4 rows
            st_l: gl.constexpr = VT_STORE4_16
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        orow_l: gl.constexpr = gl.SliceLayout(0, o_l)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        row0 = gl.program_id(0) * BN
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)

        bt_row = BT + b64 * stride_bt + p_lo
        lat4, rope_smem, q_smem, qr_smem, p_smem, bars = native8_smem(
            lat_desc, rope_desc, bt_row, n_run, lat_page_rows, rope_page_rows, STAGES, NBOX, BOXW, PAGE, BN, R, D)

        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN, True,
                                q_l, True, False, True)
        limit, coef, m_i, l_i, pi_i, pi_max = row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
        lim_min = fewest_visible(limit, row0, S * H, BN, srow_l)
        acc_a = gl.zeros([HALF, BN], gl.float32, o_l)  # O^T of boxes 0-1, rows in pv8_channel(m, 2) order
        acc_b = gl.zeros([HALF, BN], gl.float32, o_l)  # boxes 2-3
        zero_s = gl.zeros([PAGE, BN], gl.float32, s_l)
        zero_s8 = gl.zeros([PAGE, BN], gl.float32, s8_l)
        zero_sm = gl.zeros([PAGE, BN], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        fence_async_shared()
        cta_barrier()

        s_cur = gl.load(SCALE + gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64) * stride_sp
                        + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        after = gl.load(bt_row + 1, mask=n_run > 1, other=0).to(gl.int64)  # the next page's block-table index
        for it in range(n_run):
            slot, base, page_refill, s_next, after = page_start(lat4, bars, bt_row, SCALE, it, p_lo, n_run, length,
                                                                 offs_t, stride_sp, stride_st, STAGES, NBOX, PAGE,
                                                                 cvt_l, after, True)
            page_smem = lat4.index(slot)

            # scores^T [PAGE, BN]: the boxes as they landed (A) times q^T (B), two fp32 chains, + RoPE
            KC: gl.constexpr = R // 2
            k0 = warpgroup_mma(page_smem.slice(0, PAGE, dim=0), q_smem.slice(0, BOXW, dim=1).permute((1, 0)),
                               zero_s8, use_acc=False, is_async=True)
            for k in gl.static_range(1, KC // BOXW):
                k0 = warpgroup_mma(page_smem.slice(k * PAGE, PAGE, dim=0),
                                   q_smem.slice(k * BOXW, BOXW, dim=1).permute((1, 0)), k0, is_async=True)
            rd = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            k1 = warpgroup_mma(page_smem.slice((KC // BOXW) * PAGE, PAGE, dim=0),
                               q_smem.slice(KC, BOXW, dim=1).permute((1, 0)), zero_s8, use_acc=False,
                               is_async=True)
            for k in gl.static_range(KC // BOXW + 1, NBOX):
                k1 = warpgroup_mma(page_smem.slice(k * PAGE, PAGE, dim=0),
                                   q_smem.slice(k * BOXW, BOXW, dim=1).permute((1, 0)), k1, is_async=True)
            k0, k1, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, rd))
            qk = gl.convert_layout(k0 + k1, s_l) + rd  # the same registers (no data movement)

            raw = gl.convert_layout(qk, sm_l)
            p8, rescale, m_i, l_i, pi_i, pi_max = page_p_native(raw, s_cur, coef, base + offs_t, limit, m_i, l_i,
                                                                 pi_i, pi_max, zero_sm, base + PAGE <= lim_min,
                                                                 P_DIV, 0)
            s_cur = s_next
            p_smem.store(gl.permute(p8, [1, 0]))  # P^ [rows, tokens]: the K-major B operand P^T
            fence_async_shared()
            cta_barrier()
            beta = gl.expand_dims(gl.convert_layout(rescale, orow_l), 0)
            pt = p_smem.permute((1, 0))
            # V^T of boxes 0-1, then of boxes 2-3 while the tensor cores run the first half
            acc_a = warpgroup_mma(vt_operand(page_smem.slice(0, 2 * PAGE, dim=0), PAIR_VIEW_T, V_LOAD4, HALF, PAGE,
                                              a_o), pt, acc_a * beta, is_async=True)
            vt_b = vt_operand(page_smem.slice(2 * PAGE, 2 * PAGE, dim=0), PAIR_VIEW_T, V_LOAD4, HALF, PAGE, a_o)
            if STAGES == 1:
                # one slot (16-row programs, three per SM): V^T is in registers, so once every warp is here the
                # slot is read and the next page is asked for under PV's MMAs
                cta_barrier()
                issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, slot, page_refill, lat_page_rows,
                            rope_page_rows, it + STAGES < n_run, NBOX, BOXW, PAGE)
            acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
            acc_b = warpgroup_mma(vt_b, pt, acc_b * beta, is_async=True)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
            cta_barrier()  # every warp has read the slot (QK, V^T) and P^: refill the slot
            if STAGES > 1:
                issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, slot, page_refill, lat_page_rows,
                            rope_page_rows, it + STAGES < n_run, NBOX, BOXW, PAGE)

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        store_vt(acc_a, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL, BN, o_l, 4, st_l, 0, True)
        store_vt(acc_b, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL, BN, o_l, 4, st_l, HALF, False)
