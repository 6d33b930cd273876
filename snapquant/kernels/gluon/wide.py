"""The decode page loop for 64-row query tiles (more than 16 query rows) in Gluon, Hopper only: fp8 and bf16.

The default past 16 query rows on Hopper for the snapmla layout (fp8 query and P) and the bf16 layout.
The narrow kernels (<= 16 rows, one warpgroup, swap AB) run out of registers past 16 rows (O^T is
[r, rows]), and the Triton tiles leave Hopper's tensor cores mostly idle there: ptxas serializes their
wgmma. This kernel is the usual two-warpgroup MLA layout:

  * one program = 64 query rows (S * H flattened) x one split of a request's pages; 8 warps, the
    wgmma layouts split N between the two warpgroups: S = Q C^T ([64, r] x [r, 64] + RoPE) gives
    each warpgroup 32 of the page's tokens, O = P C ([64, 64] x [64, r]) each 256 of the r = 512
    output channels (128 fp32 accumulator registers per thread);
  * Q (and the bf16 RoPE query) sits in shared memory for the whole run; P goes from the S
    accumulator to the PV product's A operand in registers (Gluon moves the other warpgroup's half);
  * the softmax runs in a layout where each warp owns 8 whole rows (4 lanes x 16 tokens): no
    cross-warp reductions;
  * the page arrives by TMA into one of two slots, one page ahead. FP8: the e4m3 boxes are widened
    once into an fp16 tile (exact, as in `narrow_tile.py`) read by both products, the next page's
    under the PV MMA; tokens past the request's length become zeros there. BF16: both products read
    the TMA slot itself (boxes of 64 channels, the widest 128-byte swizzle), and a request's last page
    has its tail rows zeroed in place (P = 0 there, but 0 x NaN is NaN);
  * FP8 arithmetic is `common.page_p` (fp8_scale_fused P, fma-corrected division); BF16 is the
    16-bit branch of `triton/decode.py`'s `_page_weights` (P = bf16(e), l += sum(e)).

Shared memory ~216 KB (one program per SM). Every wgmma is waited for within its page (a wait deferred
across the loop makes ptxas serialize every wgmma).
"""

from __future__ import annotations

from ..layouts import GLUON_WIDE_ROWS
from .common import HAVE_GLUON

BM = GLUON_WIDE_ROWS  # query rows per program (wgmma M)

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
        issue_tile_page,
        page_p,
        page_p16,
        query_operands,
        row_state,
        split_run,
        store_rows,
        widen_boxes,
        zero_tail_rows,
    )

    BM_ROWS = gl.constexpr(BM)  # globals read inside Gluon functions must be constexpr


