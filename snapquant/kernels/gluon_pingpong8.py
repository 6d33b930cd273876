"""The 64-row decode page loop with native FP8 MMAs on two ping-pong warpgroups (Gluon, Hopper only).

`gluon_narrow8.py` runs 32 rows per program and two programs per SM, so that one program's MMAs can run
under the other's softmax. Nothing staggers them: both reach their softmax at the same time, and at
B=32 H=64 L=8K the softmax still costs 35 of 124 us (docs/perf-notes.md 21). Here one program holds 64
rows on two warpgroups (`gl.warp_specialize`, two partitions running the same code), each warpgroup
`gluon_narrow8`'s 32-row chain:

  * the two warpgroups share every page: one TMA read per page instead of one per row half, and the
    slots' shared memory is spent once (STAGES slots of 40 KB, 3 by default);
  * they take turns on the tensor cores (FA3's ping-pong): a warpgroup waits for its turn before
    issuing its QK MMAs, and again before its PV MMAs, and passes the turn on once they are issued.
    So the issue order is QK0 QK1 PV0 PV1 QK0 ..., and warpgroup 0's softmax runs while the tensor
    cores do warpgroup 1's QK, warpgroup 1's while they do warpgroup 0's PV. The turns are two
    mbarriers (one per warpgroup, one arrival per phase);
  * a slot is refilled once both warpgroups are done with its page (an mbarrier with two arrivals,
    waited on by warpgroup 1, which issues the refill); warpgroup 0 zeroes a request's last page's
    tail codes in the slot and tells warpgroup 1 through a third mbarrier.

Numerics as `gluon_narrow8` (the same MMA sequence per dot product: FP8 accumulation inside the MMA;
opt-in `fp8_mma=True`). PINGPONG=False drops the turns (the two warpgroups then run freely, for
`scripts/probe_gluon_decode.py`), ABLATE bits as in `gluon_wide8`, for timing only.
"""

