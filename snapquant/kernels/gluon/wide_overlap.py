"""`gluon.wide`'s 64-row page loop for the bf16 layout with the next page's scores overlapping this page's PV
(Gluon, Hopper only; opt-in: `tile="gluon", overlap=True`).

`gluon.wide` runs each page as one dependent chain on both warpgroups: QK, wait, softmax, PV, wait, barrier;
the tensor cores idle during the softmax and the CUDA cores during the MMAs (docs/performance.md, H1: the FP8
and BF16 wide kernels at 14-60 % of DRAM and 28-43 % of SM throughput, `wait` + `gmma` + `barrier` ~40 % of
warp states). Here iteration `it` issues page it + 1's QK first and page it's PV after it, both asynchronous;
wgmma groups complete in order, so waiting for all but the last group returns the next page's scores while
the PV still runs, and the softmax of page it + 1 (its P, its rescale, the running max and sum) is computed
under it. Every wait stays inside its iteration (a wait deferred across the loop makes ptxas serialize every
wgmma); what crosses the loop is plain registers: the next page's P and its accumulator rescale.

The arithmetic is `gluon.wide`'s bf16 branch, page by page in the same order (P = bf16(e), the same running
max, sum and rescales), so the output is the same up to fp32 summation order inside the MMAs. On a run's last
page the overlapped QK reads the other slot's stale contents; its softmax is discarded (the running max and
sum are kept only where a next page exists). Same layouts, shared memory (~220 KB: two 72 KB slots, the query)
and grid as `gluon.wide`: one 8-warp program per SM.
"""

from __future__ import annotations

from ..layouts import GLUON_WIDE_ROWS
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
        cta_barrier,
        issue_tile_page,
        page_p16,
        query_operands,
        row_state,
        split_run,
        store_rows,
        zero_tail_rows,
    )

    BM_ROWS = gl.constexpr(GLUON_WIDE_ROWS)

    @gluon.jit
    def _scores(q_smem, qr_smem, tile, rope, zero_s):
        """S [BM, PAGE] = Q C^T + Q_r R^T of one slot, issued asynchronously (two wgmma groups)."""
        qk = warpgroup_mma(q_smem, tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return warpgroup_mma(qr_smem, rope.permute((1, 0)), qk, is_async=True)

    @gluon.jit
    def _bf16_decode_gluon_wide_overlap(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
    ):
        gl.static_assert(num_warps == 8)
        BM: gl.constexpr = BM_ROWS  # query rows (wgmma M)
        STAGES: gl.constexpr = 2
        BOXW: gl.constexpr = 64  # bf16 channels per TMA box
        NBOX: gl.constexpr = R // BOXW

        # gluon.wide's layouts: the two warpgroups split N (S: tokens, O: channels); P is O's A operand
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, PAGE // 2, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, R // 2, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        sm_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        srow_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        z_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        row0 = gl.program_id(0) * BM
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)

        tile_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, R], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R], gl.bfloat16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        stash = gl.allocate_shared_memory(gl.float32, [2, BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)

        # ---- prologue: pages 0 and 1 in flight, then page 0's scores and softmax
        bt_row = BT + b64 * stride_bt + p_lo
        for s in gl.static_range(STAGES):
            page = gl.load(bt_row + s, mask=s < n_run, other=0).to(gl.int64)
            issue_tile_page(lat_desc, rope_desc, tile_smem, tile_smem, rope_smem, bars, s, page, lat_page_rows,
                            rope_page_rows, s < n_run, False, NBOX, BOXW)
        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BM, False,
                                q_l, False)  # bf16 query, sigma = 1
        limit, coef, m_i, l_i, pi_i, _ = row_state(length, row0, sigma, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        acc = gl.zeros([BM, R], gl.float32, o_l)
        zero_s = gl.zeros([BM, PAGE], gl.float32, s_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)

        mbarrier.wait(bars.index(0), 0, pred=n_run > 0)
        if (n_run > 0) & (p_lo * PAGE + PAGE > length):  # a last page's tail tokens -> 0 (0 x NaN is NaN)
            zero_tail_rows(tile_smem.index(0), p_lo * PAGE, length, R, PAGE, z_l)
        fence_async_shared()
        cta_barrier()
        qk = _scores(q_smem, qr_smem, tile_smem.index(0), rope_smem.index(0), zero_s)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        p16, rescale, m_i, l_i = page_p16(gl.convert_layout(qk, sm_l), coef, p_lo * PAGE + offs_t, limit, m_i, l_i, 1)

        for it in range(n_run):
            slot = it % STAGES
            other = 1 - slot
            base = (p_lo + it) * PAGE
            has_next = it + 1 < n_run
            # page it + 1's scores first on the tensor cores (a stale slot's when there is none: discarded)
            mbarrier.wait(bars.index(other), ((it + 1) // STAGES) & 1, pred=has_next)
            if has_next & (base + 2 * PAGE > length):
                zero_tail_rows(tile_smem.index(other), base + PAGE, length, R, PAGE, z_l)
                fence_async_shared()
                cta_barrier()
            qk = _scores(q_smem, qr_smem, tile_smem.index(other), rope_smem.index(other), zero_s)
            # then page it's PV with its P from the last iteration: O [BM, R] = O * beta + P C
            beta = gl.expand_dims(gl.convert_layout(rescale, gl.SliceLayout(1, o_l)), 1)
            acc = warpgroup_mma(gl.convert_layout(p16, p_l), tile_smem.index(slot), acc * beta, is_async=True)
            # groups complete in order: the scores are ready while the PV still runs
            qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
            p16, rescale, m_n, l_n = page_p16(gl.convert_layout(qk, sm_l), coef, base + PAGE + offs_t, limit, m_i,
                                              l_i, 1)
            # ptxas sinks the softmax below the PV's wait unless something ordered before that wait needs it: a
            # shared-memory store of the new running max and sum (never read back) pins it there
            stash.index(0).store(m_n)
            stash.index(1).store(l_n)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            m_i = gl.where(has_next, m_n, m_i)
            l_i = gl.where(has_next, l_n, l_i)
            cta_barrier()  # both warpgroups are done with this slot: refill it with page it + 2
            page_after = gl.load(bt_row + it + 2, mask=it + 2 < n_run, other=0).to(gl.int64)
            issue_tile_page(lat_desc, rope_desc, tile_smem, tile_smem, rope_smem, bars, slot, page_after,
                            lat_page_rows, rope_page_rows, it + 2 < n_run, False, NBOX, BOXW)

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        store_rows(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                    stride_lb, stride_lm, stride_ls, R, LSE_NATURAL, BM, o_l)