if HAVE_GLUON:

    @gluon.jit
    def _mla_decode_gluon_wide(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, FP8: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
    ):
        gl.static_assert(num_warps == 8)
        BM: gl.constexpr = BM_ROWS  # query rows (wgmma M)
        STAGES: gl.constexpr = 2
        BOXW: gl.constexpr = 128 if FP8 else 64
        NBOX: gl.constexpr = R // BOXW
        T16: gl.constexpr = gl.float16 if FP8 else gl.bfloat16  # the MMAs' 16-bit operand type

        # ---- layouts: the two warpgroups split N (S: tokens, O: channels); P is O's A operand
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, PAGE // 2, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, R // 2, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        # the softmax where each warp owns 8 whole rows (4 lanes x 16 tokens): no cross-warp reductions
        sm_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        srow_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])  # 16 codes = 16 B
        z_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        # row tiles of one (request, split) are adjacent programs: they read the same pages (L2)
        row0 = gl.program_id(0) * BM
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)

        # ---- shared memory: two page slots, the query operands, the barriers. FP8: each slot is an fp16
        # tile whose upper half receives the page's fp8 boxes (converted in place, as narrow_tile.py's
        # one slot); BF16: the TMA writes the tile itself, in 64-channel column blocks.
        if FP8:
            tile_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE, BOXW], gl.float16)
            tile_smem = gl.allocate_shared_memory(gl.float16, [STAGES, PAGE, R], tile_l)
            if NEW_REINTERPRET:
                box_smem = tile_smem.reinterpret(gl.float8e4nv, [STAGES * 2 * NBOX, PAGE, BOXW], lat_desc.layout)
            else:
                box_smem = tile_smem._reinterpret(gl.float8e4nv, [STAGES * 2 * NBOX, PAGE, BOXW], lat_desc.layout)
        else:
            tile_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, R], lat_desc.layout)
            box_smem = tile_smem  # (unused)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(T16, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R], T16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)

        # ---- prologue: pages 0 and 1 in flight
        bt_row = BT + b64 * stride_bt + p_lo
        page0 = gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64)
        page1 = gl.load(bt_row + 1, mask=n_run > 1, other=0).to(gl.int64)
        issue_tile_page(lat_desc, rope_desc, box_smem, tile_smem, rope_smem, bars, 0, page0, lat_page_rows, rope_page_rows,
                    n_run > 0, FP8, NBOX, BOXW)
        issue_tile_page(lat_desc, rope_desc, box_smem, tile_smem, rope_smem, bars, 1, page1, lat_page_rows, rope_page_rows,
                    n_run > 1, FP8, NBOX, BOXW)

        # q / sigma by the reciprocal and one fma correction (div_rn's bits, no slow-path call per element)
        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BM, False,
                                q_l, FP8, Q_RCP=True)
        limit, coef, m_i, l_i, pi_i, pi_max = row_state(length, row0, sigma, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        acc = gl.zeros([BM, R], gl.float32, o_l)
        zero_s = gl.zeros([BM, PAGE], gl.float32, s_l)
        zero_sm = gl.zeros([BM, PAGE], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        offs_tc = gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))
        if FP8:  # page 0 converted before the loop; each iteration converts the next page under its PV
            s_cur = gl.load(SCALE + page0 * stride_sp + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length,
                            other=0.0)
            mbarrier.wait(bars.index(0), 0, pred=n_run > 0)
            if n_run > 0:
                widen_boxes(box_smem, tile_smem.index(0), NBOX, 0, NBOX, p_lo * PAGE, length, offs_tc, cvt_l, True,
                             NBOX, BOXW, PAGE)
        fence_async_shared()

        page_next = page1  # the page after the current one (already in flight)
        for it in range(n_run):
            slot = it % STAGES
            other = 1 - slot
            base = (p_lo + it) * PAGE
            page_after = gl.load(bt_row + it + 2, mask=it + 2 < n_run, other=0).to(gl.int64)
            tile = tile_smem.index(slot)
            if FP8:
                s_next = gl.load(SCALE + page_next * stride_sp + offs_t * stride_st,
                                 mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
            else:
                mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
                if base + PAGE > length:  # a last page's tail tokens -> 0 (P = 0 there, but 0 x NaN is NaN)
                    zero_tail_rows(tile, base, length, R, PAGE, z_l)
                    fence_async_shared()

            # scores [BM, PAGE] (fp32 accumulation): NoPE + RoPE
            qk = warpgroup_mma(q_smem, tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            qk = warpgroup_mma(qr_smem, rope_smem.index(slot).permute((1, 0)), qk, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))

            raw = gl.convert_layout(qk, sm_l)
            if FP8:
                p8, rescale, m_i, l_i, pi_i, pi_max = page_p(raw, s_cur, coef, base + offs_t, limit, m_i, l_i, pi_i,
                                                              pi_max, zero_sm, P_DIV, 1)
                p16 = p8.to(gl.float16)
                s_cur = s_next
            else:
                p16, rescale, m_i, l_i = page_p16(raw, coef, base + offs_t, limit, m_i, l_i, 1)
            # O [BM, R] += P C, waited for within the page (a wait deferred across the loop makes ptxas
            # serialize every wgmma)
            beta = gl.expand_dims(gl.convert_layout(rescale, gl.SliceLayout(1, o_l)), 1)
            acc = warpgroup_mma(gl.convert_layout(p16, p_l), tile, acc * beta, is_async=True)
            if FP8:  # while the tensor cores run PV: the next page's fp8 boxes -> its fp16 tile, in place
                if it + 1 < n_run:
                    mbarrier.wait(bars.index(other), ((it + 1) // STAGES) & 1)
                    widen_boxes(box_smem, tile_smem.index(other), other * 2 * NBOX + NBOX, 0, NBOX, base + PAGE,
                                 length, offs_tc, cvt_l, True, NBOX, BOXW, PAGE)
                fence_async_shared()
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            cta_barrier()  # this page's slot is read by both warpgroups (and the next one converted)
            issue_tile_page(lat_desc, rope_desc, box_smem, tile_smem, rope_smem, bars, slot, page_after, lat_page_rows,
                        rope_page_rows, it + 2 < n_run, FP8, NBOX, BOXW)
            page_next = page_after

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        store_rows(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                    stride_lb, stride_lm, stride_ls, R, LSE_NATURAL, BM, o_l)