from __future__ import annotations

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

    from .gluon_decode import _page_p, _query_operands, _row_state, _split_run, cta_barrier
    from .gluon_narrow8 import PAIR_VIEW_T, V_LOAD4, VT_STORE4
    from .gluon_wide8 import _issue_slot, _native8_smem, _store_vt, _vt_operand, _zero_tail_slot

    @gluon.jit
    def _take_turn(turn, k, wg, PINGPONG: gl.constexpr):
        """Wait until warpgroup wg may issue its k-th batch of MMAs: warpgroup 0's first batch goes at once
        (a fresh mbarrier passes a wait on parity 1), every later one after the other warpgroup's."""
        if PINGPONG:
            mbarrier.wait(turn.index(wg), (k & 1) ^ (1 - wg))

    @gluon.jit
    def _pass_turn(turn, wg, PINGPONG: gl.constexpr):
        """Warpgroup wg has issued its batch (every warp: wgmma is warpgroup-wide): the other one's turn."""
        if PINGPONG:
            cta_barrier()
            mbarrier.arrive(turn.index(1 - wg), count=1)

    @gluon.jit
    def _pingpong_rows(Q, lat_desc, rope_desc, SCALE, bt_row, O_PART, LSE_PART, sm_scale_log2, b64, split, length,
                       p_lo, n_run, stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp,
                       stride_st, stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls, H,
                       lat4, rope_smem, q_smem, qr_smem, p_smem, ready, empty, turn, zeroed, wg: gl.constexpr,
                       S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                       CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, STAGES: gl.constexpr,
                       CHAINS: gl.constexpr, ABLATE: gl.constexpr, PINGPONG: gl.constexpr,
                       RELEASE_FENCE: gl.constexpr):
        """One warpgroup's 32 rows (rows 32 wg.. of the program's 64): `gluon_narrow8`'s page loop on the
        shared slots, with turns on the tensor cores and the slot hand-offs described in the module."""
        BN: gl.constexpr = 32
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW
        HALF: gl.constexpr = 256
        s8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
        sm_l: gl.constexpr = gl.BlockedLayout([16, 1], [4, 8], [1, 4], [0, 1])  # a warp owns 8 rows
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        orow_l: gl.constexpr = gl.SliceLayout(0, o_l)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        NO_TMA: gl.constexpr = ABLATE & 16 != 0

        row0 = gl.program_id(0) * (2 * BN) + wg * BN
        sigma = _query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN, True,
                                q_l)
        limit, coef, m_i, l_i, pi_i, pi_max = _row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
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
        for it in range(n_run):
            slot = it % STAGES
            base = (p_lo + it) * PAGE
            # the page to refill this slot with, loaded now: its latency is off the refill's path
            page_refill = gl.load(bt_row + it + STAGES, mask=it + STAGES < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1, pred=not NO_TMA)
            if base + PAGE > length:  # a request's last page: its tail codes -> 0 (P = 0 does not cancel a NaN)
                if wg == 0:
                    _zero_tail_slot(lat4, slot, base, length, NBOX, PAGE, cvt_l)
                    fence_async_shared()  # the QK MMAs read the slot through the async proxy
                    cta_barrier()
                    mbarrier.arrive(zeroed, count=1)
                else:
                    mbarrier.wait(zeroed, 0)  # (only a run's last page can be a request's last)
            page_smem = lat4.index(slot)

            # scores^T [PAGE, BN]: the boxes as they landed (A) times q^T (B), CHAINS fp32 chains, + RoPE
            _take_turn(turn, 2 * it, wg, PINGPONG)
            if ABLATE & 2:  # (timing probes only, scripts/probe_gluon_decode.py: wrong results)
                _pass_turn(turn, wg, PINGPONG)
                qk = zero_s + it
            else:
                KC: gl.constexpr = R // CHAINS
                k0 = warpgroup_mma(page_smem.slice(0, PAGE, dim=0), q_smem.slice(0, BOXW, dim=1).permute((1, 0)),
                                   zero_s8, use_acc=False, is_async=True)
                for k in gl.static_range(1, KC // BOXW):
                    k0 = warpgroup_mma(page_smem.slice(k * PAGE, PAGE, dim=0),
                                       q_smem.slice(k * BOXW, BOXW, dim=1).permute((1, 0)), k0, is_async=True)
                rd = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
                if CHAINS == 2:
                    k1 = warpgroup_mma(page_smem.slice((KC // BOXW) * PAGE, PAGE, dim=0),
                                       q_smem.slice(KC, BOXW, dim=1).permute((1, 0)), zero_s8, use_acc=False,
                                       is_async=True)
                    for k in gl.static_range(KC // BOXW + 1, NBOX):
                        k1 = warpgroup_mma(page_smem.slice(k * PAGE, PAGE, dim=0),
                                           q_smem.slice(k * BOXW, BOXW, dim=1).permute((1, 0)), k1, is_async=True)
                    _pass_turn(turn, wg, PINGPONG)
                    k0, k1, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, rd))
                    qk = gl.convert_layout(k0 + k1, s_l) + rd  # the same registers (no data movement)
                else:
                    _pass_turn(turn, wg, PINGPONG)
                    k0, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, rd))
                    qk = gl.convert_layout(k0, s_l) + rd

            raw = gl.convert_layout(qk, sm_l)
            if ABLATE & 8:
                p8 = raw.to(gl.float8e4nv)
                rescale = gl.full([BN], 1.0, gl.float32, srow_l)
            else:
                p8, rescale, m_i, l_i, pi_i, pi_max = _page_p(raw, s_cur, coef, base + offs_t, limit, m_i, l_i, pi_i,
                                                              pi_max, zero_sm, P_DIV, 0)
            s_cur = s_next
            p_smem.store(gl.permute(p8, [1, 0]))  # P^ [rows, tokens]: the K-major B operand P^T
            fence_async_shared()
            cta_barrier()
            beta = gl.expand_dims(gl.convert_layout(rescale, orow_l), 0)
            _take_turn(turn, 2 * it + 1, wg, PINGPONG)
            if ABLATE & 4:
                _pass_turn(turn, wg, PINGPONG)
                acc_a = acc_a * beta
                acc_b = acc_b * beta
            else:
                pt = p_smem.permute((1, 0))
                # V^T of boxes 0-1, then of boxes 2-3 while the tensor cores run the first half
                acc_a = warpgroup_mma(_vt_operand(page_smem.slice(0, 2 * PAGE, dim=0), PAIR_VIEW_T, V_LOAD4, HALF, PAGE,
                                                  a_o, ABLATE), pt, acc_a * beta, is_async=True)
                vt_b = _vt_operand(page_smem.slice(2 * PAGE, 2 * PAGE, dim=0), PAIR_VIEW_T, V_LOAD4, HALF, PAGE, a_o,
                                   ABLATE)
                acc_b = warpgroup_mma(vt_b, pt, acc_b * beta, is_async=True)
                _pass_turn(turn, wg, PINGPONG)
                acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
            # this warpgroup is done with the slot (QK, V^T) and with P^; warpgroup 1 refills the slot once
            # warpgroup 0 is too (the loads went through the generic proxy, the refill is async)
            if RELEASE_FENCE:
                fence_async_shared()
            cta_barrier()
            mbarrier.arrive(empty.index(slot), count=1)
            if wg == 1:
                refill = (it + STAGES < n_run) & (not NO_TMA)
                mbarrier.wait(empty.index(slot), (it // STAGES) & 1, pred=refill)
                _issue_slot(lat_desc, rope_desc, lat4, rope_smem, ready, slot, page_refill, lat_page_rows,
                            rope_page_rows, refill, NBOX, BOXW, PAGE)

        _store_vt(acc_a, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL, BN, o_l, 4, VT_STORE4, 0, True)
        _store_vt(acc_b, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL, BN, o_l, 4, VT_STORE4, HALF, False)

    @gluon.jit
    def _mla_decode_gluon_pingpong8(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        STAGES: gl.constexpr = 3, CHAINS: gl.constexpr = 2, ABLATE: gl.constexpr = 0, PINGPONG: gl.constexpr = True,
        WORKER_REGS: gl.constexpr = 240, RELEASE_FENCE: gl.constexpr = True,
    ):
        """64 query rows x one split on two warpgroups (this warpgroup runs rows 0-31 as the default
        partition, a 4-warp worker partition rows 32-63)."""
        gl.static_assert(num_warps == 4)
        gl.static_assert(R == 512)
        gl.static_assert(PAGE == 64)
        gl.static_assert((CHAINS == 1) | (CHAINS == 2))
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = _split_run(LENS, b, split, NSPLIT, PAGE)
        NO_TMA: gl.constexpr = ABLATE & 16 != 0
        bt_row = BT + b64 * stride_bt + p_lo
        lat4, rope_smem, q_all, qr_all, p_all, ready = _native8_smem(
            lat_desc, rope_desc, bt_row, n_run, lat_page_rows, rope_page_rows, STAGES, NBOX, BOXW, PAGE, 64, R, D,
            NO_TMA)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        zeroed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(empty.index(s), count=2)
        for w in gl.static_range(2):
            mbarrier.init(turn.index(w), count=1)
        mbarrier.init(zeroed, count=1)
        fence_async_shared()
        cta_barrier()
        # both partitions run the same page loop (each its own inlined copy; `noinline` fails in Triton 3.6's
        # debug-info pass and was inlined anyway)
        gl.warp_specialize([
            (_pingpong_rows, (Q, lat_desc, rope_desc, SCALE, bt_row, O_PART, LSE_PART, sm_scale_log2, b64, split,
                              length, p_lo, n_run, stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows,
                              stride_sp, stride_st, stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
                              H, lat4, rope_smem, q_all.slice(0, 32, dim=0), qr_all.slice(0, 32, dim=0),
                              p_all.slice(0, 32, dim=0), ready, empty, turn, zeroed, 0,
                              S, R, D, PAGE, CAUSAL, P_DIV, LSE_NATURAL, STAGES, CHAINS, ABLATE, PINGPONG,
                              RELEASE_FENCE)),
            (_pingpong_rows, (Q, lat_desc, rope_desc, SCALE, bt_row, O_PART, LSE_PART, sm_scale_log2, b64, split,
                              length, p_lo, n_run, stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows,
                              stride_sp, stride_st, stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
                              H, lat4, rope_smem, q_all.slice(32, 32, dim=0), qr_all.slice(32, 32, dim=0),
                              p_all.slice(32, 32, dim=0), ready, empty, turn, zeroed, 1,
                              S, R, D, PAGE, CAUSAL, P_DIV, LSE_NATURAL, STAGES, CHAINS, ABLATE, PINGPONG,
                              RELEASE_FENCE)),
        ], [4], [WORKER_REGS])
