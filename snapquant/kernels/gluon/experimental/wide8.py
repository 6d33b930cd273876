"""The 64-row decode page loop with native FP8 MMAs (opt-in: `fp8_mma=True, block_m=64`), Gluon, Hopper only.

SnapMLA's own design: both products run on the tensor cores' e4m3 path, at twice the fp16 rate, and
no page is ever widened to fp16 (`wide.py`, the exact default, widens every page to an fp16 tile that
both of its fp16 MMAs read).

  * one program = 64 query rows x one split, 8 warps, one program per SM;
  * QK: S [64 rows, 64 tokens] = q^ (e4m3, 32 KB in shared memory) times the page's TMA boxes as they
    landed, the warpgroups splitting the tokens, in two accumulation chains of 256 channels summed in
    fp32 (Hopper's FP8 MMA keeps ~14 bits inside a chain; DeepSeek-V3 promotes every 128 products; one
    512-long chain doubled the LSE error). RoPE stays a bf16 MMA;
  * PV, swapped: O^T [512 channels, 64 rows] += V^T P^T, 8 warps along the channels, V^T from the slot
    into registers (`native8.vt_operand` through `SLOT_VIEW_T`: 16 8-byte loads and 64 byte permutes
    per thread per page, no transposed tile, no extra barrier), loaded after the QK wait (under the QK
    MMAs it raised register pressure); P^ (e4m3) goes to shared memory as [rows, tokens], the K-major
    B operand P^T;
  * the accumulator carries across pages inside the MMA: the result differs from the exact kernels by
    the FP8 MMA's accumulation rounding (tested at 1e-2 relative; the exact kernels are the default).

Shared memory: STAGES TMA slots of 40 KB (the launcher's num_stages: 2 by default, 3 or 4), 44 KB of
query and P operands. The softmax and P^ are `native8.page_p_native` (q / sigma too by a reciprocal
with Markstein's correction: the correctly rounded quotient).
"""

from __future__ import annotations

from ...layouts import GLUON_WIDE_ROWS
from ..box_views import slot_view_bases, v_load_bases, vt_store_bases
from ..common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from ..common import cta_barrier, query_operands, row_state, split_run
    from .native8 import (
        fewest_visible,
        issue_slot,
        native8_smem,
        page_p_native,
        page_start,
        store_vt,
        vt_operand,
    )

    BM_ROWS = gl.constexpr(GLUON_WIDE_ROWS)
    # a page slot (four 128-channel boxes, stacked) read as V^T [512 m, 64 tokens] (box_views.pv8_channel),
    # with rows m bits 3, 7 and tokens bits 0, 1 trading places (undone by native8._transpose4x4)
    SLOT_VIEW_T = gl.constexpr(gl.SharedLinearLayout(offset_bases=slot_view_bases(transposed=True)))
    # wgmma's e4m3 A-operand layout for O^T [512, 64] (8 warps along M: rows m bits 0-2 the lane group,
    # 4-6 the warp; a 32-bit register holds tokens bits 0-1) with its registers reordered: m bit 8 next
    # to the bytes (so with SLOT_VIEW_T a thread loads 8 contiguous bytes per token row), then m bits 3, 7
    # (the four registers _transpose4x4 transposes with the bytes). Back to the MMA's own order is a
    # renaming of whole registers.
    V_LOAD = gl.constexpr(gl.DistributedLinearLayout(*v_load_bases(3), block_bases=[], shape=[512, 64]))
    # the PV accumulator's layout in physical channel order (after store_vt's reshape), registers
    # reordered so each thread's 8 contiguous channels of a row come first (two 16-byte stores)
    VT_STORE = gl.constexpr(gl.DistributedLinearLayout(*vt_store_bases(3, 64), block_bases=[], shape=[512, 64]))


