"""The <= 16-row snapmla page loop over an fp16 tile (Gluon, Hopper only): the default at kv_lora_rank != 512.

  * TMA: the page's fp8 latent ([64, r], as r / 128 boxes of 128 codes) and bf16 RoPE rows land in
    shared memory, an mbarrier counting the bytes in.
  * one conversion per page: fp8 codes -> an fp16 tile in shared memory (exact: fp16 holds every
    e4m3 value; `cvt.rn.f16x2.e4m3x2` on four codes per register), read by both products; on a
    request's last page, tokens past its length become exact zeros (the TMA box may hold the next
    request's rows, or codes such as NaN).
  * swap AB, so no rows are padded: the page's 64 tokens are wgmma's M dimension and the query rows
    (16) its N. S^T = C Q^T ([64, r] x [r, 16], plus R Q_r^T for RoPE), then the softmax in a layout
    where each warp owns whole rows (shuffle reductions), then O^T += C^T P^T with A = the same fp16
    tile read transposed (wgmma reads 16-bit A operands in either major order), P^T in shared memory.
  * the softmax and P quantization are `common.page_p` (the Triton kernels' arithmetic), with the
    fma-corrected division (P_DIV 2) by default: the same numbers as tile="pairs" up to fp32
    summation order inside the MMAs.

One ring slot (STAGES = 1, the launcher's num_stages), converted in place: TMA writes the fp8 boxes into
the upper half of the fp16 tile's 64 KB, ~98 KB of shared memory, so two programs share an SM and hide
each other's latency. With two or more slots, or with fp8_mma="qk", the launcher runs `narrow.py` instead
(register operands, never a tile). Every wgmma is waited for within its own page: a
wait deferred across the loop made ptxas serialize all of them (advisory C7515; `compile_stats` reports
`wgmma_waits` and `ptxas_advice`).
"""

