"""The snapmla page ring without the page's arithmetic: how fast a TMA ring structure can stream the cache.

A measuring instrument, not a decode kernel (`scripts/probe_stream.py` times it). The FP8 narrow kernel
(`gluon.narrow`, <= 16 query rows) reads 40 KB pages (four [64, 128] e4m3 boxes and the [64, 64] bf16 RoPE
rows) through two slots per program, two programs per SM, at ~0.75x FlashMLA's BF16 time where the bytes allow
0.56x. An ablation of that kernel with its arithmetic switched off once streamed at ~3.45 TB/s, which would
put a floor under its time above the target whatever the arithmetic costs. This kernel asks the question
without the kernel around it: which ring carries 40 KB pages at the read bandwidth (on an H200 every ring
tried does, at 94-97 % of it: docs/performance.md, "The page ring streams at the read bandwidth"):

  * STAGES slots per program, each holding GROUP consecutive pages of the run (one mbarrier per slot: the
    slot is waited for, read and released as one unit, as a kernel computing GROUP pages at once would);
  * persistent programs: the grid is (programs,) and program p streams one contiguous share of the batch's
    pages in block-table order, so the ring never drains between requests (programs per SM = the grid /
    SMs, which shared memory must allow: the probe skips a structure whose programs do not fit, counted by
    `stream_smem_bytes`, which the compile test holds to the compiled kernel's shared memory);
  * per slot, what every decode kernel does with a page before its arithmetic: wait on the slot's
    barrier, then a short read of the slot (8 rows of its first box, summed into a sink so that nothing is
    dead code), then SPIN cycles of busy waiting standing in for the page's arithmetic (`%clock64`,
    per slot), then a CTA barrier after which the slot is asked for again.

The ring's order is the narrow kernel's: at the top of iteration g the slot released at the end of g - 1
is asked for group g + STAGES - 1, then group g is waited for.
"""

from __future__ import annotations

from ..common import HAVE_GLUON

# SPIN cycles of busy waiting on the SM clock (a braced scope: its labels are local to each copy)
SPIN_PTX = ("{ .reg .u64 t0, t1; .reg .pred p; mov.u64 t0, %clock64; SPIN_TOP: mov.u64 t1, %clock64; "
            "sub.u64 t1, t1, t0; setp.lt.u64 p, t1, $2; @p bra SPIN_TOP; mov.u32 $0, $1; }")

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from ..common import cta_barrier, tma_load

    SPIN_PTX_C = gl.constexpr(SPIN_PTX)

    @gluon.jit
    def _issue_group(lat_desc, rope_desc, lat_smem, rope_smem, bars, BT, slot, g, lo, n,
                     lat_page_rows, rope_page_rows, pred, GROUP: gl.constexpr):
        """Ask for group g of the program's run (pages lo + g * GROUP ...) into `slot`; a short last group
        repeats the run's last page so that every slot counts the same bytes."""
        NBOX: gl.constexpr = 4
        bar = bars.index(slot)
        mbarrier.expect(bar, GROUP * (NBOX * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes), pred=pred)
        for j in gl.static_range(GROUP):
            idx = gl.minimum(g * GROUP + j, n - 1)
            page = gl.load(BT + lo + idx, mask=pred, other=0).to(gl.int64)
            lat_row = (page * lat_page_rows).to(gl.int32)
            rope_row = (page * rope_page_rows).to(gl.int32)
            for k in gl.static_range(NBOX):
                tma_load(lat_desc, [lat_row, k * 128], bar, lat_smem.index((slot * GROUP + j) * NBOX + k), pred=pred)
            tma_load(rope_desc, [rope_row, 0], bar, rope_smem.index(slot * GROUP + j), pred=pred)

    @gluon.jit
    def _stream_ring(lat_desc, rope_desc, BT, SINK, total_pages, lat_page_rows, rope_page_rows, SPIN,
                     STAGES: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr):
        NBOX: gl.constexpr = 4
        pid = gl.program_id(0)
        per = (total_pages + gl.num_programs(0) - 1) // gl.num_programs(0)
        lo = pid * per
        n = gl.maximum(gl.minimum(lo + per, total_pages) - lo, 0)
        n_groups = (n + GROUP - 1) // GROUP

        lat_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * GROUP * NBOX, 64, 128], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * GROUP, 64, 64], rope_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        for s in gl.static_range(STAGES - 1):
            _issue_group(lat_desc, rope_desc, lat_smem, rope_smem, bars, BT, s, s, lo, n, lat_page_rows,
                         rope_page_rows, s < n_groups, GROUP)
        cta_barrier()

        touch_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        tid_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        sink = gl.zeros([8, 128], gl.int32, touch_l)
        spun = gl.zeros([32 * num_warps], gl.int32, tid_l)
        for g in range(n_groups):
            slot = g % STAGES
            nxt = g + STAGES - 1
            _issue_group(lat_desc, rope_desc, lat_smem, rope_smem, bars, BT, nxt % STAGES, nxt, lo, n,
                         lat_page_rows, rope_page_rows, nxt < n_groups, GROUP)
            mbarrier.wait(bars.index(slot), (g // STAGES) & 1)
            rows = lat_smem.index(slot * GROUP * NBOX).slice(0, 8, dim=0).load(touch_l)
            sink += rows.to(gl.int8, bitcast=True).to(gl.int32)
            spun = gl.inline_asm_elementwise(SPIN_PTX_C, "=r,r,l", [spun, gl.zeros_like(spun).to(gl.int64) + SPIN],
                                             dtype=gl.int32, is_pure=False, pack=1)
            cta_barrier()  # every warp is done with the slot: the next iteration asks for it again
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        total = gl.sum(gl.sum(sink, axis=1), axis=0) + gl.sum(spun, axis=0)
        gl.store(SINK + pid, total)


def stream_smem_bytes(stages: int, group: int) -> int:
    """Shared memory of `_stream_ring`: the slots (40 KB per page: four 8 KB latent boxes and the 8 KB RoPE
    rows) and their barriers."""
    return stages * group * (4 * 64 * 128 + 64 * 64 * 2) + 8 * stages


def stream_launch(latent, rope, block_table, programs: int, stages: int, group: int, spin: int = 0):
    """The `KernelLaunch` of `_stream_ring` over a snapmla cache's pages (latent [pages, 64, 512] e4m3 codes,
    RoPE [pages, 64, 64] bf16 bits) in `block_table` order, on `programs` persistent programs."""
    import torch

    from ....errors import ShapeError
    from ...decode import KernelLaunch
    from ..common import make_descriptors

    if latent.shape[-2:] != (64, 512) or rope.shape[-2:] != (64, 64):
        raise ShapeError(f"the stream probe reads snapmla pages [*, 64, 512] + [*, 64, 64], got latent "
                         f"{tuple(latent.shape)} and rope {tuple(rope.shape)}")
    lat = latent.view(torch.float8_e4m3fn) if latent.dtype != torch.float8_e4m3fn else latent
    lat_desc, rope_desc = make_descriptors(lat, lat.stride(-2), rope.view(torch.bfloat16), rope.stride(-2), True)
    bt = block_table.reshape(-1).to(torch.int32).contiguous()
    sink = torch.zeros(programs, dtype=torch.int32, device=latent.device)
    args = (lat_desc, rope_desc, bt, sink, bt.numel(), lat.stride(0) // lat.stride(1),
            rope.stride(0) // rope.stride(1), int(spin))
    return KernelLaunch("stream_ring", _stream_ring, (programs,), args,
                        dict(STAGES=stages, GROUP=group, num_warps=4))