if HAVE_GLUON:

    @gluon.jit
    def _mla_decode_gluon_wide8(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        STAGES: gl.constexpr = 2,
    ):
        """Native FP8 MMAs with PV swapped: O^T [R, 64 rows] += V^T P^T, V^T read from the TMA slot into
        registers (no transposed tile), P^ [rows, tokens] from shared memory as the K-major B operand."""
        gl.static_assert(num_warps == 8)
        gl.static_assert(R == 512)
        gl.static_assert(PAGE == 64)
        BM: gl.constexpr = BM_ROWS
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW

        # QK: the warpgroups split the tokens (N); PV: 8 warps along M = channels
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, PAGE // 2, 16])
        s8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, PAGE // 2, 32])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 32])
        a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
        sm_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])  # a warp owns 8 rows
        srow_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        orow_l: gl.constexpr = gl.SliceLayout(0, o_l)
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])

        row0 = gl.program_id(0) * BM
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = split_run(LENS, b, split, NSPLIT, PAGE)

        bt_row = BT + b64 * stride_bt + p_lo
        lat4, rope_smem, q_smem, qr_smem, p_smem, bars = native8_smem(
            lat_desc, rope_desc, bt_row, n_run, lat_page_rows, rope_page_rows, STAGES, NBOX, BOXW, PAGE, BM, R, D)

        sigma = query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BM, True,
                                q_l, True, False, True)
        limit, coef, m_i, l_i, pi_i, pi_max = row_state(length, row0, sigma, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        lim_min = fewest_visible(limit, row0, S * H, BM, srow_l)
        acc = gl.zeros([R, BM], gl.float32, o_l)  # O^T, rows in pv8_channel order
        zero_s = gl.zeros([BM, PAGE], gl.float32, s_l)
        zero_s8 = gl.zeros([BM, PAGE], gl.float32, s8_l)
        zero_sm = gl.zeros([BM, PAGE], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        fence_async_shared()
        cta_barrier()

        s_cur = gl.load(SCALE + gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64) * stride_sp
                        + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        for it in range(n_run):
            slot, base, page_refill, s_next, _ = page_start(lat4, bars, bt_row, SCALE, it, p_lo, n_run, length,
                                                             offs_t, stride_sp, stride_st, STAGES, NBOX, PAGE, cvt_l)
            page_smem = lat4.index(slot)

            # scores [BM, PAGE]: NoPE (e4m3 x e4m3, two fp32 chains: boxes 0-1 and 2-3) + RoPE (bf16), async
            KC: gl.constexpr = R // 2
            k0 = warpgroup_mma(q_smem.slice(0, BOXW, dim=1), page_smem.slice(0, PAGE, dim=0).permute((1, 0)),
                               zero_s8, use_acc=False, is_async=True)
            for k in gl.static_range(1, KC // BOXW):
                k0 = warpgroup_mma(q_smem.slice(k * BOXW, BOXW, dim=1),
                                   page_smem.slice(k * PAGE, PAGE, dim=0).permute((1, 0)), k0, is_async=True)
            k1 = warpgroup_mma(q_smem.slice(KC, BOXW, dim=1),
                               page_smem.slice((KC // BOXW) * PAGE, PAGE, dim=0).permute((1, 0)), zero_s8,
                               use_acc=False, is_async=True)
            for k in gl.static_range(KC // BOXW + 1, NBOX):
                k1 = warpgroup_mma(q_smem.slice(k * BOXW, BOXW, dim=1),
                                   page_smem.slice(k * PAGE, PAGE, dim=0).permute((1, 0)), k1, is_async=True)
            rd = warpgroup_mma(qr_smem, rope_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            k0, k1, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, rd))
            qk = gl.convert_layout(k0 + k1, s_l) + rd  # the same registers (no data movement)
            # V^T after the QK wait (loaded under the QK MMAs it raised register pressure)
            vt = vt_operand(page_smem, SLOT_VIEW_T, V_LOAD, R, PAGE, a_o)
            cta_barrier()  # every warp has read the slot (QK and V^T): refill it
            issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, slot, page_refill, lat_page_rows, rope_page_rows,
                        it + STAGES < n_run, NBOX, BOXW, PAGE)

            raw = gl.convert_layout(qk, sm_l)
            p8, rescale, m_i, l_i, pi_i, pi_max = page_p_native(raw, s_cur, coef, base + offs_t, limit, m_i, l_i,
                                                                 pi_i, pi_max, zero_sm, base + PAGE <= lim_min,
                                                                 P_DIV, 1)
            s_cur = s_next
            p_smem.store(p8)  # P^ [rows, tokens]: tokens contiguous, the K-major B operand P^T
            fence_async_shared()
            cta_barrier()
            beta = gl.expand_dims(gl.convert_layout(rescale, orow_l), 0)
            acc = warpgroup_mma(vt, p_smem.permute((1, 0)), acc * beta, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        store_vt(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL, BM, o_l, 8, VT_STORE)