from __future__ import annotations

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
        NEW_REINTERPRET,
        cta_barrier,
        issue_page,
        page_p_smem,
        query_operands,
        row_state,
        split_run,
        start_ring,
        store_result,
        widen_boxes,
    )

    @gluon.jit
    def _snapmla_decode_gluon(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BN: gl.constexpr = 16  # query rows (wgmma N)
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW

        # ---- layouts: the MMA accumulator (tokens or channels x rows), and plain blocked tiles
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 16])
        tok_l: gl.constexpr = gl.SliceLayout(1, mma_l)  # along M (tokens / channels)
        row_l: gl.constexpr = gl.SliceLayout(0, mma_l)  # along N (query rows)
        # The softmax runs in a layout where each warp owns whole query rows (8 lanes x 8 registers
        # over the page's 64 tokens): its reductions are shuffles, with no shared-memory round trip
        # and barrier each, and each row's scalars (divisions) are computed by 8 lanes, not 128
        # threads x 4 columns (the softmax was the page loop's largest cost in ablations).
        sm_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        gl.static_assert(num_warps == 4)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])  # 16 codes = 16 B
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        b = gl.program_id(0)
        row0 = gl.program_id(1) * BN
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)

        # ---- shared memory: the TMA ring, the fp16 tile, the query operands, P^T, the barriers
        c16_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE, BOXW], gl.float16)
        # one slot (two or more slots with register operands are narrow.py, the launcher's choice)
        gl.static_assert(STAGES == 1)
        INPLACE: gl.constexpr = True
        # One slot, converted in place: TMA writes the fp8 boxes into the upper half of the fp16
        # tile's 64 KB; fp16 chunk k (channels 128k.., bytes 16K k..) only overwrites boxes already
        # read. ~100 KB of shared memory: two programs share an SM and hide each other's waits.
        c16_all = gl.allocate_shared_memory(gl.float16, [1, PAGE, R], c16_l)
        c16_smem = c16_all.index(0)
        if NEW_REINTERPRET:
            lat_smem = c16_all.reinterpret(gl.float8e4nv, [2 * NBOX, PAGE, BOXW], lat_desc.layout)
        else:
            lat_smem = c16_all._reinterpret(gl.float8e4nv, [2 * NBOX, PAGE, BOXW], lat_desc.layout)
        BOX0: gl.constexpr = NBOX
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.float16, [BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float16, [BN, PAGE], gl.NVMMASharedLayout.get_default_for([BN, PAGE], gl.float16))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())

        # ---- prologue: the first page in flight before anything else
        bt_row = BT + b64 * stride_bt + p_lo
        ahead: gl.constexpr = 1
        start_ring(lat_desc, rope_desc, lat_smem, rope_smem, bars, bt_row, n_run, lat_page_rows, rope_page_rows,
                    STAGES, ahead, NBOX, BOXW, BOX0)

        # ---- query: per-row fp8 scale sigma, q^ = e4m3(q / sigma) as fp16, q~r = bf16(q_r / sigma)
        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN, False,
                                q_l)
        rows = row0 + gl.arange(0, BN, layout=row_l)
        row_ok = rows < S * H
        limit, coef, m_i, l_i, pi_i, pi_max = row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
        acc = gl.zeros([R, BN], gl.float32, mma_l)  # O^T
        zero_s = gl.zeros([PAGE, BN], gl.float32, mma_l)
        zero_sm = gl.zeros([PAGE, BN], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        offs_tc = gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))
        fence_async_shared()

        # page ids one iteration ahead of the TMA issue, scales one page ahead of their use
        page_next = gl.load(bt_row + ahead, mask=ahead < n_run, other=0).to(gl.int64)
        page_cur = gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64)
        s_cur = gl.load(SCALE + page_cur * stride_sp + offs_t * stride_st,
                        mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        for it in range(n_run):
            slot = 0  # the one slot
            nxt = it + ahead
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            base = (p_lo + it) * PAGE
            s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)

            mbarrier.wait(bars.index(slot), it & 1)
            # fp8 codes -> fp16 tile; on a request's last page, tokens past its length -> 0
            widen_boxes(lat_smem, c16_smem, BOX0 + slot * NBOX, 0, NBOX, base, length, offs_tc, cvt_l,
                         INPLACE, NBOX, BOXW, PAGE)
            fence_async_shared()

            # scores^T [PAGE, BN]: NoPE (products of e4m3 values) + RoPE (bf16), fp32 accumulation
            qk = warpgroup_mma(c16_smem, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            rd = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            qk, rd = warpgroup_mma_wait(num_outstanding=0, deps=(qk, rd))

            rescale, m_i, l_i, pi_i, pi_max = page_p_smem(gl.convert_layout(qk + rd, sm_l), s_cur, coef,
                                                           base + offs_t, limit, m_i, l_i, pi_i, pi_max, zero_sm,
                                                           p_smem, P_DIV)
            # O^T [R, BN] += C^T P^T: the same fp16 tile, read transposed
            beta = gl.expand_dims(gl.convert_layout(rescale, row_l), 0)
            # waited for right away: a wait deferred into the next iteration made ptxas serialize
            # every wgmma of the kernel (advisory C7515: the loop-carried accumulator)
            acc = warpgroup_mma(c16_smem.permute((1, 0)), p_smem.permute((1, 0)), acc * beta, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            cta_barrier()  # the tile is read: the next page may land in it
            issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, 0, page_next, lat_page_rows,
                        rope_page_rows, nxt < n_run, NBOX, BOXW, BOX0)
            page_next = gl.load(bt_row + nxt + 1, mask=nxt + 1 < n_run, other=0).to(gl.int64)
            s_cur = s_next

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        store_result(acc, gl.convert_layout(m_i, row_l), gl.convert_layout(l_i, row_l), gl.convert_layout(pi_i, row_l),
                      O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob, stride_om, stride_os,
                      stride_lb, stride_lm, stride_ls, R, LSE_NATURAL, tok_l)
