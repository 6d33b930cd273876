"""The 32-row native FP8 page loop on 8 warps, two programs per SM (Gluon, Hopper only; a probe).

`gluon_narrow8` runs 32 query rows on one warpgroup, two programs per SM. Its in-kernel trace
(`scripts/trace_native8.py`, docs/perf-notes.md 25) says a page is a chain of waits, not of work: alone
on an SM a page takes ~3600 cycles for ~1100 instructions per warp, and two programs per SM (8 warps)
bring it to ~2650 cycles per program-page, 41 % of the SM's issue rate. Here the same 32 rows run on
two warpgroups, so an SM holds 16 warps and each warp's chain per page is about half as long:

  * QK, swapped as in `gluon_narrow8`: S^T [64 tokens, 32 rows], each warpgroup 16 rows (wgmma N = 16),
    both reading the page's boxes (A) in full; two fp32 chains summed, RoPE a bf16 MMA;
  * the softmax with a warp per 4 rows (8 tokens per thread);
  * PV as `gluon_wide8`: O^T [512, 32] += V^T P^T, 8 warps along the channels, V^T from registers
    through the transposed slot view: 64 accumulator registers per thread instead of 128.

The same arithmetic per dot product as `gluon_narrow8` (the same MMA shapes along K, the same chains, the
same softmax): bit-identical results are the test. Two programs per SM need at most 128 registers per
thread (the launch's maxnreg). FAST and AHEAD as in `gluon_narrow8`.
"""

from __future__ import annotations

from .box_views import vt_store_bases
from .gluon_decode import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_decode import (
        _fewest_visible,
        _page_p_native,
        _query_operands,
        _row_state,
        _split_run,
        cta_barrier,
    )
    from .gluon_wide8 import (
        SLOT_VIEW_T,
        V_LOAD,
        _issue_slot,
        _native8_smem,
        _page_start,
        _store_vt,
        _vt_operand,
    )

    # O^T [512, 32] in physical channel order, each thread's 8 contiguous channels of a row first
    VT_STORE32 = gl.constexpr(gl.DistributedLinearLayout(*vt_store_bases(3, 32), block_bases=[], shape=[512, 32]))

    @gluon.jit
    def _mla_decode_gluon_narrow8w(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        STAGES: gl.constexpr = 2, CHAINS: gl.constexpr = 2, ABLATE: gl.constexpr = 0,
        FAST: gl.constexpr = False, AHEAD: gl.constexpr = False,
    ):
        gl.static_assert(num_warps == 8)
        gl.static_assert(R == 512)
        gl.static_assert(PAGE == 64)
        gl.static_assert(CHAINS == 2)
        BN: gl.constexpr = 32  # query rows (wgmma N, 16 per warpgroup in QK)
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW

        s8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BN // 2, 32])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BN // 2, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 32])
        a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
        sm_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])  # a warp owns 4 rows
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        orow_l: gl.constexpr = gl.SliceLayout(0, o_l)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        row0 = gl.program_id(0) * BN
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = _split_run(LENS, b, split, NSPLIT, PAGE)

        NO_TMA: gl.constexpr = ABLATE & 16 != 0
        bt_row = BT + b64 * stride_bt + p_lo
        lat4, rope_smem, q_smem, qr_smem, p_smem, bars = _native8_smem(
            lat_desc, rope_desc, bt_row, n_run, lat_page_rows, rope_page_rows, STAGES, NBOX, BOXW, PAGE, BN, R, D,
            NO_TMA)

        sigma = _query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN, True,
                                q_l, True, False, FAST)
        limit, coef, m_i, l_i, pi_i, pi_max = _row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
        lim_min = _fewest_visible(limit, row0, S * H, BN, srow_l)  # (FAST)
        acc = gl.zeros([R, BN], gl.float32, o_l)  # O^T, rows in pv8_channel order
        zero_s = gl.zeros([PAGE, BN], gl.float32, s_l)
        zero_s8 = gl.zeros([PAGE, BN], gl.float32, s8_l)
        zero_sm = gl.zeros([PAGE, BN], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        fence_async_shared()
        cta_barrier()

        s_cur = gl.load(SCALE + gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64) * stride_sp
                        + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        after = gl.load(bt_row + 1, mask=n_run > 1, other=0).to(gl.int64)  # (AHEAD) the next page's index
        for it in range(n_run):
            slot, base, page_refill, s_next, after = _page_start(lat4, bars, bt_row, SCALE, it, p_lo, n_run, length,
                                                                 offs_t, stride_sp, stride_st, STAGES, NBOX, PAGE,
                                                                 NO_TMA, cvt_l, after, AHEAD)
            page_smem = lat4.index(slot)

            # scores^T [PAGE, BN]: the boxes as they landed (A) times q^T (B), two fp32 chains, + RoPE
            if ABLATE & 2:  # (timing probes only: wrong results)
                qk = zero_s + it
            else:
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
            if ABLATE & 8:
                p8 = raw.to(gl.float8e4nv)
                rescale = gl.full([BN], 1.0, gl.float32, srow_l)
            else:
                p8, rescale, m_i, l_i, pi_i, pi_max = _page_p_native(raw, s_cur, coef, base + offs_t, limit, m_i, l_i,
                                                                     pi_i, pi_max, zero_sm, base + PAGE <= lim_min,
                                                                     P_DIV, 0, FAST)
            s_cur = s_next
            p_smem.store(gl.permute(p8, [1, 0]))  # P^ [rows, tokens]: the K-major B operand P^T
            fence_async_shared()
            cta_barrier()
            beta = gl.expand_dims(gl.convert_layout(rescale, orow_l), 0)
            if ABLATE & 4:
                acc = acc * beta
            else:
                vt = _vt_operand(page_smem, SLOT_VIEW_T, V_LOAD, R, PAGE, a_o, ABLATE)
                acc = warpgroup_mma(vt, p_smem.permute((1, 0)), acc * beta, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            cta_barrier()  # every warp has read the slot (QK, V^T) and P^: refill the slot
            _issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, slot, page_refill, lat_page_rows, rope_page_rows,
                        (it + STAGES < n_run) & (not NO_TMA), NBOX, BOXW, PAGE)

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        _store_vt(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL, BN, o_l, 8, VT_STORE32)
