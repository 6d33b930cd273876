"""The 64-row decode page loop with native FP8 MMAs (opt-in `fp8_mma=True`), Gluon, Hopper only.

SnapMLA's own design: both products run on the tensor cores' e4m3 path, at twice the fp16 rate, and
no page is ever widened to fp16. `gluon_wide.py` (the default, exact) widens every page to an fp16
tile that both of its fp16 MMAs read; past 16 rows that costs it its speed (docs/perf-notes.md 13).

  * one program = 64 query rows x one split, 8 warps; the two warpgroups split N as in `gluon_wide`;
  * QK: q^ (e4m3, 32 KB in shared memory) times the page's TMA boxes as they landed, in CHAINS
    accumulation chains summed in fp32 (Hopper's FP8 MMA keeps ~14 bits inside a chain; DeepSeek-V3
    promotes every 128 products). Two chains of 256 channels, the launcher's choice: one 512-long
    chain measured LSE errors up to 0.016 (H200 check), two at most 7.7e-3, 10 % slower, and four
    would need 32 more registers than the 255 the kernel already uses. RoPE stays a bf16 MMA;
  * PV: P^ (e4m3, `_page_p`'s fp8_scale_fused arithmetic) from registers times V^T. An 8-bit MMA
    operand must be K-major, and K is the page's token axis, so each page is transposed once into a
    channel-major e4m3 tile [r, 64] (32 KB; tokens past the request's length become zeros there, so
    0 x NaN codes never reach the accumulator). The next page is transposed while the tensor cores run
    this page's PV (two transposed tiles);
  * the accumulator carries across pages inside the MMA (there is no room for a second 128-register
    copy): the result differs from the exact kernels by the FP8 MMA's accumulation rounding (tested
    at 3e-3 relative; the exact kernels are the default).

Shared memory: two TMA slots of 40 KB, 2 x 32 KB transposed tiles, 40 KB of query operands. A
page's TMA is issued as soon as its slot's QK has finished (one page-time of latency hiding with two
slots). ABLATE bits as in `gluon_wide` (1 now drops the transpose), for `scripts/probe_gluon_decode.py`.
"""

from __future__ import annotations

from .box_views import slot_view_bases
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
        _issue_page,
        _page_p,
        _query_operands,
        _row_state,
        _split_run,
        cta_barrier,
        tma_load,
    )
    from .gluon_wide import _store_rows

    BM_ROWS = gl.constexpr(GLUON_WIDE_ROWS)
    # a page slot (four 128-channel boxes, stacked) read as V^T [512 m, 64 tokens] (box_views.pv8_channel),
    # with rows m bits 3, 7 and tokens bits 0, 1 trading places (undone by _transpose4x4)
    SLOT_VIEW_T = gl.constexpr(gl.SharedLinearLayout(offset_bases=slot_view_bases(transposed=True)))
    # wgmma's e4m3 A-operand layout for O^T [512, 64] (8 warps along M: rows m bits 0-2 the lane group,
    # 4-6 the warp; a 32-bit register holds tokens bits 0-1) with its registers reordered: m bit 8 next
    # to the bytes (so with SLOT_VIEW_T a thread loads 8 contiguous bytes per token row), then m bits 3, 7
    # (the four registers _transpose4x4 transposes with the bytes). Back to the MMA's own order is a
    # renaming of whole registers.
    V_LOAD = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [256, 0], [8, 0], [128, 0], [0, 16], [0, 32]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0], [64, 0]],
        block_bases=[], shape=[512, 64]))
    # the PV accumulator's layout in physical channel order (after _store_vt's reshape), registers
    # reordered so each thread's 8 contiguous channels of a row come first (two 16-byte stores)
    VT_STORE = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [0, 1], [0, 8], [0, 16], [0, 32]],
        lane_bases=[[0, 2], [0, 4], [8, 0], [16, 0], [32, 0]], warp_bases=[[64, 0], [128, 0], [256, 0]],
        block_bases=[], shape=[512, 64]))


