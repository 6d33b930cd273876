"""The 64-row decode page loop with native FP8 MMAs (opt-in `fp8_mma=True`), Gluon, Hopper only.

SnapMLA's own design: both products run on the tensor cores' e4m3 path, at twice the fp16 rate, and
no page is ever widened to fp16. `gluon_wide.py` (the default, exact) widens every page to an fp16
tile that both of its fp16 MMAs read; past 16 rows that costs it its speed (docs/perf-notes.md 13).

  * one program = 64 query rows x one split, 8 warps;
  * QK: S [64 rows, 64 tokens] = q^ (e4m3, 32 KB in shared memory) times the page's TMA boxes as they
    landed, the warpgroups splitting the tokens, in CHAINS accumulation chains summed in fp32 (Hopper's
    FP8 MMA keeps ~14 bits inside a chain; DeepSeek-V3 promotes every 128 products). Two chains of 256
    channels, the launcher's choice: one 512-long chain measured LSE errors up to 0.016 (H200 check),
    two at most 7.7e-3. RoPE stays a bf16 MMA;
  * PV, swapped: O^T [512 channels, 64 rows] += V^T P^T, 8 warps along the channels. An 8-bit MMA
    operand in shared memory must be K-major, and K is the page's token axis, which the cache stores
    channel-major. As the A operand V^T comes from registers instead: each thread loads 8 contiguous
    bytes per token row straight from the TMA slot (a `SharedLinearLayout` view, `box_views.
    slot_view_bases`) and one 4 x 4 byte transpose (`prmt`) per four registers yields wgmma's fragment:
    16 loads and 64 byte permutes per thread per page, no transposed tile, no extra barrier. The
    channel order of the MMA's rows is ours to choose (`box_views.pv8_channel`); the epilogue puts the
    channels back in order with a reshape (no data movement) and stores 16 bytes at a time. P^ (e4m3,
    `_page_p`'s fp8_scale_fused arithmetic) goes to shared memory as [rows, tokens], the K-major B
    operand P^T. A request's last page has its tail codes zeroed in the slot first (P = 0 does not
    cancel a NaN);
  * the accumulator carries across pages inside the MMA: the result differs from the exact kernels by
    the FP8 MMA's accumulation rounding (tested at 1e-2 relative, measured 1.3-3.2e-3; the exact
    kernels are the default).

Shared memory: STAGES TMA slots of 40 KB (the launcher's num_stages, 2 by default: 131 KB in all;
H200, B=32 H=64 L=8K 138.7 us with 2, 141.0 with 3, 144.0 with 4), 44 KB of query and P operands. The
kernel it replaced transposed each page into a channel-major shared tile (182 us there; perf-notes
20). ABLATE bits as in `gluon_wide` (1 drops the V^T operand), for `scripts/probe_gluon_decode.py`.

FAST (the launcher's choice) is the same arithmetic in fewer instructions: no position test on pages
that every row sees whole, the e4m3 conversion's own saturation (cvt.satfinite) instead of a clamp,
q / sigma and max f / 448 by a reciprocal and Markstein's fma correction (the correctly rounded
quotient), and the score scaling as mul.rn so that it is not contracted into the softmax's x - m.
H200, B=32 H=64 L=8K: 140.2 -> 125.9 us here, 124.7 -> 117.7 in `gluon_narrow8`
(results/bench/h200_native8; the division by 448 came later: 117.5 -> 116.0, results/bench/h200_trace).
"""

from __future__ import annotations

