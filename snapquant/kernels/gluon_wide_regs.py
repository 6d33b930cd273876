"""The 64-row snapmla decode page loop with register MMA operands: no fp16 tiles (Gluon, Hopper only).

`gluon_wide.py` widens each fp8 page into a 64 KB fp16 tile that both MMAs read as their B operand;
two tiles and the 64 KB fp16 query fill shared memory, so it holds two pages and its TMA alone
streams at 1.56 TB/s (docs/perf-notes.md 13). This kernel applies `gluon_regs`' idea at 64 rows: swap
AB, so the page is each product's A operand, loaded from the fp8 TMA slot into registers and widened
there (exact fp16 MMAs, as `gluon_wide`):

  * S^T [64 tokens, 64 rows] = C Q^T + R Q_r^T: the two warpgroups split the rows (N = 32 each) and
    each reads the whole page through the QK view (`box_views`, "qk");
  * the softmax in a layout where each warp owns 8 query rows (tokens along axis 0);
  * O^T [512 channels, 64 rows] += C^T P^T: 8 warps along M, one accumulator per pair of boxes
    (256 channels, 64 registers per thread each), A read through the "pv256" view of the two boxes.

Shared memory: STAGES page slots of 40 KB (latent + RoPE), the fp16 query in the QK channel order
(64 KB), P^T (8 KB): three slots fit (~200 KB). One program per SM. ABLATE bits as in `gluon_wide`
(1: PV's A widening), for `scripts/probe_gluon_decode.py`'s timing only.
"""

from __future__ import annotations

