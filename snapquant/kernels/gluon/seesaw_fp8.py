"""The snapmla layout past 16 query rows with `seesaw.py`'s pair schedule (two warpgroups in roles), Hopper only.

`wide.py` runs a page's QK, softmax and PV as one chain on 8 warps, and widens the next page's e4m3 boxes
under the PV. Here the two warpgroups work on a pair of pages at a time, as `seesaw.py` does for the bf16
layout; what the fp8 layout changes:

  * a slot is an fp16 tile [64, 512] whose lower half receives the page's four e4m3 boxes by TMA; the
    warpgroup that computes a page's scores (warpgroup 0 the even pages, 1 the odd ones) widens it in place,
    exactly (e4m3 -> fp16), with the tokens past the request's length set to zero: first boxes 3, 2 into the
    upper half (nothing unread there), whose QK then runs while it widens box 1 over boxes 2, 3 and, after a
    barrier of its four warps, box 0 over boxes 0, 1;
  * both warpgroups' PVs read the widened tile (each its 256 channels). Warpgroup 0's PV on the lower half
    comes first in a pair, so it asks for both slots' next pages (over the lower halves it just read), one PV
    after the other: a page is in flight for about a pair before it is widened. Warpgroup 0 widens slot 0's
    next page once warpgroup 1's PV has read its upper half (barrier `free0`, which also frees P tile 0);
    warpgroup 1 reads slot 1's upper half itself, just before it widens the next page there;
  * the page's arithmetic is `common.page_p` (fp8_scale_fused P^ = e4m3(f / pi), f = e times the token's
    scale), the row state (m, l, pi, pi_max) and the accumulator rescale beta handed over with P through
    shared memory, as `seesaw.py` hands over (alpha, m, l); each warpgroup quantizes 32 of the query's rows
    and both halves (and their sigma) meet in shared memory. Products are exact (fp16 MMAs on e4m3 values, fp32 sums): the reference's arithmetic page
    by page, up to fp32 summation order.

Shared memory: two slots of [64, 512] fp16 + [64, 64] bf16 RoPE (144 KB), the query's latent part in fp16
(64 KB), two P tiles (8 KB each) and the row states (2.5 KB): one program per SM, as `seesaw.py`.
"""

from __future__ import annotations

from ..layouts import GLUON_WIDE_ROWS
from .common import HAVE_GLUON

BM = GLUON_WIDE_ROWS  # query rows per program (wgmma M)
WORKER_REGS = 256  # registers per thread of warpgroup 1 (two warpgroups of 256 fill the register file)
NSTAT = 4  # row-state vectors each warpgroup publishes in the stats buffer: beta, m, l, pi (pi_max apart:
# shared-memory buffers have power-of-two shapes)

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
        cta_barrier,
        e4m3_to_f16,
        page_p,
        query_operands,
        row_state,
        split_run,
        store_rows,
        tma_load,
    )

    BM_ROWS = gl.constexpr(BM)
    WORKER_REGS_C = gl.constexpr(WORKER_REGS)
    NSTAT_C = gl.constexpr(NSTAT)