from .box_views import slot_view_bases, v_load_bases, vt_store_bases
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
        LN2,
        NEW_REINTERPRET,
        _fewest_visible,
        _page_p_native,
        _query_operands,
        _row_state,
        _split_run,
        cta_barrier,
        tma_load,
    )

    BM_ROWS = gl.constexpr(GLUON_WIDE_ROWS)
    # a page slot (four 128-channel boxes, stacked) read as V^T [512 m, 64 tokens] (box_views.pv8_channel),
    # with rows m bits 3, 7 and tokens bits 0, 1 trading places (undone by _transpose4x4)
    SLOT_VIEW_T = gl.constexpr(gl.SharedLinearLayout(offset_bases=slot_view_bases(transposed=True)))
    # wgmma's e4m3 A-operand layout for O^T [512, 64] (8 warps along M: rows m bits 0-2 the lane group,
    # 4-6 the warp; a 32-bit register holds tokens bits 0-1) with its registers reordered: m bit 8 next
    # to the bytes (so with SLOT_VIEW_T a thread loads 8 contiguous bytes per token row), then m bits 3, 7
    # (the four registers _transpose4x4 transposes with the bytes). Back to the MMA's own order is a
    # renaming of whole registers.
    V_LOAD = gl.constexpr(gl.DistributedLinearLayout(*v_load_bases(3), block_bases=[], shape=[512, 64]))
    # the PV accumulator's layout in physical channel order (after _store_vt's reshape), registers
    # reordered so each thread's 8 contiguous channels of a row come first (two 16-byte stores)
    VT_STORE = gl.constexpr(gl.DistributedLinearLayout(*vt_store_bases(3, 64), block_bases=[], shape=[512, 64]))


