"""The bf16 layout past 16 query rows with two warpgroups in different roles (warp specialization), Hopper only.

`wide.py` runs QK, the softmax and PV of a page as one chain on 8 warps that all wait for each step: the
tensor cores idle during the softmax and the CUDA cores during the MMAs (docs/performance.md, H1). Here the
two warpgroups take alternate pages and split the output channels (the "seesaw" schedule of FlashMLA's
Hopper kernel, written again in Gluon):

  * warpgroup k (k = 0: Gluon's default partition, k = 1: a worker partition of 4 warps) owns the pages of
    ring slot k (a run's pages k, k + 2, ...): it computes their scores S = Q C^T + Q_r R^T (the whole 64 x 64
    tile), their online softmax and P = bf16(e), and hands P and the row state (alpha, m, l) to the other
    warpgroup through shared memory and an mbarrier;
  * each warpgroup keeps half of O (output channels 256 k .. 256 k + 255, 128 fp32 registers per thread)
    and runs the PV product of every page on its half: its own pages with P in registers, the other's with
    P from shared memory;
  * so one warpgroup's softmax runs while the other's MMAs keep the tensor cores busy. The softmax of page
    j needs the running max after page j - 1 (the other warpgroup's): that scalar chain stays serial, and
    the arithmetic is the reference's page by page (O = O alpha_j + P_j C_j in page order on both halves);
  * a page slot is refilled in halves: warpgroup k asks the TMA unit for its channel half of page j + 2
    (warpgroup 1 also for the RoPE rows) as soon as its PV of page j is done, and a page's QK waits for
    each half separately (FlashMLA's per-tile barriers, coarser).

Shared memory: two slots of [64, 512] latent + [64, 64] RoPE bf16 (144 KB), the query's latent part
(64 KB) and two P hand-over tiles (8 KB each); the query's RoPE part lives in registers (it first passes
through P tile 1), which is what makes the total fit one SM (224 KB).

Arithmetic: the 16-bit branch of `triton/decode.py`'s `_page_weights` (`common.page_p16`), as `wide.py`;
the softmax reductions run in the QK accumulator's own layout (4 lanes per row), so sums may differ from
`wide.py`'s in fp32 summation order.
"""

from __future__ import annotations

from ..layouts import GLUON_WIDE_ROWS
from .common import HAVE_GLUON

BM = GLUON_WIDE_ROWS  # query rows per program (wgmma M)
WORKER_REGS = 256  # registers per thread of warpgroup 1: all it can have (two warpgroups of 256 fill the register file)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .common import page_p16, query_operands, row_state, split_run, store_result, tma_load, zero_tail_rows

    BM_ROWS = gl.constexpr(BM)
    WORKER_REGS_C = gl.constexpr(WORKER_REGS)