if HAVE_GLUON:

    @gluon.jit
    def _transpose_page(lat_smem, box0, vt, base, length, NBOX: gl.constexpr, BOXW: gl.constexpr,
                        PAGE: gl.constexpr, tr_l: gl.constexpr):
        """The page's e4m3 boxes [PAGE, BOXW] (token-major, as the TMA wrote them) -> the channel-major tile
        vt [NBOX * BOXW, PAGE]; on a request's last page the tokens past its length become zeros."""
        offs_t = gl.arange(0, PAGE, layout=gl.SliceLayout(1, tr_l))
        tail = base + PAGE > length
        keep = gl.expand_dims((base + offs_t) < length, 1)
        for k in gl.static_range(NBOX):
            c8 = lat_smem.index(box0 + k).load(tr_l)
            if tail:
                c8 = gl.where(keep, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True)
            vt.slice(k * BOXW, BOXW, dim=0).store(gl.permute(c8, [1, 0]))

    @gluon.jit
    def _mla_decode_gluon_wide8(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        CHAINS: gl.constexpr = 2, SM_ROWS: gl.constexpr = True, ABLATE: gl.constexpr = 0,
    ):
        gl.static_assert(num_warps == 8)
        BM: gl.constexpr = BM_ROWS
        BOXW: gl.constexpr = 128
        NBOX: gl.constexpr = R // BOXW
        gl.static_assert((CHAINS == 1) | (CHAINS == 2))

        # ---- layouts: the two warpgroups split N (S: tokens, O: channels); 8-bit MMAs step K by 32
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, PAGE // 2, 16])
        s8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, PAGE // 2, 32])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, R // 2, 32])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
        if SM_ROWS:  # each warp owns 8 whole rows: the softmax's reductions are shuffles
            sm_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        else:
            sm_l: gl.constexpr = s_l
        srow_l: gl.constexpr = gl.SliceLayout(1, sm_l)
        stok_l: gl.constexpr = gl.SliceLayout(0, sm_l)
        # the transpose's register tile: 4 x 4 codes per thread, loaded as 4-byte runs of a token row and
        # stored as 4-byte runs of a channel row. H200: the fastest of four layouts measured, e.g. 181 us at
        # B=32 H=64 L=8K against 250 for conflict-free 8-byte stores with byte-wide loads (perf-notes 16, 18)
        tr_l: gl.constexpr = gl.BlockedLayout([4, 4], [4, 8], [2, 4], [1, 0])
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

        row0 = gl.program_id(0) * BM
        b = gl.program_id(1)
        split = gl.program_id(2)
        b64 = b.to(gl.int64)
        length, p_lo, n_run = _split_run(LENS, b, split, NSPLIT, PAGE)

        # ---- shared memory: RAW TMA slots (e4m3 boxes + bf16 RoPE rows), two transposed tiles, the query.
        # Three slots would need 233.5 KB, over the 227 KB an SM has.
        RAW: gl.constexpr = 2
        lat_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW * NBOX, PAGE, BOXW], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [RAW, PAGE, D], rope_desc.layout)
        vt_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, R, PAGE],
                                            gl.NVMMASharedLayout.get_default_for([R, PAGE], gl.float8e4nv))
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, R],
                                           gl.NVMMASharedLayout.get_default_for([BM, R], gl.float8e4nv))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16))
        bars = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(RAW):
            mbarrier.init(bars.index(s), count=1)

        NO_TMA: gl.constexpr = ABLATE & 16 != 0
        bt_row = BT + b64 * stride_bt + p_lo
        for s in gl.static_range(RAW):
            page = gl.load(bt_row + s, mask=s < n_run, other=0).to(gl.int64)
            _issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, s, page, lat_page_rows, rope_page_rows,
                        (s < n_run) & (not NO_TMA), NBOX, BOXW, 0)

        sigma = _query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BM, True,
                                q_l)
        limit, coef, m_i, l_i, pi_i, pi_max = _row_state(length, row0, sigma, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
        acc = gl.zeros([BM, R], gl.float32, o_l)
        zero_s = gl.zeros([BM, PAGE], gl.float32, s_l)
        zero_s8 = gl.zeros([BM, PAGE], gl.float32, s8_l)
        zero_sm = gl.zeros([BM, PAGE], gl.float32, sm_l)
        offs_t = gl.arange(0, PAGE, layout=stok_l)

        # page 0 transposed before the loop; each iteration transposes the next page under its PV
        page0 = gl.load(bt_row, mask=n_run > 0, other=0).to(gl.int64)
        s_cur = gl.load(SCALE + page0 * stride_sp + offs_t * stride_st, mask=(p_lo * PAGE + offs_t) < length,
                        other=0.0)
        mbarrier.wait(bars.index(0), 0, pred=(n_run > 0) & (not NO_TMA))
        if (n_run > 0) & (ABLATE & 1 == 0):
            _transpose_page(lat_smem, 0, vt_smem.index(0), p_lo * PAGE, length, NBOX, BOXW, PAGE, tr_l)
        fence_async_shared()
        cta_barrier()

        for it in range(n_run):
            slot = it % RAW
            buf = it % 2
            base = (p_lo + it) * PAGE
            page_next = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            page_refill = gl.load(bt_row + it + RAW, mask=it + RAW < n_run, other=0).to(gl.int64)
            s_next = gl.load(SCALE + page_next * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
            if it > 0:  # page 0 was waited for before the loop
                mbarrier.wait(bars.index(slot), (it // RAW) & 1, pred=not NO_TMA)

            # scores [BM, PAGE]: NoPE (e4m3 x e4m3, one fp32 sum per 128-channel box) + RoPE (bf16)
            if ABLATE & 2:  # (timing probes only, scripts/probe_gluon_decode.py: wrong results)
                qk = zero_s + it
            else:
                # CHAINS accumulators over R / CHAINS channels each, summed in fp32
                KC: gl.constexpr = R // CHAINS
                k0 = warpgroup_mma(q_smem.slice(0, BOXW, dim=1), lat_smem.index(slot * NBOX).permute((1, 0)),
                                   zero_s8, use_acc=False, is_async=True)
                for k in gl.static_range(1, KC // BOXW):
                    k0 = warpgroup_mma(q_smem.slice(k * BOXW, BOXW, dim=1),
                                       lat_smem.index(slot * NBOX + k).permute((1, 0)), k0, is_async=True)
                if CHAINS == 1:
                    rd = warpgroup_mma(qr_smem, rope_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
                    k0, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, rd))
                    qk = gl.convert_layout(k0, s_l) + rd
                else:
                    k1 = warpgroup_mma(q_smem.slice(KC, BOXW, dim=1),
                                       lat_smem.index(slot * NBOX + KC // BOXW).permute((1, 0)), zero_s8,
                                       use_acc=False, is_async=True)
                    for k in gl.static_range(KC // BOXW + 1, NBOX):
                        k1 = warpgroup_mma(q_smem.slice(k * BOXW, BOXW, dim=1),
                                           lat_smem.index(slot * NBOX + k).permute((1, 0)), k1, is_async=True)
                    rd = warpgroup_mma(qr_smem, rope_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
                    k0, k1, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, rd))
                    qk = gl.convert_layout(k0 + k1, s_l) + rd  # the same registers (no data movement)
            # the slot's page is read by both warpgroups' QK (its transpose happened last iteration): refill it
            cta_barrier()
            _issue_page(lat_desc, rope_desc, lat_smem, rope_smem, bars, slot, page_refill, lat_page_rows,
                        rope_page_rows, (it + RAW < n_run) & (not NO_TMA), NBOX, BOXW, 0)

            raw = gl.convert_layout(qk, sm_l)
            if ABLATE & 8:
                p8 = raw.to(gl.float8e4nv)
                rescale = gl.full([BM], 1.0, gl.float32, srow_l)
            else:
                p8, rescale, m_i, l_i, pi_i, pi_max = _page_p(raw, s_cur, coef, base + offs_t, limit, m_i, l_i, pi_i,
                                                              pi_max, zero_sm, P_DIV, 1)
            s_cur = s_next
            # O [BM, R] += P^ V: e4m3 x e4m3 from the transposed tile, waited for within the page
            beta = gl.expand_dims(gl.convert_layout(rescale, gl.SliceLayout(1, o_l)), 1)
            if ABLATE & 4:
                acc = acc * beta + gl.convert_layout(gl.sum(p8.to(gl.float32), 1), gl.SliceLayout(1, o_l))[:, None]
            else:
                acc = warpgroup_mma(gl.convert_layout(p8, p_l), vt_smem.index(buf).permute((1, 0)), acc * beta,
                                    is_async=True)
            # while the tensor cores run PV: the next page -> the other transposed tile
            if it + 1 < n_run:
                mbarrier.wait(bars.index((it + 1) % RAW), ((it + 1) // RAW) & 1, pred=not NO_TMA)
            if (it + 1 < n_run) & (ABLATE & 1 == 0):
                _transpose_page(lat_smem, ((it + 1) % RAW) * NBOX, vt_smem.index(1 - buf), base + PAGE, length, NBOX,
                                BOXW, PAGE, tr_l)
            fence_async_shared()
            if ABLATE & 4 == 0:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            cta_barrier()  # the next tile is written by all warps before either warpgroup's PV reads it

        for s in gl.static_range(RAW):
            mbarrier.invalidate(bars.index(s))
        _store_rows(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, S * H, stride_ob, stride_om, stride_os,
                    stride_lb, stride_lm, stride_ls, R, LSE_NATURAL, BM, o_l)


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
    def _zero_tail_slot(lat4, slot, base, length, NBOX: gl.constexpr, PAGE: gl.constexpr, cvt_l: gl.constexpr):
        """A request's last page: the codes of tokens past its length -> 0 in the slot, before any product
        reads it (they may be NaN, and P = 0 does not cancel a NaN)."""
        keep = gl.expand_dims((base + gl.arange(0, PAGE, layout=gl.SliceLayout(1, cvt_l))) < length, 1)
        for k in gl.static_range(NBOX):
            box = lat4.index(slot).slice(k * PAGE, PAGE, dim=0)
            c8 = box.load(cvt_l)
            box.store(gl.where(keep, c8.to(gl.int8, bitcast=True), 0).to(gl.float8e4nv, bitcast=True))

    @gluon.jit
    def _transpose4x4(v8):
        """Two 4 x 4 byte transposes per 8 registers (eight prmt): register 2 r + c, byte b -> register
        2 b + c, byte r, for 32 consecutive e4m3 codes in register order (V_LOAD: bytes = tokens bits 0-1,
        c = m bit 8, r = m bits 3, 7)."""
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
    def _vt_operand(lat4, slot, base, length, PAGE: gl.constexpr, a_l: gl.constexpr, ABLATE: gl.constexpr):
        """The slot's page as PV's A operand V^T [512 m, PAGE tokens] in registers (e4m3, wgmma layout
        a_l): 8-byte loads through SLOT_VIEW_T, a 4 x 4 byte transpose per four registers (whose result is
        already the MMA's layout, up to register names). ABLATE 1: zeros (timing probes only)."""
        if ABLATE & 1:
            return gl.zeros([512, PAGE], gl.float8e4nv, a_l)
        if NEW_REINTERPRET:
            view = lat4.index(slot).reinterpret(gl.float8e4nv, [512, PAGE], SLOT_VIEW_T)
        else:
            view = lat4.index(slot)._reinterpret(gl.float8e4nv, [512, PAGE], SLOT_VIEW_T)
        v8 = _transpose4x4(view.load(V_LOAD))
        return gl.convert_layout(v8.to(gl.float8e4nv, bitcast=True), a_l)

    @gluon.jit
    def _store_vt(acc, m_i, l_i, pi_i, O_PART, LSE_PART, b64, split, row0, n_rows, stride_ob, stride_om, stride_os,
                  stride_lb, stride_lm, stride_ls, LSE_NATURAL: gl.constexpr, BM: gl.constexpr, o_l: gl.constexpr):
        """The epilogue of O^T [512 m, BM rows] (pv8_channel order): out = O / l, lse = m + log2(l pi) (rows
        that saw nothing: 0 and -inf). m = 128 j + 16 w + 8 e + g is channel 64 w + 8 g + 2 j + e, so
        reshaping m to (j, w, e, g) and permuting to (w, g, j, e) puts the channels in order without moving
        data: each thread's 8 values per row are contiguous (vector stores, whole sectors per warp)."""
        orow_l: gl.constexpr = gl.SliceLayout(0, o_l)
        m_o = gl.convert_layout(m_i, orow_l)
        l_o = gl.convert_layout(l_i, orow_l)
        empty = l_o == 0.0
        out = acc / gl.expand_dims(gl.where(empty, 1.0, l_o), 0)
        lse = gl.where(empty, float("-inf"), m_o + gl.log2(gl.where(empty, 1.0, l_o * gl.convert_layout(pi_i, orow_l))))
        if LSE_NATURAL:
            lse = lse * LN2
        rows = row0 + gl.arange(0, BM, layout=orow_l)
        gl.store(LSE_PART + b64 * stride_lb + rows * stride_lm + split * stride_ls, lse, mask=rows < n_rows)
        out = gl.reshape(gl.permute(gl.reshape(out, [4, 8, 2, 8, BM]), [1, 3, 0, 2, 4]), [512, BM])
        out = gl.convert_layout(out, VT_STORE)  # registers renamed only
        offs_c = gl.arange(0, 512, layout=gl.SliceLayout(1, VT_STORE))
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, VT_STORE))
        o_ptr = (O_PART + b64 * stride_ob + split * stride_os + gl.expand_dims(rows * stride_om, 0)
                 + gl.expand_dims(offs_c, 1))
        gl.store(o_ptr, out, mask=gl.expand_dims(rows < n_rows, 0))

    @gluon.jit
    def _mla_decode_gluon_wide8v(
        Q, lat_desc, rope_desc, SCALE, BT, LENS, O_PART, LSE_PART, sm_scale_log2,
        stride_qb, stride_qs, stride_qh, lat_page_rows, rope_page_rows, stride_sp, stride_st, stride_bt,
        stride_ob, stride_om, stride_os, stride_lb, stride_lm, stride_ls,
        H, NSPLIT,
        S: gl.constexpr, R: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
        CAUSAL: gl.constexpr, P_DIV: gl.constexpr, LSE_NATURAL: gl.constexpr, num_warps: gl.constexpr,
        STAGES: gl.constexpr = 3, CHAINS: gl.constexpr = 2, SM_ROWS: gl.constexpr = True, EARLY_V: gl.constexpr = False,
        ABLATE: gl.constexpr = 0,
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

        # QK as in _mla_decode_gluon_wide8 (the warpgroups split the tokens); PV: 8 warps along M = channels
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, PAGE // 2, 16])
        s8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, PAGE // 2, 32])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 32])
        a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
        if SM_ROWS:
            sm_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        else:
            sm_l: gl.constexpr = s_l
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

        # shared memory: STAGES slots of 40 KB (no transposed tiles), the e4m3 query (32 KB), RoPE query, P^
        lat4 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, NBOX * PAGE, BOXW], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D], rope_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, R],
                                           gl.NVMMASharedLayout.get_default_for([BM, R], gl.float8e4nv))
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16))
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, PAGE],
                                           gl.NVMMASharedLayout.get_default_for([BM, PAGE], gl.float8e4nv))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)

        NO_TMA: gl.constexpr = ABLATE & 16 != 0
        bt_row = BT + b64 * stride_bt + p_lo
        for s in gl.static_range(STAGES):
            page = gl.load(bt_row + s, mask=s < n_run, other=0).to(gl.int64)
            _issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, s, page, lat_page_rows, rope_page_rows,
                        (s < n_run) & (not NO_TMA), NBOX, BOXW, PAGE)

        sigma = _query_operands(Q, q_smem, qr_smem, b64, row0, stride_qb, stride_qs, stride_qh, H, S, R, D, BM, True,
                                q_l)
        limit, coef, m_i, l_i, pi_i, pi_max = _row_state(length, row0, sigma, sm_scale_log2, H, S, BM, CAUSAL, srow_l)
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
            slot = it % STAGES
            base = (p_lo + it) * PAGE
            page_refill = gl.load(bt_row + it + STAGES, mask=it + STAGES < n_run, other=0).to(gl.int64)
            page_after = gl.load(bt_row + it + 1, mask=it + 1 < n_run, other=0).to(gl.int64)
            s_next = gl.load(SCALE + page_after * stride_sp + offs_t * stride_st,
                             mask=(it + 1 < n_run) & (base + PAGE + offs_t < length), other=0.0)
            mbarrier.wait(bars.index(slot), (it // STAGES) & 1, pred=not NO_TMA)
            page_smem = lat4.index(slot)
            if base + PAGE > length:
                _zero_tail_slot(lat4, slot, base, length, NBOX, PAGE, cvt_l)
                fence_async_shared()  # the QK MMAs read the slot through the async proxy
                cta_barrier()

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
            if EARLY_V:  # this page's V^T into registers while the tensor cores run QK
                vt = _vt_operand(lat4, slot, base, length, PAGE, a_o, ABLATE)
            if ABLATE & 2:  # (timing probes only, scripts/probe_gluon_decode.py: wrong results)
                qk = zero_s + it
            elif CHAINS == 1:
                k0, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, rd))
                qk = gl.convert_layout(k0, s_l) + rd
            else:
                k0, k1, rd = warpgroup_mma_wait(num_outstanding=0, deps=(k0, k1, rd))
                qk = gl.convert_layout(k0 + k1, s_l) + rd  # the same registers (no data movement)
            if not EARLY_V:
                vt = _vt_operand(lat4, slot, base, length, PAGE, a_o, ABLATE)
            cta_barrier()  # every warp has read the slot (QK and V^T): refill it
            _issue_slot(lat_desc, rope_desc, lat4, rope_smem, bars, slot, page_refill, lat_page_rows, rope_page_rows,
                        (it + STAGES < n_run) & (not NO_TMA), NBOX, BOXW, PAGE)

            raw = gl.convert_layout(qk, sm_l)
            if ABLATE & 8:
                p8 = raw.to(gl.float8e4nv)
                rescale = gl.full([BM], 1.0, gl.float32, srow_l)
            else:
                p8, rescale, m_i, l_i, pi_i, pi_max = _page_p(raw, s_cur, coef, base + offs_t, limit, m_i, l_i, pi_i,
                                                              pi_max, zero_sm, P_DIV, 1)
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