from .box_views import box_view_bases
from .gluon_decode import HAVE_GLUON
from .layouts import GLUON_WIDE_ROWS

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
        NEW_REINTERPRET,
        _page_p,
        _query_operands,
        _row_state,
        _split_run,
        _store_result,
        cta_barrier,
        tma_load,
    )
    from .gluon_regs import QK_VIEW, _widen

    # a slot holds two [128, 128] tiles, each two TMA boxes stacked (the 128-byte swizzle repeats every 8
    # rows, so a tile is byte for byte two consecutive boxes): QK reads a tile as [2 boxes, 64, 128]
    QK_PAIR_VIEW = gl.constexpr(gl.SharedLinearLayout(
        offset_bases=[[0, *b] for b in box_view_bases("qk")] + [[1, 0, 0]]))
    PV256_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=box_view_bases("pv256")))
    BM_ROWS = gl.constexpr(GLUON_WIDE_ROWS)

    @gluon.jit
    def _view(smem, VIEW: gl.constexpr, SHAPE: gl.constexpr):
        if NEW_REINTERPRET:
            return smem.reinterpret(gl.float8e4nv, SHAPE, VIEW)
        else:
            return smem._reinterpret(gl.float8e4nv, SHAPE, VIEW)

    @gluon.jit
    def _issue_pairs(lat_desc, rope_desc, lat2, rope_smem, bars, slot, page, lat_page_rows, rope_page_rows, pred,
                     BOXW: gl.constexpr):
        """One page into slot `slot`: its four latent boxes as two pairs (lat2[2 slot], lat2[2 slot + 1])
        and its RoPE rows."""
        bar = bars.index(slot)
        lat_row = (page * lat_page_rows).to(gl.int32)
        mbarrier.expect(bar, 4 * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=pred)
        for k in gl.static_range(4):
            tma_load(lat_desc, [lat_row, k * BOXW], bar, lat2.index(2 * slot + k // 2).slice((k % 2) * 64, 64, dim=0),
                     pred=pred)
        tma_load(rope_desc, [(page * rope_page_rows).to(gl.int32), 0], bar, rope_smem.index(slot), pred=pred)

    @gluon.jit
    def _zero_tail_pairs(lat2, pair0, base, length, PAGE: gl.constexpr, cvt_l: gl.constexpr):
        """A request's last page: the codes of tokens past its length -> 0 in the slot (they may be NaN)."""
        keep = gl.expand_dims((base + gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))) < length, 1)
        for k in gl.static_range(4):
            box = lat2.index(pair0 + k // 2).slice((k % 2) * PAGE, PAGE, dim=0)
            c8 = box.load(cvt_l)
            box.store(gl.where(keep, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True))

    @gluon.jit
    def _mla_decode_gluon_wide_regs(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        ABLATE: gl.constexpr = 0,
    ):
        gl.static_assert(num_warps == 8)
        gl.static_assert(R == 512)
        gl.static_assert(PAGE == 64)
        BM: gl.constexpr = BM_ROWS  # query rows (wgmma N)
        BOXW: gl.constexpr = 128
        HALF: gl.constexpr = 256  # channels per PV accumulator (a pair of boxes)

        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BM // 2, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 16])
        a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
        a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        sm_l: gl.constexpr = gl.BlockedLayout([16, 1], [4, 8], [1, num_warps], [0, 1])  # a warp owns 8 rows
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        orow_l: gl.constexpr = gl.SliceLayout(0, o_l)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        row0 = gl.program_id(0) * BM
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = _split_run(LENS, b, split, NSPLIT, PAGE)

        lat2 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * 2, 2 * PAGE, BOXW], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.float16, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R], gl.float16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float16, [BM, PAGE], gl.NVMMASharedLayout.get_default_for([BM, PAGE], gl.float16))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)

        bt_row = BT + b64 * stride_bt + p_lo
        for s in gl.static_range(STAGES - 1):
            ok = s < n_run
            page = gl.load(bt_row + s, mask=ok, other=0).to(gl.int64)
            _issue_pairs(lat_desc, rope_desc, lat2, rope_smem, bars, s, page, lat_page_rows, rope_page_rows, ok, BOXW)

        sigma = _query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BM,
                                False, q_l, True, True)
        limit, coef, m_i, l_i, pi_i, pi_max = _row_state(length, row0, sigma, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        acc_a = gl.zeros([HALF, BM], gl.float32, o_l)  # O^T channels 0..255 (PV order), then 256..511
        acc_b = gl.zeros([HALF, BM], gl.float32, o_l)
        zero_s = gl.zeros([PAGE, BM], gl.float32, s_l)
        zero_sm = gl.zeros([PAGE, BM], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        fence_async_shared()
        cta_barrier()

        page_next = gl.load(bt_row + STAGES - 1, mask=STAGES - 1 < n_run, other=0).to(gl.int64)
        s_cur = gl.load(SCALE + gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64) * stride_sp
                        + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        for it in range(n_run):
            slot = it % STAGES
            nxt = it + STAGES - 1
            pair0 = 2 * slot
            _issue_pairs(lat_desc, rope_desc, lat2, rope_smem, bars, nxt % STAGES, page_next, lat_page_rows,
                         rope_page_rows, (nxt < n_run) & (ABLATE & 16 == 0), BOXW)
            page_next = gl.load(bt_row + nxt + 1, mask=nxt + 1 < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            base = (p_lo + it) * PAGE
            s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
            if ABLATE & 16 == 0:
                mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
            if base + PAGE > length:
                _zero_tail_pairs(lat2, pair0, base, length, PAGE, cvt_l)
                cta_barrier()

            # scores^T [PAGE, BM]: each warpgroup half the rows, the whole page widened in its registers
            if ABLATE & 2:  # (timing probes only: wrong results)
                qk = zero_s + it
            else:
                rd = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
                qk = warpgroup_mma(_widen(_view(lat2.index(pair0).slice(0, PAGE, dim=0), QK_VIEW, [PAGE, BOXW]).load(a_s)),
                                   q_smem.slice(0, BOXW, dim=1).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
                for k in gl.static_range(1, 4):
                    a16 = _widen(_view(lat2.index(pair0 + k // 2).slice((k % 2) * PAGE, PAGE, dim=0), QK_VIEW,
                                       [PAGE, BOXW]).load(a_s))
                    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
                    qk = warpgroup_mma(a16, q_smem.slice(k * BOXW, BOXW, dim=1).permute((1, 0)), qk, is_async=True)
                qk, rd = warpgroup_mma_wait(num_outstanding=0, deps=(qk, rd))
                qk = qk + rd

            raw = gl.convert_layout(qk, sm_l)
            if ABLATE & 8:
                p8 = raw.to(gl.float8e4nv)
                rescale = gl.full([BM], 1.0, gl.float32, srow_l)
            else:
                p8, rescale, m_i, l_i, pi_i, pi_max = _page_p(raw, s_cur, coef, base + offs_t, limit, m_i, l_i,
                                                              pi_i, pi_max, zero_sm, P_DIV, 0)
            p_smem.store(gl.permute(p8.to(gl.float16), [1, 0]))  # P as [rows, tokens]
            fence_async_shared()
            cta_barrier()
            beta = gl.expand_dims(gl.convert_layout(rescale, orow_l), 0)
            if ABLATE & 4:
                acc_a = acc_a * beta
                acc_b = acc_b * beta
            else:
                pt = p_smem.permute((1, 0))
                if ABLATE & 1:
                    a16 = gl.zeros([HALF, PAGE], gl.float16, a_o) + it
                    acc_a = warpgroup_mma(a16, pt, acc_a * beta, is_async=True)
                    acc_b = warpgroup_mma(a16, pt, acc_b * beta, is_async=True)
                else:
                    acc_a = warpgroup_mma(_widen(_view(lat2.index(pair0), PV256_VIEW, [HALF, PAGE]).load(a_o)), pt,
                                          acc_a * beta, is_async=True)
                    a16 = _widen(_view(lat2.index(pair0 + 1), PV256_VIEW, [HALF, PAGE]).load(a_o))
                    acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
                    acc_b = warpgroup_mma(a16, pt, acc_b * beta, is_async=True)
                acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
            cta_barrier()  # every warp's reads of this slot (and of P) are done: the slot may be refilled
            s_cur = s_next

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        rows = row0 + gl.arange(0, BM, layout=orow_l)
        row_ok = rows < S * H
        m_o = gl.convert_layout(m_i, orow_l)
        l_o = gl.convert_layout(l_i, orow_l)
        pi_o = gl.convert_layout(pi_i, orow_l)
        ch_l: gl.constexpr = gl.SliceLayout(1, o_l)
        _store_result(acc_a, m_o, l_o, pi_o, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om,
                      stride_os, stride_lb, stride_lm, stride_ls, HALF, LSE_NATURAL, ch_l, 1, 0, True, 2)
        _store_result(acc_b, m_o, l_o, pi_o, O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om,
                      stride_os, stride_lb, stride_lm, stride_ls, HALF, LSE_NATURAL, ch_l, 1, HALF, False, 2)