if HAVE_GLUON:

    @gluon.jit
    def _issue_page(lat_desc, rope_desc, box_smem, rope_smem, ready, SLOT: gl.constexpr, page, lat_page_rows,
                    rope_page_rows, NB8: gl.constexpr):
        """Cache page `page` into ring slot SLOT: its e4m3 boxes (128 channels each) into the lower half of the
        slot's fp16 tile and its RoPE rows, each counted in by its own barrier ready[SLOT * (NB8 + 1) + box]."""
        lat_row = (page * lat_page_rows).to(gl.int32)
        for c in gl.static_range(NB8):
            bar = ready.index(SLOT * (NB8 + 1) + c)
            mbarrier.expect(bar, lat_desc.block_type.nbytes)
            tma_load(lat_desc, [lat_row, c * 128], bar, box_smem.index(2 * SLOT * NB8 + c))
        bar = ready.index(SLOT * (NB8 + 1) + NB8)
        mbarrier.expect(bar, rope_desc.block_type.nbytes)
        tma_load(rope_desc, [(page * rope_page_rows).to(gl.int32), 0], bar, rope_smem.index(SLOT))

    @gluon.jit
    def _page_id(bt_row, j, n_run):
        """The cache page of the run's page j (0 past the run)."""
        return gl.load(bt_row + j, mask=j < n_run, other=0).to(gl.int64)

    @gluon.jit
    def _page_scales(SCALE, page, base, length, stride_sp, stride_st, offs_t):
        """The per-token scales of cache page `page`, whose first token is position `base` (0 past the length)."""
        return gl.load(SCALE + page * stride_sp + offs_t * stride_st, mask=base + offs_t < length, other=0.0)

    @gluon.jit
    def _landed_codes(box_smem, ready, SLOT: gl.constexpr, C: gl.constexpr, phase, keep, tail,
                      NB8: gl.constexpr, cvt_l: gl.constexpr):
        """The e4m3 codes of box C of the page in slot SLOT once it landed; on a last page the tokens past the
        request's length read as code 0 (the cache holds stale or NaN codes there)."""
        mbarrier.wait(ready.index(SLOT * (NB8 + 1) + C), phase)
        c8 = box_smem.index(2 * SLOT * NB8 + C).load(cvt_l)
        if tail:
            c8 = gl.where(keep, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True)
        return c8

    @gluon.jit
    def _qk_chunk(q_smem, tile, qk, C: gl.constexpr, FIRST: gl.constexpr):
        """qk (+)= the scores' part over fp16 chunk C (128 channels) of the tile, as two 64-channel MMAs."""
        for h in gl.static_range(2):
            qk = warpgroup_mma(q_smem.slice(C * 128 + h * 64, 64, dim=1),
                               tile.slice(C * 128 + h * 64, 64, dim=1).permute((1, 0)), qk,
                               use_acc=not (FIRST and h == 0), is_async=True)
        return qk

    @gluon.jit
    def _widen_qk(q_all, qr, tile_smem, box_smem, rope_smem, ready, SLOT: gl.constexpr, phase, zero, base, length,
                  NB8: gl.constexpr, BM: gl.constexpr, PAGE: gl.constexpr, s_l: gl.constexpr, cvt_l: gl.constexpr):
        """Widens the page in slot SLOT in place (e4m3 boxes in the lower half -> the fp16 tile) and returns its
        scores S = Q C^T + Q_r R^T. The caller knows the upper half is read. Boxes 3, 2 widen into the upper half
        (fp16 chunks 3, 2); their QK runs while the warpgroup widens box 1 over boxes 2, 3 (read by every warp
        before the barrier) and then, every warp having read boxes 0 and 1, box 0 over them."""
        tile = tile_smem.index(SLOT + zero)
        q_smem = q_all.index(zero)
        offs_tc = gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))
        keep = gl.expand_dims(base + offs_tc < length, 1)
        tail = base + PAGE > length
        # both boxes' codes first: a shared-memory load cannot pass the store before it (the compiler sees one
        # buffer), and one warp per scheduler does not hide its latency
        c3 = _landed_codes(box_smem, ready, SLOT, 3, phase, keep, tail, NB8, cvt_l)
        c2 = _landed_codes(box_smem, ready, SLOT, 2, phase, keep, tail, NB8, cvt_l)
        tile.slice(3 * 128, 128, dim=1).store(e4m3_to_f16(c3))
        tile.slice(2 * 128, 128, dim=1).store(e4m3_to_f16(c2))
        fence_async_shared()
        cta_barrier()  # the four warps' chunks before the warpgroup's MMA reads them; boxes 2, 3 read by all
        qk = gl.zeros([BM, PAGE], gl.float32, s_l)
        qk = _qk_chunk(q_smem, tile, qk, 3, True)
        qk = _qk_chunk(q_smem, tile, qk, 2, False)
        # one box at a time here: with the QK's accumulator in flight, two boxes' codes would spill
        c1 = _landed_codes(box_smem, ready, SLOT, 1, phase, keep, tail, NB8, cvt_l)
        tile.slice(128, 128, dim=1).store(e4m3_to_f16(c1))  # over boxes 2, 3
        c0 = _landed_codes(box_smem, ready, SLOT, 0, phase, keep, tail, NB8, cvt_l)
        cta_barrier()  # every warp has read boxes 0 and 1
        tile.slice(0, 128, dim=1).store(e4m3_to_f16(c0))
        fence_async_shared()
        cta_barrier()
        for c in gl.static_range(NB8 // 2):
            qk = _qk_chunk(q_smem, tile, qk, NB8 // 2 - 1 - c, False)
        mbarrier.wait(ready.index(SLOT * (NB8 + 1) + NB8), phase)
        qk = warpgroup_mma(qr, rope_smem.index(SLOT).permute((1, 0)), qk, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(qk,))

    @gluon.jit
    def _publish(p_smem, stat_smem, pmax_smem, sig, p16, beta, m_i, l_i, pi_i, pi_max, K: gl.constexpr,
                 BM: gl.constexpr):
        """Warpgroup K's page: P^ (as fp16) into P tile K and its row state into its stats, then signal."""
        p_smem.index(K).store(p16)
        stat_smem.slice((NSTAT_C * K) * BM, BM).store(beta)
        stat_smem.slice((NSTAT_C * K + 1) * BM, BM).store(m_i)
        stat_smem.slice((NSTAT_C * K + 2) * BM, BM).store(l_i)
        stat_smem.slice((NSTAT_C * K + 3) * BM, BM).store(pi_i)
        pmax_smem.slice(K * BM, BM).store(pi_max)
        fence_async_shared()
        mbarrier.arrive(sig, count=1)

    @gluon.jit
    def _take(stat_smem, pmax_smem, K: gl.constexpr, BM: gl.constexpr, orow_l: gl.constexpr,
              srow_l: gl.constexpr):
        """Warpgroup K's published row state: (beta as O's row layout, m, l, pi, pi_max)."""
        return (stat_smem.slice((NSTAT_C * K) * BM, BM).load(orow_l),
                stat_smem.slice((NSTAT_C * K + 1) * BM, BM).load(srow_l),
                stat_smem.slice((NSTAT_C * K + 2) * BM, BM).load(srow_l),
                stat_smem.slice((NSTAT_C * K + 3) * BM, BM).load(srow_l),
                pmax_smem.slice(K * BM, BM).load(srow_l))

    @gluon.jit
    def _pv_half(a_op, tile_smem, SLOT: gl.constexpr, zero, acc, beta_o, K: gl.constexpr, HALF: gl.constexpr):
        """acc = acc beta + P^ C on warpgroup K's half of the channels of the page in slot SLOT."""
        half = tile_smem.index(SLOT + zero).slice(K * HALF, HALF, dim=1)
        acc = warpgroup_mma(a_op, half, acc * gl.expand_dims(beta_o, 1), is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _seesaw_fp8_warpgroup(a, S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                              CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, K: gl.constexpr):
        """Warpgroup K's whole run (see the module docstring and `seesaw.py`)."""
        (lat_desc, rope_desc, tile_smem, box_smem, rope_smem, q_all, p_smem, qr_smem, stat_smem, pmax_smem, ready, sig, SCALE,
         Q, BT, LENS, O_PART, LSE_PART, sm_scale_log2, lat_page_rows, rope_page_rows, stride_qb, stride_qs, stride_qh,
         stride_sp, stride_st, stride_bt, stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls, H,
         NSPLIT) = a
        BM: gl.constexpr = BM_ROWS
        HALF: gl.constexpr = R // 2
        NB8: gl.constexpr = R // 128
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PAGE, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        qr_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
        srow_l: gl.constexpr = gl.SliceLayout(1, s_l)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_l)
        stok_l: gl.constexpr = gl.SliceLayout(0, s_l)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16 codes = 16 bytes per load
        sig_a = sig.index(0)  # warpgroup 0 published page 2i
        sig_b = sig.index(1)  # warpgroup 1 published page 2i + 1
        free0 = sig.index(2)  # warpgroup 1 is done reading P tile 0 and slot 0's upper half (page 2i)
        qready = sig.index(3)  # both halves of the query are in shared memory (two arrivals)
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])

        row0 = gl.program_id(0) * BM
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)
        bt_row = BT + b64 * stride_bt + p_lo

        # this warpgroup's first page (page K into slot K) in flight while it quantizes its half of the query
        page_k = _page_id(bt_row, K, n_run)
        if n_run > K:
            _issue_page(lat_desc, rope_desc, box_smem, rope_smem, ready, K, page_k, lat_page_rows, rope_page_rows, NB8)
        # query rows 32 K .. 32 K + 31: q^ (fp16) and q~r (bf16, through P tile 1) into shared memory, sigma through
        # warpgroup 1's beta slot; both warpgroups' halves (every MMA reads all 64 rows) are in once `qready` has
        # both arrivals. Split between the warpgroups, and q / sigma by the reciprocal with Markstein's correction
        # (div_rn's bits): as one unrolled block on 4 warps with div_rn the prologue cost ~60 us per program, most
        # of it instruction fetch (ncu: no_instruction) while the other warpgroup waited to start
        HQ: gl.constexpr = BM // 2
        sigma_half = query_operands(Q, q_all.index(0).slice(K * HQ, HQ, dim=0), qr_smem.slice(K * HQ, HQ, dim=0), b64,
                                    row0 + K * HQ, stride_qb, stride_qs, stride_qh, H, S, R, D, HQ, False, q_l, True,
                                    False, True)
        stat_smem.slice(NSTAT_C * BM + K * HQ, HQ).store(sigma_half)
        fence_async_shared()
        mbarrier.arrive(qready, count=1)
        mbarrier.wait(qready, 0)
        # the query's RoPE part and scale -> registers, before P tile 1 and warpgroup 1's stats are first written
        # (each warpgroup reads both before it first publishes)
        qr = qr_smem.load(qr_l)
        sigma = stat_smem.slice(NSTAT_C * BM, BM).load(srow_l)
        limit, coef, m_i, l_i, pi_i, pi_max = row_state(length, row0, sigma, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        acc = gl.zeros([BM, HALF], gl.float32, o_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        s_cur = _page_scales(SCALE, page_k, (p_lo + K) * PAGE, length, stride_sp, stride_st, offs_t)
        qk = gl.zeros([BM, PAGE], gl.float32, s_l)
        if n_run > K:
            qk = _widen_qk(q_all, qr, tile_smem, box_smem, rope_smem, ready, K, 0, 0, (p_lo + K) * PAGE, length,
                           NB8, BM, PAGE, s_l, cvt_l)

        for i in range((n_run + 1) // 2):
            j = 2 * i  # the pair's even page; j + 1 may be past the run
            base = (p_lo + j) * PAGE
            ph = i & 1
            zero = i >> 30  # always 0, not provably: keeps the shared-memory descriptors in the loop (seesaw.py)
            # the next pair's cache pages, read now: a TMA or scale address waiting on its load would hold up
            # everything after it (warpgroup 0 asks for both, warpgroup 1 needs its page's scales)
            page_2 = _page_id(bt_row, j + 2, n_run)
            page_3 = _page_id(bt_row, j + 3, n_run)
            if K == 0:
                p8, beta, m_i, l_i, pi_i, pi_max = page_p(qk, s_cur, coef, base + offs_t, limit, m_i, l_i, pi_i,
                                                          pi_max, gl.zeros([BM, PAGE], gl.float32, s_l), P_DIV, 1,
                                                          PI_RCP=True, DIV_FAST=True)
                p16 = p8.to(gl.float16)
                _publish(p_smem, stat_smem, pmax_smem, sig_a, p16, beta, m_i, l_i, pi_i, pi_max, 0, BM)
                acc = _pv_half(gl.convert_layout(p16, p_l), tile_smem, 0, zero, acc, gl.convert_layout(beta, orow_l),
                               0, HALF)
                if j + 2 < n_run:  # slot 0's lower half is read: its next page lands there
                    _issue_page(lat_desc, rope_desc, box_smem, rope_smem, ready, 0, page_2, lat_page_rows,
                                rope_page_rows, NB8)
                if j + 1 < n_run:  # warpgroup 1's page: its P^ on this half
                    mbarrier.wait(sig_b, ph)
                    beta_o, m_i, l_i, pi_i, pi_max = _take(stat_smem, pmax_smem, 1, BM, orow_l, srow_l)
                    acc = _pv_half(p_smem.index(1), tile_smem, 1, zero, acc, beta_o, 0, HALF)
                    if j + 3 < n_run:  # slot 1's lower half is read: its next page lands there
                        _issue_page(lat_desc, rope_desc, box_smem, rope_smem, ready, 1, page_3, lat_page_rows,
                                    rope_page_rows, NB8)
                if j + 2 < n_run:  # slot 0's next page; its scales load under the widening and QK
                    s_cur = _page_scales(SCALE, page_2, base + 2 * PAGE, length, stride_sp, stride_st, offs_t)
                    mbarrier.wait(free0, ph)  # warpgroup 1's PV has read slot 0's upper half (and P tile 0)
                    qk = _widen_qk(q_all, qr, tile_smem, box_smem, rope_smem, ready, 0, ph ^ 1, zero, base + 2 * PAGE,
                                   length, NB8, BM, PAGE, s_l, cvt_l)
            else:
                mbarrier.wait(sig_a, ph)
                beta_o, m_i, l_i, pi_i, pi_max = _take(stat_smem, pmax_smem, 0, BM, orow_l, srow_l)
                if j + 1 < n_run:
                    # this page's softmax first (it continues the chain from warpgroup 0's), then both PVs
                    p8, beta, m_i, l_i, pi_i, pi_max = page_p(qk, s_cur, coef, base + PAGE + offs_t, limit, m_i, l_i,
                                                              pi_i, pi_max, gl.zeros([BM, PAGE], gl.float32, s_l),
                                                              P_DIV, 1, PI_RCP=True, DIV_FAST=True)
                    p16 = p8.to(gl.float16)
                    _publish(p_smem, stat_smem, pmax_smem, sig_b, p16, beta, m_i, l_i, pi_i, pi_max, 1, BM)
                    acc = _pv_half(p_smem.index(0), tile_smem, 0, zero, acc, beta_o, 1, HALF)
                    mbarrier.arrive(free0, count=1)
                    acc = _pv_half(gl.convert_layout(p16, p_l), tile_smem, 1, zero, acc,
                                   gl.convert_layout(beta, orow_l), 1, HALF)
                    if j + 3 < n_run:  # slot 1's next page (asked for by warpgroup 0), over the upper half just read
                        s_cur = _page_scales(SCALE, page_3, base + 3 * PAGE, length, stride_sp, stride_st, offs_t)
                        qk = _widen_qk(q_all, qr, tile_smem, box_smem, rope_smem, ready, 1, ph ^ 1, zero,
                                       base + 3 * PAGE, length, NB8, BM, PAGE, s_l, cvt_l)
                else:  # the run's last page is warpgroup 0's: only its P^ on this half
                    acc = _pv_half(p_smem.index(0), tile_smem, 0, zero, acc, beta_o, 1, HALF)
                    mbarrier.arrive(free0, count=1)

        # this warpgroup's half of the channels; warpgroup 0 also writes the LSE
        store_rows(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                   stride_lb, stride_lm, stride_ls, HALF, LSE_NATURAL, BM, o_l, K * HALF, K == 0)

    @gluon.jit
    def _seesaw_fp8_default(a, S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                            CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr):
        _seesaw_fp8_warpgroup(a, S, R, D, PAGE, CAUSAL, P_DIV, LSE_NATURAL, 0)

    @gluon.jit
    def _seesaw_fp8_worker(a, S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                           CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr):
        _seesaw_fp8_warpgroup(a, S, R, D, PAGE, CAUSAL, P_DIV, LSE_NATURAL, 1)

    @gluon.jit
    def _snapmla_decode_gluon_seesaw(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr,
        P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
    ):
        gl.static_assert(num_warps == 4)  # the default partition: warpgroup 0; warpgroup 1 is a worker
        gl.static_assert(R == 512)  # four e4m3 boxes per page: two widen into each half
        gl.static_assert(D == 64)  # the query's RoPE part passes through a [64, 64] P tile, and is one box
        BM: gl.constexpr = BM_ROWS
        NB8: gl.constexpr = R // 128
        NBAR: gl.constexpr = NB8 + 1  # per slot: the e4m3 boxes and the RoPE rows

        tile_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE, 128], gl.float16)
        tile_smem = gl.allocate_shared_memory(gl.float16, [2, PAGE, R], tile_l)
        if NEW_REINTERPRET:
            box_smem = tile_smem.reinterpret(gl.float8e4nv, [2 * 2 * NB8, PAGE, 128], lat_desc.layout)
        else:
            box_smem = tile_smem._reinterpret(gl.float8e4nv, [2 * 2 * NB8, PAGE, 128], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, D], rope_desc.layout)
        q_all = gl.allocate_shared_memory(gl.float16, [1, BM, R], gl.NVMMASharedLayout.get_default_for([BM, R],
                                                                                                     gl.float16))
        p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, PAGE], gl.float16)
        p_smem = gl.allocate_shared_memory(gl.float16, [2, BM, PAGE], p_l)
        qr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16)
        if NEW_REINTERPRET:  # the query's RoPE part (bf16) passes through P tile 1
            qr_smem = p_smem.index(1).reinterpret(gl.bfloat16, [BM, D], qr_l)
        else:
            qr_smem = p_smem.index(1)._reinterpret(gl.bfloat16, [BM, D], qr_l)
        # the two warpgroups' row states; sigma first passes through warpgroup 1's (written only after it is read)
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        stat_smem = gl.allocate_shared_memory(gl.float32, [2 * NSTAT_C * BM], vec_l)
        pmax_smem = gl.allocate_shared_memory(gl.float32, [2 * BM], vec_l)
        ready = gl.allocate_shared_memory(gl.int64, [2 * NBAR, 1], mbarrier.MBarrierLayout())  # [slot, box]
        sig = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # see _seesaw_fp8_warpgroup
        for i in gl.static_range(2 * NBAR):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(3):
            mbarrier.init(sig.index(i), count=1)
        mbarrier.init(sig.index(3), count=2)  # qready: one arrival per warpgroup
        fence_async_shared()

        args = (lat_desc, rope_desc, tile_smem, box_smem, rope_smem, q_all, p_smem, qr_smem, stat_smem, pmax_smem, ready,
                sig, SCALE, Q, BT, LENS, O_PART, LSE_PART, sm_scale_log2, lat_page_rows, rope_page_rows, stride_qb,
                stride_qs, stride_qh, stride_sp, stride_st, stride_bt, stride_ob, stride_om, stride_os, stride_lb,
                stride_lm, stride_ls, H, NSPLIT)
        gl.warp_specialize([(_seesaw_fp8_default, (args, S, R, D, PAGE, CAUSAL, P_DIV, LSE_NATURAL)),
                            (_seesaw_fp8_worker, (args, S, R, D, PAGE, CAUSAL, P_DIV, LSE_NATURAL))], [4],
                           [WORKER_REGS_C])
