"""The <= 16-row page loop for the bf16 layout (Gluon, Hopper only): the BF16 baseline at FlashMLA's shapes.

Opt-in (`tile="gluon"` with the bf16 layout at <= 16 query rows); the default there is still the Triton rows
tile (`triton/decode.py`) until this kernel is timed beside it and FlashMLA. The Triton tile reads its pages
through a cp.async ring and waits on a CTA barrier per stage; at H = 16 it reads at ~61 % of DRAM bandwidth
where FlashMLA's BF16 kernel reads at 93-96 % (docs/performance.md, "Profiles"). This kernel is
`narrow.py`'s swap-AB schedule without the widening: a bf16 page is already an MMA operand, so both products
read the TMA slot itself and nothing but the softmax runs on the CUDA cores.

  * one program = 16 query rows (S * H flattened, wgmma N) x one split of one request's pages; 4 warps (one
    warpgroup);
  * S^T [64 tokens, 16] = C Q^T + R Q_r^T: A = the page's [64, r] latent tile straight from its slot (K-major:
    channels contiguous), B = the query, stored once in shared memory (bf16);
  * softmax over the page's tokens (`common.page_p16`: P = bf16(e), l += sum(e), the bf16 layout's arithmetic),
    P^T into shared memory as the second product's B;
  * O^T [r, 16] += C^T P^T: A = the same slot read transposed (MN-major, which wgmma allows for 16-bit
    operands), one [r, 16] fp32 accumulator (r / 8 registers per thread);
  * TMA ring of STAGES page slots (72 KB each at r = 512): 2 slots (~172 KB, one program per SM, the next
    page in flight while this one computes), or 1 slot (~98 KB, two programs per SM, each waiting on its
    own page while the other computes). Which one reads closer to the bandwidth is for the benchmark.

A request's last page has its tail tokens zeroed in the slot before the products (P = 0 there, but 0 x NaN
is NaN). The epilogue is `common.store_result` (pi = 1: lse = m + log2(l)).
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
        cta_barrier,
        issue_tile_page,
        page_p16,
        prefetch_run_page,
        query_operands,
        row_state,
        split_run,
        store_result,
        zero_tail_rows,
    )

    @gluon.jit
    def _bf16_decode_gluon_narrow(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT, LAT, ROPE, lat_page_bytes, rope_page_bytes, lat_span, rope_span,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        PF: gl.constexpr = 0,
    ):
        gl.static_assert(num_warps == 4)
        gl.static_assert(PAGE == 64)
        BN: gl.constexpr = 16  # query rows (wgmma N)
        BOXW: gl.constexpr = 64  # bf16 channels per TMA box (128 bytes, the widest swizzle)
        NBOX: gl.constexpr = R // BOXW

        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 16])
        ch_l: gl.constexpr = gl.SliceLayout(1, mma_l)  # along M (tokens for S^T, channels for O^T)
        row_l: gl.constexpr = gl.SliceLayout(0, mma_l)  # along N (query rows)
        sm_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])  # as narrow.py: a warp per 4 rows
        srow_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        z_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        b = gl.program_id(0)
        row0 = gl.program_id(1) * BN
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)

        tile_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, R], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], gl.bfloat16))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, PAGE],
                                           gl.NVMMASharedLayout.get_default_for([BN, PAGE], gl.bfloat16))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)

        # ---- prologue: STAGES - 1 pages in flight before the query is read
        bt_row = BT + b64 * stride_bt + p_lo
        for s in gl.static_range(STAGES - 1):
            page = gl.load(bt_row + s, mask=s < n_run, other=0).to(gl.int64)
            issue_tile_page(lat_desc, rope_desc, tile_smem, tile_smem, rope_smem, bars, s, page, lat_page_rows,
                            rope_page_rows, s < n_run, False, NBOX, BOXW)
        # L2 prefetch (PF > 0): the pages the ring asks for before the loop's first prefetch lands
        for j in gl.static_range(1, PF):
            prefetch_run_page(LAT, ROPE, bt_row, STAGES - 1 + j, n_run, lat_page_bytes, rope_page_bytes,
                              lat_span, rope_span, num_warps)

        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BN,
                                False, q_l, False)  # bf16 query, sigma = 1
        rows = row0 + gl.arange(0, BN, layout=row_l)
        row_ok = rows < S * H
        limit, coef, m_i, l_i, pi_i, _ = row_state(length, row0, sigma, sm_scale_log2, H, S, BN, CAUSAL, srow_l)
        acc = gl.zeros([R, BN], gl.float32, mma_l)  # O^T
        zero_s = gl.zeros([PAGE, BN], gl.float32, mma_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        fence_async_shared()
        cta_barrier()

        page_next = gl.load(bt_row + STAGES - 1, mask=STAGES - 1 < n_run, other=0).to(gl.int64)
        for it in range(n_run):
            slot = it % STAGES
            nxt = it + STAGES - 1
            # the slot of page it - 1 is free: its last reads were before last iteration's barrier
            issue_tile_page(lat_desc, rope_desc, tile_smem, tile_smem, rope_smem, bars, nxt % STAGES, page_next,
                            lat_page_rows, rope_page_rows, nxt < n_run, False, NBOX, BOXW)
            if PF > 0:  # and the page PF after it into L2: when its slot asks for it, it comes from L2
                prefetch_run_page(LAT, ROPE, bt_row, nxt + PF, n_run, lat_page_bytes, rope_page_bytes, lat_span,
                                  rope_span, num_warps)
            page_next = gl.load(bt_row + nxt + 1, mask=nxt + 1 < n_run, other=0).to(gl.int64)
            base = (p_lo + it) * PAGE
            tile = tile_smem.index(slot)
            mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
            if base + PAGE > length:  # a last page's tail tokens -> 0 (generic stores: fenced for the async proxy)
                zero_tail_rows(tile, base, length, R, PAGE, z_l)
                fence_async_shared()
                cta_barrier()

            # scores^T [PAGE, BN], fp32 accumulation: latent then RoPE, both read from the slot
            qk = warpgroup_mma(tile, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            qk = warpgroup_mma(rope_smem.index(slot), qr_smem.permute((1, 0)), qk, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))

            p16, alpha, m_i, l_i = page_p16(gl.convert_layout(qk, sm_l), coef, base + offs_t, limit, m_i, l_i, 0)
            p_smem.store(gl.permute(p16, [1, 0]))
            fence_async_shared()
            cta_barrier()
            # O^T [R, BN] += C^T P^T: the slot read channel-major as the A operand
            beta = gl.expand_dims(gl.convert_layout(alpha, row_l), 0)
            acc = warpgroup_mma(tile.permute((1, 0)), p_smem.permute((1, 0)), acc * beta, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            cta_barrier()  # every warp's reads of this slot (and of P) are done: the slot may be refilled

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        store_result(acc, gl.convert_layout(m_i, row_l), gl.convert_layout(l_i, row_l),
                      gl.convert_layout(pi_i, row_l), O_PART, LSE_PART, b64, split, rows, row_ok, stride_ob,
                      stride_om, stride_os, stride_lb, stride_lm, stride_ls, R, LSE_NATURAL, ch_l, AX=1)
