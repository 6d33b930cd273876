"""The bf16 layout past 16 query rows with two warpgroups in different roles (warp specialization), Hopper only.

`wide.py` runs QK, the softmax and PV of a page as one chain on 8 warps that all wait for each step: the
tensor cores idle during the softmax and the CUDA cores during the MMAs (docs/performance.md, H1). Here the
two warpgroups work on a pair of pages at a time, in lockstep (the schedule of FlashMLA's Hopper kernel,
written again in Gluon; docs/kernels.md):

  * ring slot s holds the run's pages of parity s (pages 2i and 2i + 1 form pair i); warpgroup 0 (Gluon's
    default partition) computes the scores and softmax of the even page, warpgroup 1 (a worker partition of
    4 warps) those of the odd page, and each keeps half of O (output channels 256 k .. 256 k + 255);
  * per pair: warpgroup 0's softmax of page b publishes P_b = bf16(e) and the row state; warpgroup 1's
    softmax of page b + 1 starts from it (the running max is the one serial chain) while warpgroup 0 runs
    P_b V_b on its half; then each warpgroup multiplies the other's P by its half of the other's page, and
    warpgroup 0 starts the QK of page b + 2 while warpgroup 1 starts that of page b + 3;
  * every 64-channel box of a slot (8 latent boxes and the RoPE rows) has its own TMA barrier: a QK starts
    on the first boxes that land, beginning with the ones its own warpgroup asked for; a box is asked for
    again by its last reader (latent boxes 0-3 by warpgroup 0 after its PV on them, boxes 4-7 and the RoPE
    rows by warpgroup 1), so both slots' next pages are in flight during most of a pair;
  * the arithmetic is the reference's page by page on both halves: O = O alpha_j + P_j C_j in page order,
    P_j = bf16(e_j) rounded once (the 16-bit branch of `triton/decode.py`'s `_page_weights`,
    `common.page_p16`); a warpgroup's two PVs of a pair run one after the other because O is rescaled by
    alpha between them. Sums may differ from `wide.py`'s in fp32 summation order (the softmax reductions
    run in the QK accumulator's own layout, and QK adds its boxes in a different order).

Shared memory: two slots of [64, 512] latent + [64, 64] RoPE bf16 (144 KB), the query's latent part
(64 KB) and two P hand-over tiles (8 KB each); the query's RoPE part lives in registers (it first passes
through P tile 1), which is what makes the total fit one SM.
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

    from .common import page_p16, query_operands, row_state, split_run, store_rows, tma_load, zero_tail_rows

    BM_ROWS = gl.constexpr(BM)
    WORKER_REGS_C = gl.constexpr(WORKER_REGS)


if HAVE_GLUON:

    @gluon.jit
    def _issue_boxes(lat_desc, rope_desc, tile_smem, rope_smem, ready, SLOT: gl.constexpr, page, lat_page_rows,
                     rope_page_rows, C0: gl.constexpr, C1: gl.constexpr, ROPE: gl.constexpr, NB: gl.constexpr):
        """Latent boxes C0 .. C1 - 1 (64 channels each) of `page` into ring slot SLOT (and, with ROPE, its RoPE
        rows), each counted in by its own barrier ready[SLOT * (NB + 1) + box] (box NB: the RoPE rows)."""
        lat_row = (page * lat_page_rows).to(gl.int32)
        tile = tile_smem.index(SLOT)
        for c in gl.static_range(C0, C1):
            bar = ready.index(SLOT * (NB + 1) + c)
            mbarrier.expect(bar, lat_desc.block_type.nbytes)
            tma_load(lat_desc, [lat_row, c * 64], bar, tile.slice(c * 64, 64, dim=1))
        if ROPE:
            bar = ready.index(SLOT * (NB + 1) + NB)
            mbarrier.expect(bar, rope_desc.block_type.nbytes)
            tma_load(rope_desc, [(page * rope_page_rows).to(gl.int32), 0], bar, rope_smem.index(SLOT))

    @gluon.jit
    def _issue_part(lat_desc, rope_desc, tile_smem, rope_smem, ready, SLOT: gl.constexpr, bt_row, j, lat_page_rows,
                    rope_page_rows, K: gl.constexpr, NB: gl.constexpr):
        """Warpgroup K's part of the run's page j into slot SLOT: latent boxes 0 .. NB/2 - 1 for K = 0, the
        rest and the RoPE rows for K = 1 (the boxes whose last reader it is)."""
        page = gl.load(bt_row + j).to(gl.int64)
        _issue_boxes(lat_desc, rope_desc, tile_smem, rope_smem, ready, SLOT, page, lat_page_rows, rope_page_rows,
                     K * (NB // 2), (K + 1) * (NB // 2), K == 1, NB)

    @gluon.jit
    def _qk_box(q_smem, qr, tile, rope_smem, ready, SLOT: gl.constexpr, phase, qk, C: gl.constexpr,
                FIRST: gl.constexpr, NB: gl.constexpr):
        """qk (+)= the scores' part over box C of the page in slot SLOT (C = NB: the RoPE rows), once it landed."""
        mbarrier.wait(ready.index(SLOT * (NB + 1) + C), phase)
        if C == NB:
            qk = warpgroup_mma(qr, rope_smem.index(SLOT).permute((1, 0)), qk, use_acc=not FIRST, is_async=True)
        else:
            qk = warpgroup_mma(q_smem.slice(C * 64, 64, dim=1), tile.slice(C * 64, 64, dim=1).permute((1, 0)), qk,
                               use_acc=not FIRST, is_async=True)
        return qk

    @gluon.jit
    def _qk_page(q_all, qr, tile_smem, rope_smem, ready, SLOT: gl.constexpr, phase, zero, START: gl.constexpr,
                 NB: gl.constexpr, BM: gl.constexpr, PAGE: gl.constexpr, s_l: gl.constexpr):
        """S = Q C^T + Q_r R^T of the page in slot SLOT, one 64-channel box at a time in the order START,
        START + 1, ... (mod NB + 1; box NB is the RoPE part), each as soon as its own barrier says it landed."""
        tile = tile_smem.index(SLOT + zero)
        q_smem = q_all.index(zero)
        qk = gl.zeros([BM, PAGE], gl.float32, s_l)  # made here, so no zero tile is held across the page loop
        for i in gl.static_range(NB + 1):
            qk = _qk_box(q_smem, qr, tile, rope_smem, ready, SLOT, phase, qk, (START + i) % (NB + 1), i == 0, NB)
        return warpgroup_mma_wait(num_outstanding=0, deps=(qk,))

    @gluon.jit
    def _publish(p_smem, stat_smem, sig, p16, alpha, m_i, l_i, K: gl.constexpr, BM: gl.constexpr):
        """Warpgroup K's page: P into P tile K and (alpha, m, l) into its stats, then signal the other."""
        p_smem.index(K).store(p16)
        stat_smem.slice((3 * K) * BM, BM).store(alpha)
        stat_smem.slice((3 * K + 1) * BM, BM).store(m_i)
        stat_smem.slice((3 * K + 2) * BM, BM).store(l_i)
        fence_async_shared()
        mbarrier.arrive(sig, count=1)

    @gluon.jit
    def _pv_half(a_op, tile_smem, SLOT: gl.constexpr, zero, acc, alpha_o, base, length, K: gl.constexpr,
                 HALF: gl.constexpr, PAGE: gl.constexpr, z_l: gl.constexpr):
        """acc = acc alpha + P C on warpgroup K's half of the channels of the page in slot SLOT (P: registers or
        a P tile); a last page's tail tokens -> 0 first (P is 0 there, but 0 x NaN is NaN)."""
        half = tile_smem.index(SLOT + zero).slice(K * HALF, HALF, dim=1)
        if base + PAGE > length:
            zero_tail_rows(half, base, length, HALF, PAGE, z_l)
            fence_async_shared()
        acc = warpgroup_mma(a_op, half, acc * gl.expand_dims(alpha_o, 1), is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _seesaw_warpgroup(a, S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                          CAUSAL: gl.constexpr, LSE_NATURAL: gl.constexpr, K: gl.constexpr):
        """Warpgroup K's whole run (see the module docstring). `a`: the kernel's operands (a tuple: a worker
        partition takes no tensors, only descriptors and scalars)."""
        (lat_desc, rope_desc, tile_smem, rope_smem, q_all, p_smem, stat_smem, ready, sig, BT, LENS, O_PART, LSE_PART,
         sm_scale_log2, lat_page_rows, rope_page_rows, stride_bt, stride_ob, stride_om, stride_os, stride_lb, stride_lm,
         stride_ls, H, NSPLIT) = a
        BM: gl.constexpr = BM_ROWS
        HALF: gl.constexpr = R // 2
        NB: gl.constexpr = R // 64
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PAGE, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        qr_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
        srow_l: gl.constexpr = gl.SliceLayout(1, s_l)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_l)
        z_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        sig_a = sig.index(0)  # warpgroup 0 published page 2i
        sig_b = sig.index(1)  # warpgroup 1 published page 2i + 1
        free0 = sig.index(2)  # warpgroup 1 is done reading P tile 0 (page 2i)

        row0 = gl.program_id(0) * BM
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)
        bt_row = BT + b64 * stride_bt + p_lo

        # this warpgroup's part of the run's first two pages (slot 0: page 0, slot 1: page 1)
        if n_run > 0:
            _issue_part(lat_desc, rope_desc, tile_smem, rope_smem, ready, 0, bt_row, 0, lat_page_rows, rope_page_rows,
                        K, NB)
        if n_run > 1:
            _issue_part(lat_desc, rope_desc, tile_smem, rope_smem, ready, 1, bt_row, 1, lat_page_rows, rope_page_rows,
                        K, NB)
        # the query's RoPE part (stored in P tile 1 by the prologue) -> registers, before P tile 1 is reused
        qr = p_smem.index(1).load(qr_l)

        ones = gl.full([BM], 1.0, gl.float32, srow_l)
        limit, coef, m_i, l_i, pi_i, _ = row_state(length, row0, ones, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        acc = gl.zeros([BM, HALF], gl.float32, o_l)
        offs_t = gl.arange(0, PAGE, layout=gl.SliceLayout(0, s_l))
        # this warpgroup's first page's scores (warpgroup 1 begins with the boxes it asked for itself)
        qk = gl.zeros([BM, PAGE], gl.float32, s_l)
        if n_run > K:
            qk = _qk_page(q_all, qr, tile_smem, rope_smem, ready, K, 0, 0, K * (NB // 2), NB, BM, PAGE, s_l)

        for i in range((n_run + 1) // 2):
            j = 2 * i  # the pair's even page; j + 1 may be past the run
            base = (p_lo + j) * PAGE
            ph = i & 1
            # always 0, but not provably so: the shared-memory descriptors built from it stay in the loop instead
            # of being hoisted out of it (where 18 loop-invariant 64-bit descriptors were spilled and reloaded)
            zero = i >> 30
            if K == 0:
                if i > 0:  # warpgroup 1's PV of the previous pair has read P tile 0
                    mbarrier.wait(free0, (i - 1) & 1)
                p16, alpha, m_i, l_i = page_p16(qk, coef, base + offs_t, limit, m_i, l_i, 1)
                _publish(p_smem, stat_smem, sig_a, p16, alpha, m_i, l_i, 0, BM)
                acc = _pv_half(gl.convert_layout(p16, p_l), tile_smem, 0, zero, acc, gl.convert_layout(alpha, orow_l),
                               base, length, 0, HALF, PAGE, z_l)
                if j + 2 < n_run:
                    _issue_part(lat_desc, rope_desc, tile_smem, rope_smem, ready, 0, bt_row, j + 2, lat_page_rows,
                                rope_page_rows, 0, NB)
                if j + 1 < n_run:  # warpgroup 1's page: its P on this half
                    mbarrier.wait(sig_b, ph)
                    alpha_o = stat_smem.slice(3 * BM, BM).load(orow_l)
                    m_i = stat_smem.slice(4 * BM, BM).load(srow_l)
                    l_i = stat_smem.slice(5 * BM, BM).load(srow_l)
                    acc = _pv_half(p_smem.index(1), tile_smem, 1, zero, acc, alpha_o, base + PAGE, length, 0, HALF,
                                   PAGE, z_l)
                    if j + 3 < n_run:
                        _issue_part(lat_desc, rope_desc, tile_smem, rope_smem, ready, 1, bt_row, j + 3, lat_page_rows,
                                    rope_page_rows, 0, NB)
                if j + 2 < n_run:
                    qk = _qk_page(q_all, qr, tile_smem, rope_smem, ready, 0, ph ^ 1, zero, 0, NB, BM, PAGE, s_l)
            else:
                mbarrier.wait(sig_a, ph)
                alpha_o = stat_smem.slice(0, BM).load(orow_l)
                m_i = stat_smem.slice(BM, BM).load(srow_l)
                l_i = stat_smem.slice(2 * BM, BM).load(srow_l)
                if j + 1 < n_run:
                    # this page's softmax first (it continues the chain from warpgroup 0's), then both PVs
                    p16, alpha, m_i, l_i = page_p16(qk, coef, base + PAGE + offs_t, limit, m_i, l_i, 1)
                    _publish(p_smem, stat_smem, sig_b, p16, alpha, m_i, l_i, 1, BM)
                    acc = _pv_half(p_smem.index(0), tile_smem, 0, zero, acc, alpha_o, base, length, 1, HALF, PAGE,
                                   z_l)
                    mbarrier.arrive(free0, count=1)
                    if j + 2 < n_run:
                        _issue_part(lat_desc, rope_desc, tile_smem, rope_smem, ready, 0, bt_row, j + 2, lat_page_rows,
                                    rope_page_rows, 1, NB)
                    acc = _pv_half(gl.convert_layout(p16, p_l), tile_smem, 1, zero, acc,
                                   gl.convert_layout(alpha, orow_l), base + PAGE, length, 1, HALF, PAGE, z_l)
                    if j + 3 < n_run:
                        _issue_part(lat_desc, rope_desc, tile_smem, rope_smem, ready, 1, bt_row, j + 3, lat_page_rows,
                                    rope_page_rows, 1, NB)
                        qk = _qk_page(q_all, qr, tile_smem, rope_smem, ready, 1, ph ^ 1, zero, NB // 2, NB, BM, PAGE,
                                      s_l)
                else:  # the run's last page is warpgroup 0's: only its P on this half
                    acc = _pv_half(p_smem.index(0), tile_smem, 0, zero, acc, alpha_o, base, length, 1, HALF, PAGE,
                                   z_l)
                    mbarrier.arrive(free0, count=1)

        # this warpgroup's half of the channels; warpgroup 0 also writes the LSE
        store_rows(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                   stride_lb, stride_lm, stride_ls, HALF, LSE_NATURAL, BM, o_l, K * HALF, K == 0)

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
        gl.static_assert(D == 64)  # the query's RoPE part passes through a [64, 64] P tile, and is one box
        BM: gl.constexpr = BM_ROWS
        NBAR: gl.constexpr = R // 64 + 1  # per slot: the latent boxes and the RoPE rows
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        tile_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, R], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, D], rope_desc.layout)
        q_all = gl.allocate_shared_memory(gl.bfloat16, [1, BM, R], gl.NVMMASharedLayout.get_default_for([BM, R],
                                                                                                      gl.bfloat16))
        q_smem = q_all.index(0)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BM, PAGE],
                                           gl.NVMMASharedLayout.get_default_for([BM, PAGE], gl.bfloat16))
        stat_smem = gl.allocate_shared_memory(gl.float32, [8 * BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        ready = gl.allocate_shared_memory(gl.int64, [2 * NBAR, 1], mbarrier.MBarrierLayout())  # [slot, box]
        sig = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())  # see _seesaw_warpgroup
        for i in gl.static_range(2 * NBAR):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(3):
            mbarrier.init(sig.index(i), count=1)

        b64 = gl.program_id(1).to(gl.int64)
        query_operands(Q, q_smem, p_smem.index(1), b64, gl.program_id(0) * BM, stride_qb, stride_qs, stride_qh, H, S,
                       R, D, BM, False, q_l, False)
        fence_async_shared()

        args = (lat_desc, rope_desc, tile_smem, rope_smem, q_all, p_smem, stat_smem, ready, sig, BT, LENS, O_PART,
                LSE_PART, sm_scale_log2, lat_page_rows, rope_page_rows, stride_bt, stride_ob, stride_om, stride_os,
                stride_lb, stride_lm, stride_ls, H, NSPLIT)
        gl.warp_specialize([(_seesaw_default, (args, S, R, D, PAGE, CAUSAL, LSE_NATURAL)),
                            (_seesaw_worker, (args, S, R, D, PAGE, CAUSAL, LSE_NATURAL))], [4], [WORKER_REGS_C])