if HAVE_GLUON:

    @gluon.jit
    def _issue_half(lat_desc, rope_desc, tile_smem, rope_smem, ready, slot, page, lat_page_rows, rope_page_rows,
                    K: gl.constexpr, HALF: gl.constexpr):
        """Warpgroup K's half of a page into ring slot `slot`: the latent channels HALF K .. HALF (K + 1) - 1
        in 64-channel boxes (and, for K = 1, the RoPE rows), counted in by barrier ready[slot, K]."""
        NB: gl.constexpr = HALF // 64
        bar = ready.index(2 * slot + K)
        lat_row = (page * lat_page_rows).to(gl.int32)
        mbarrier.expect(bar, NB * lat_desc.block_type.nbytes + K * rope_desc.block_type.nbytes)
        tile = tile_smem.index(slot)
        for c in gl.static_range(NB):
            tma_load(lat_desc, [lat_row, K * HALF + c * 64], bar, tile.slice(K * HALF + c * 64, 64, dim=1))
        if K == 1:
            tma_load(rope_desc, [(page * rope_page_rows).to(gl.int32), 0], bar, rope_smem.index(slot))

    @gluon.jit
    def _seesaw_warpgroup(a, S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                          CAUSAL: gl.constexpr, LSE_NATURAL: gl.constexpr, K: gl.constexpr):
        """Warpgroup K's whole run (see the module docstring): its pages' QK and softmax, PV of every page on
        its half of the output channels, its half of the epilogue. `a`: the kernel's operands (a tuple: a
        worker partition takes no tensors, only descriptors and scalars)."""
        (lat_desc, rope_desc, tile_smem, rope_smem, q_smem, p_smem, stat_smem, ready, pub, BT, LENS, O_PART, LSE_PART,
         sm_scale_log2, lat_page_rows, rope_page_rows, stride_bt, stride_ob, stride_om, stride_os, stride_lb, stride_lm,
         stride_ls, H, NSPLIT) = a
        BM: gl.constexpr = BM_ROWS
        HALF: gl.constexpr = R // 2
        OTHER: gl.constexpr = 1 - K
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PAGE, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        qr_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
        srow_l: gl.constexpr = gl.SliceLayout(1, s_l)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_l)
        z_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])

        row0 = gl.program_id(0) * BM
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)
        bt_row = BT + b64 * stride_bt + p_lo

        # the run's first two pages, this warpgroup's half of each
        for s in gl.static_range(2):
            if s < n_run:
                page = gl.load(bt_row + s).to(gl.int64)
                _issue_half(lat_desc, rope_desc, tile_smem, rope_smem, ready, s, page, lat_page_rows, rope_page_rows,
                            K, HALF)
        # the query's RoPE part (stored in P tile 1 by the prologue) -> registers, before P tile 1 is reused
        qr = p_smem.index(1).load(qr_l)

        ones = gl.full([BM], 1.0, gl.float32, srow_l)
        limit, coef, m_i, l_i, pi_i, _ = row_state(length, row0, ones, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        acc = gl.zeros([BM, HALF], gl.float32, o_l)
        zero_s = gl.zeros([BM, PAGE], gl.float32, s_l)
        offs_t = gl.arange(0, PAGE, layout=gl.SliceLayout(0, s_l))
        q_lo = q_smem.slice(0, HALF, dim=1)
        q_hi = q_smem.slice(HALF, HALF, dim=1)

        n_own = (n_run - K + 1) // 2
        for t in range(n_own):
            j = K + 2 * t  # this warpgroup's page (slot K), its t-th
            base = (p_lo + j) * PAGE
            tile = tile_smem.index(K)
            # 1. QK of page j, each half as soon as it has arrived
            mbarrier.wait(ready.index(2 * K), t & 1)
            qk_t = warpgroup_mma(q_lo, tile.slice(0, HALF, dim=1).permute((1, 0)), zero_s, use_acc=False,
                                 is_async=True)
            mbarrier.wait(ready.index(2 * K + 1), t & 1)
            qk_t = warpgroup_mma(q_hi, tile.slice(HALF, HALF, dim=1).permute((1, 0)), qk_t, is_async=True)
            qk_t = warpgroup_mma(qr, rope_smem.index(K).permute((1, 0)), qk_t, is_async=True)
            # 2. PV of the other warpgroup's page j - 1 (slot OTHER) on this half, behind this page's QK; then
            # the softmax of page j, which needs the other's running max and sum after page j - 1
            if j >= 1:
                t_o = t - 1 + K  # page j - 1 is the other warpgroup's t_o-th
                mbarrier.wait(pub.index(OTHER), t_o & 1)
                mbarrier.wait(ready.index(2 * OTHER + K), t_o & 1)
                alpha_o = stat_smem.slice((3 * OTHER) * BM, BM).load(orow_l)
                m_o = stat_smem.slice((3 * OTHER + 1) * BM, BM).load(srow_l)
                l_o = stat_smem.slice((3 * OTHER + 2) * BM, BM).load(srow_l)
                acc = warpgroup_mma(p_smem.index(OTHER), tile_smem.index(OTHER).slice(K * HALF, HALF, dim=1),
                                    acc * gl.expand_dims(alpha_o, 1), is_async=True)
                qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk_t,))
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                # the other's page is done on this half: P tile OTHER is free, and this half of its slot takes
                # page j + 1 now (before the softmax: the other warpgroup's next QK waits for it)
                if j + 1 < n_run:
                    page = gl.load(bt_row + j + 1).to(gl.int64)
                    _issue_half(lat_desc, rope_desc, tile_smem, rope_smem, ready, OTHER, page, lat_page_rows,
                                rope_page_rows, K, HALF)
                p16, alpha, m_i, l_i = page_p16(qk, coef, base + offs_t, limit, m_o, l_o, 1)
            else:
                qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk_t,))
                p16, alpha, m_i, l_i = page_p16(qk, coef, base + offs_t, limit, m_i, l_i, 1)
            # 3. hand P and the row state to the other warpgroup
            p_smem.index(K).store(p16)
            stat_smem.slice((3 * K) * BM, BM).store(alpha)
            stat_smem.slice((3 * K + 1) * BM, BM).store(m_i)
            stat_smem.slice((3 * K + 2) * BM, BM).store(l_i)
            fence_async_shared()
            mbarrier.arrive(pub.index(K), count=1)
            # 4. PV of page j on this half (P from registers); a last page's tail tokens -> 0 first (0 x NaN)
            if base + PAGE > length:
                zero_tail_rows(tile.slice(K * HALF, HALF, dim=1), base, length, HALF, PAGE, z_l)
                fence_async_shared()
            alpha_c = gl.expand_dims(gl.convert_layout(alpha, orow_l), 1)
            acc = warpgroup_mma(gl.convert_layout(p16, p_l), tile.slice(K * HALF, HALF, dim=1), acc * alpha_c,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # 5. this half of slot K is free: page j + 2's half in flight
            if j + 2 < n_run:
                page = gl.load(bt_row + j + 2).to(gl.int64)
                _issue_half(lat_desc, rope_desc, tile_smem, rope_smem, ready, K, page, lat_page_rows, rope_page_rows,
                            K, HALF)

        # the run's last page, when it is the other warpgroup's: its PV on this half
        j = n_run - 1
        if (n_run > 0) & ((j % 2) != K):
            t_o = j // 2
            mbarrier.wait(pub.index(OTHER), t_o & 1)
            mbarrier.wait(ready.index(2 * OTHER + K), t_o & 1)
            alpha_o = stat_smem.slice((3 * OTHER) * BM, BM).load(orow_l)
            m_i = stat_smem.slice((3 * OTHER + 1) * BM, BM).load(srow_l)
            l_i = stat_smem.slice((3 * OTHER + 2) * BM, BM).load(srow_l)
            base = (p_lo + j) * PAGE
            half = tile_smem.index(OTHER).slice(K * HALF, HALF, dim=1)
            if base + PAGE > length:
                zero_tail_rows(half, base, length, HALF, PAGE, z_l)
                fence_async_shared()
            acc = warpgroup_mma(p_smem.index(OTHER), half, acc * gl.expand_dims(alpha_o, 1), is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        rows = row0 + gl.arange(0, BM, layout=orow_l)
        store_result(acc, gl.convert_layout(m_i, orow_l), gl.convert_layout(l_i, orow_l),
                     gl.convert_layout(pi_i, orow_l), O_PART, LSE_PART, b64, split, rows, rows < S * H,
                     stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls, HALF, LSE_NATURAL,
                     gl.SliceLayout(0, o_l), 0, K * HALF, K == 0)

    @gluon.jit
    def _seesaw_default(a, S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                        CAUSAL: gl.constexpr, LSE_NATURAL: gl.constexpr):
        _seesaw_warpgroup(a, S, R, D, PAGE, CAUSAL, LSE_NATURAL, 0)

    @gluon.jit
    def _seesaw_worker(a, S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                       CAUSAL: gl.constexpr, LSE_NATURAL: gl.constexpr):
        _seesaw_warpgroup(a, S, R, D, PAGE, CAUSAL, LSE_NATURAL, 1)

    @gluon.jit
    def _bf16_decode_gluon_seesaw(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr,
        P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
    ):
        gl.static_assert(num_warps == 4)  # the default partition: warpgroup 0; warpgroup 1 is a worker
        gl.static_assert(R == 512)
        gl.static_assert(D == 64)  # the query's RoPE part passes through a [64, 64] P tile
        BM: gl.constexpr = BM_ROWS
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        tile_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, R], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R],
                                                                                                       gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BM, PAGE],
                                           gl.NVMMASharedLayout.get_default_for([BM, PAGE], gl.bfloat16))
        stat_smem = gl.allocate_shared_memory(gl.float32, [8 * BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # [slot, half]
        pub = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # P of warpgroup k's page
        for i in gl.static_range(4):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(pub.index(i), count=1)

        b64 = gl.program_id(1).to(gl.int64)
        query_operands(Q, q_smem, p_smem.index(1), b64, gl.program_id(0) * BM, stride_qb, stride_qs, stride_qh, H, S,
                       R, D, BM, False, q_l, False)
        fence_async_shared()

        args = (lat_desc, rope_desc, tile_smem, rope_smem, q_smem, p_smem, stat_smem, ready, pub, BT, LENS, O_PART,
                LSE_PART, sm_scale_log2, lat_page_rows, rope_page_rows, stride_bt, stride_ob, stride_om, stride_os,
                stride_lb, stride_lm, stride_ls, H, NSPLIT)
        gl.warp_specialize([(_seesaw_default, (args, S, R, D, PAGE, CAUSAL, LSE_NATURAL)),
                            (_seesaw_worker, (args, S, R, D, PAGE, CAUSAL, LSE_NATURAL))], [4], [WORKER_REGS_C])