if HAVE_GLUON:

    @gluon.jit
    def _issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, slot, page, lat_page_rows, rope_page_rows, pred,
                    NBOX: gl.constexpr, BOXW: gl.constexpr, PAGE: gl.constexpr):
        """One page into slot `slot`: its NBOX latent boxes stacked in lat4[slot] (rows k * PAGE..) and its
        RoPE rows."""
        bar = bars.index(slot)
        lat_row = (page * lat_page_rows).to(gl.int32)
        mbarrier.expect(bar, NBOX * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=pred)
        for k in gl.static_range(NBOX):
            tma_load(lat_desc, [lat_row, k * BOXW], bar, lat4.index(slot).slice(k * PAGE, PAGE, dim=0), pred=pred)
        tma_load(rope_desc, [(page * rope_page_rows).to(gl.int32), 0], bar, rope_smem.index(slot), pred=pred)

    @gluon.jit
    def _native8_smem(lat_desc, rope_desc, bt_row, n_run, lat_page_rows, rope_page_rows, STAGES: gl.constexpr,
                      NBOX: gl.constexpr, BOXW: gl.constexpr, PAGE: gl.constexpr, BN: gl.constexpr, R: gl.constexpr,
                      D: gl.constexpr, NO_TMA: gl.constexpr):
        """The native FP8 kernels' shared memory: STAGES page slots of 40 KB (latent boxes stacked, RoPE
        rows), the e4m3 query [BN, R], the RoPE query, P^ [BN, 64] and the slots' barriers; the run's first
        STAGES pages put in flight."""
        lat4 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, NBOX * PAGE, BOXW], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, R],
                                           gl.NVMMASharedLayout.get_default_for([BN, R], gl.float8e4nv))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, PAGE],
                                           gl.NVMMASharedLayout.get_default_for([BN, PAGE], gl.float8e4nv))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES):
            page = gl.load(bt_row + s, mask=s < n_run, other=0).to(gl.int64)
            _issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, s, page, lat_page_rows, rope_page_rows,
                        (s < n_run) & (not NO_TMA), NBOX, BOXW, PAGE)
        return lat4, rope_smem, q_smem, qr_smem, p_smem, bars

    @gluon.jit
    def _zero_tail_slot(lat4, slot, base, length, NBOX: gl.constexpr, PAGE: gl.constexpr, cvt_l: gl.constexpr):
        """A request's last page: the codes of tokens past its length -> 0 in the slot, before any product
        reads it (they may be NaN, and P = 0 does not cancel a NaN)."""
        keep = gl.expand_dims((base + gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))) < length, 1)
        for k in gl.static_range(NBOX):
            box = lat4.index(slot).slice(k * PAGE, PAGE, dim=0)
            c8 = box.load(cvt_l)
            box.store(gl.where(keep, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True))

    @gluon.jit
    def _page_start(lat4, bars, bt_row, SCALE, it, p_lo, n_run, length, offs_t, stride_sp, stride_st,
                    STAGES: gl.constexpr, NBOX: gl.constexpr, PAGE: gl.constexpr, NO_TMA: gl.constexpr,
                    cvt_l: gl.constexpr, after=0, AHEAD: gl.constexpr = False):
        """Page `it` of the run: waits for its slot, zeroes a request's last page's tail codes there (before
        any product reads them), and returns (slot, first token, the page to refill the slot with, the next
        page's token scales, `after` for the next call). AHEAD: `after` is the next page's index, loaded by
        the previous call, so the scales' address does not wait on a block-table load; the page after that
        is loaded here for the next call (with two slots it is also the refill)."""
        slot = it % STAGES
        base = (p_lo + it) * PAGE
        if AHEAD:
            page_after = after
            after = gl.load(bt_row + it + 2, mask=it + 2 < n_run, other=0).to(gl.int64)
            if STAGES == 2:
                page_refill = after
            else:
                page_refill = gl.load(bt_row + it + STAGES, mask=it + STAGES < n_run, other=0).to(gl.int64)
        else:
            page_refill = gl.load(bt_row + it + STAGES, mask=it + STAGES < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
        s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                         mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
        mbarrier.wait(bars.index(slot), (it // STAGES) & 1, pred=not NO_TMA)
        if base + PAGE > length:
            _zero_tail_slot(lat4, slot, base, length, NBOX, PAGE, cvt_l)
            fence_async_shared()  # the QK MMAs read the slot through the async proxy
            cta_barrier()
        return slot, base, page_refill, s_next, after

    @gluon.jit
    def _transpose4x4(v8):
        """Two 4 x 4 byte transposes per 8 registers (eight prmt): register 2 r + c, byte b -> register
        2 b + c, byte r, for 32 consecutive e4m3 codes in register order (`box_views.v_load_bases`: bytes =
        tokens bits 0-1, c = m's top bit, r = the two m bits the transposed view traded with the bytes;
        `box_views.transposed_register`)."""
        return gl.inline_asm_elementwise(
            """{ .reg .b32 t<8>;
            prmt.b32 t0, $8, $10, 0x5140; prmt.b32 t1, $8, $10, 0x7362;
            prmt.b32 t2, $12, $14, 0x5140; prmt.b32 t3, $12, $14, 0x7362;
            prmt.b32 $0, t0, t2, 0x5410; prmt.b32 $2, t0, t2, 0x7632;
            prmt.b32 $4, t1, t3, 0x5410; prmt.b32 $6, t1, t3, 0x7632;
            prmt.b32 t4, $9, $11, 0x5140; prmt.b32 t5, $9, $11, 0x7362;
            prmt.b32 t6, $13, $15, 0x5140; prmt.b32 t7, $13, $15, 0x7362;
            prmt.b32 $1, t4, t6, 0x5410; prmt.b32 $3, t4, t6, 0x7632;
            prmt.b32 $5, t5, t7, 0x5410; prmt.b32 $7, t5, t7, 0x7632; }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r", [v8.to(gl.int8, bitcast=True)], dtype=gl.int8,
            is_pure=True, pack=32)

    @gluon.jit
    def _vt_operand(boxes, VIEW: gl.constexpr, LOAD: gl.constexpr, M: gl.constexpr, PAGE: gl.constexpr,
                    a_l: gl.constexpr, ABLATE: gl.constexpr):
        """Stacked TMA boxes (a slot, or a pair of its boxes) as PV's A operand V^T [M, PAGE] in registers
        (e4m3, wgmma layout a_l): 8-byte loads through the transposed view VIEW in the layout LOAD
        (`box_views.slot_view_bases`, `v_load_bases`), a 4 x 4 byte transpose per four registers, whose
        result is already the MMA's layout up to register names. ABLATE 1: zeros (timing probes only)."""
        if ABLATE & 1:
            return gl.zeros([M, PAGE], gl.float8e4nv, a_l)
        if NEW_REINTERPRET:
            view = boxes.reinterpret(gl.float8e4nv, [M, PAGE], VIEW)
        else:
            view = boxes._reinterpret(gl.float8e4nv, [M, PAGE], VIEW)
        v8 = _transpose4x4(view.load(LOAD))
        return gl.convert_layout(v8.to(gl.float8e4nv, bitcast=True), a_l)

    @gluon.jit
    def _store_vt(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, n_rows, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL: gl.constexpr, BM: gl.constexpr, o_l: gl.constexpr,
                  W: gl.constexpr = 8, st_l: gl.constexpr = VT_STORE, CH0: gl.constexpr = 0,
                  STORE_LSE: gl.constexpr = True):
        """The epilogue of O^T [64 W m, BM rows] (`pv8_channel` order, W warps along M, output channels CH0..):
        out = O / l, lse = m + log2(l pi) (rows that saw nothing: 0 and -inf). m = 16 W j + 16 w + 8 e + g
        is channel 64 w + 8 g + 2 j + e, so reshaping m to (j, w, e, g) and permuting to (w, g, j, e) puts
        the channels in order without moving data; st_l then only renames registers so that each thread's
        8 contiguous channels of a row are consecutive (16-byte stores, whole sectors per warp)."""
        orow_l: gl.constexpr = gl.SliceLayout(0, o_l)
        NM: gl.constexpr = 64 * W
        l_o = gl.convert_layout(l_i, orow_l)
        empty = l_o == 0.0
        out = acc / gl.expand_dims(gl.where(empty, 1.0, l_o), 0)
        if STORE_LSE:
            m_o = gl.convert_layout(m_i, orow_l)
            lse = gl.where(empty, float("-inf"),
                           m_o + gl.log2(gl.where(empty, 1.0, l_o * gl.convert_layout(pi_i, orow_l))))
            if LSE_NATURAL:
                lse = lse * LN2
            rows = row0 + gl.arange(0, BM, layout=orow_l)
            gl.store(LSE_PART + b64 * stride_lb + rows * stride_lm + split * stride_ls, lse, mask=rows < n_rows)
        out = gl.reshape(gl.permute(gl.reshape(out, [4, W, 2, 8, BM]), [1, 3, 0, 2, 4]), [NM, BM])
        out = gl.convert_layout(out, st_l)  # registers renamed only
        offs_c = CH0 + gl.arange(0, NM, layout=gl.SliceLayout(1, st_l))
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, st_l))
        o_ptr = (O_PART + b64 * stride_ob + split * stride_os + gl.expand_dims(rows * stride_om, 0)
                 + gl.expand_dims(offs_c, 1))
        gl.store(o_ptr, out, mask=gl.expand_dims(rows < n_rows, 0))

    @gluon.jit
    def _mla_decode_gluon_wide8(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        STAGES: gl.constexpr = 2, CHAINS: gl.constexpr = 2, ABLATE: gl.constexpr = 0,
        FAST: gl.constexpr = False, AHEAD: gl.constexpr = False,
    ):
        """Native FP8 MMAs with PV swapped: O^T [R, 64 rows] += V^T P^T, V^T read from the TMA slot into
        registers (no transposed tile), P^ [rows, tokens] from shared memory as the K-major B operand."""
        gl.static_assert(num_warps == 8)
        gl.static_assert(R == 512)
        gl.static_assert(PAGE == 64)
        gl.static_assert((CHAINS == 1) | (CHAINS == 2))
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
        length, p_lo, n_run = _split_run(LENS, b, split, NSPLIT, PAGE)

        NO_TMA: gl.constexpr = ABLATE & 16 != 0
        bt_row = BT + b64 * stride_bt + p_lo
        lat4, rope_smem, q_smem, qr_smem, p_smem, bars = _native8_smem(
            lat_desc, rope_desc, bt_row, n_run, lat_page_rows, rope_page_rows, STAGES, NBOX, BOXW, PAGE, BM, R, D,
            NO_TMA)

        sigma = _query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BM, True,
                                q_l, True, False, FAST)
        limit, coef, m_i, l_i, pi_i, pi_max = _row_state(length, row0, sigma, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        lim_min = _fewest_visible(limit, row0, S * H, BM, srow_l)  # (FAST)
        acc = gl.zeros([R, BM], gl.float32, o_l)  # O^T, rows in pv8_channel order
        zero_s = gl.zeros([BM, PAGE], gl.float32, s_l)
        zero_s8 = gl.zeros([BM, PAGE], gl.float32, s8_l)
        zero_sm = gl.zeros([BM, PAGE], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)
        fence_async_shared()
        cta_barrier()

        s_cur = gl.load(SCALE + gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64) * stride_sp
                        + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length, other=0.0)
        after = gl.load(bt_row + 1, mask=n_run > 1, other=0).to(gl.int64)  # (AHEAD) the next page's index
        for it in range(n_run):
            slot, base, page_refill, s_next, after = _page_start(lat4, bars, bt_row, SCALE, it, p_lo, n_run, length,
                                                                 offs_t, stride_sp, stride_st, STAGES, NBOX, PAGE,
                                                                 NO_TMA, cvt_l, after, AHEAD)
            page_smem = lat4.index(slot)

            # scores [BM, PAGE]: NoPE (e4m3 x e4m3, CHAINS fp32 chains) + RoPE (bf16), issued asynchronously
            if ABLATE & 2 == 0:
                KC: gl.constexpr = R // CHAINS
                k0 = warpgroup_mma(q_smem.slice(0, BOXW, dim=1), page_smem.slice(0, PAGE, dim=0).permute((1, 0)),
                                   zero_s8, use_acc=False, is_async=True)
                for k in gl.static_range(1, KC // BOXW):
                    k0 = warpgroup_mma(q_smem.slice(k * BOXW, BOXW, dim=1),
                                       page_smem.slice(k * PAGE, PAGE, dim=0).permute((1, 0)), k0, is_async=True)
                if CHAINS == 2:
                    k1 = warpgroup_mma(q_smem.slice(KC, BOXW, dim=1),
                                       page_smem.slice((KC // BOXW) * PAGE, PAGE, dim=0).permute((1, 0)), zero_s8,
                                       use_acc=False, is_async=True)
                    for k in gl.static_range(KC // BOXW + 1, NBOX):
                        k1 = warpgroup_mma(q_smem.slice(k * BOXW, BOXW, dim=1),
                                           page_smem.slice(k * PAGE, PAGE, dim=0).permute((1, 0)), k1, is_async=True)
                rd = warpgroup_mma(qr_smem, rope_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            if ABLATE & 2:  # (timing probes only, scripts/probe_gluon_decode.py: wrong results)
                qk = zero_s + it
            elif CHAINS == 1:
                k0, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, rd))
                qk = gl.convert_layout(k0, s_l) + rd
            else:
                k0, k1, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, rd))
                qk = gl.convert_layout(k0 + k1, s_l) + rd  # the same registers (no data movement)
            # V^T after the QK wait: loaded under the QK MMAs it raised register pressure (H200, B=32 H=64
            # L=8K: 157.4 vs 141.0 us, perf-notes 20)
            vt = _vt_operand(page_smem, SLOT_VIEW_T, V_LOAD, R, PAGE, a_o, ABLATE)
            cta_barrier()  # every warp has read the slot (QK and V^T): refill it
            _issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, slot, page_refill, lat_page_rows, rope_page_rows,
                        (it + STAGES < n_run) & (not NO_TMA), NBOX, BOXW, PAGE)

            raw = gl.convert_layout(qk, sm_l)
            if ABLATE & 8:
                p8 = raw.to(gl.float8e4nv)
                rescale = gl.full([BM], 1.0, gl.float32, srow_l)
            else:
                p8, rescale, m_i, l_i, pi_i, pi_max = _page_p_native(raw, s_cur, coef, base + offs_t, limit, m_i, l_i,
                                                                     pi_i, pi_max, zero_sm, base + PAGE <= lim_min,
                                                                     P_DIV, 1, FAST)
            s_cur = s_next
            p_smem.store(p8)  # P^ [rows, tokens]: tokens contiguous, the K-major B operand P^T
            fence_async_shared()
            cta_barrier()
            beta = gl.expand_dims(gl.convert_layout(rescale, orow_l), 0)
            if ABLATE & 4:
                acc = acc * beta
            else:
                acc = warpgroup_mma(vt, p_smem.permute((1, 0)), acc * beta, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        _store_vt(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL, BM, o_l)
