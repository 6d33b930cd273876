"""snapquant.bench.compile_stats: the benchmark's variants compiled for Hopper (sm_90) on a machine without a GPU.

Which tiles Triton's pipeliner copies ahead (async) or waits for (sync) depends on the Triton version: the
checks here are what the kernel source fixes (which tiles the page loop loads, in which dtype) and relations
between variants; the exact split of one version is a snapshot, skipped on others."""

from __future__ import annotations

import functools
import warnings

import pytest

from snapquant.bench.compile_stats import decode_compile_stats, loop_mix
from snapquant.bench.shapes import uniform_shape
from snapquant.bench.variants import BY_NAME


def test_sm90_compile_of_a_decode_plan(monkeypatch):
    """The default SnapMLA kernel at H = 64 uses Hopper wgmma, pipelines its page loads and reports
    its registers; its uniform plan is stage 1 plus the combine. It compiles without Triton 3.9's
    once-per-process warning that the unset FP fusion default will change (the compile asks for the
    launch's default explicitly)."""
    import triton

    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    warn_once = getattr(getattr(triton, "_utils", None), "warn_once", None)
    if hasattr(warn_once, "cache_clear"):
        warn_once.cache_clear()  # an earlier compile in this process may have spent the one warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = decode_compile_stats(BY_NAME["snapmla"], uniform_shape(4, 64, 1024))
    assert not [str(w.message) for w in caught if "FP_FUSION" in str(w.message)]
    assert [r["kernel"] for r in rows] == ["decode_uniform", "combine"]
    st = rows[0]
    assert "error" not in st, st.get("error")
    assert st["wgmma"] > 0 and st["mma_sync"] == 0 and st["async_loads"] > 0 and st["smem"] > 0
    # the default pairs tile: the latent as int16 code pairs (never as an 8-bit tile); one e4m3x2 -> f16x2
    # cvt per pair
    assert "64x256:i16" in _tiles(st) and not any(":f8" in t for t in _tiles(st))
    assert st["cvt_e4m3"] > 0
    if st.get("regs") is None:
        pytest.skip("cuobjdump not bundled with this triton: no register / SASS report")
    assert 0 < st["regs"] <= 255 and st["loop_total"] > st["loop_mma"] > 0
    # ptxas keeps its wgmma asynchronous (our BF16 kernel at H >= 64 it serializes: docs/history/perf-notes.md, section 10)
    assert st["wgmma_waits"] < st["wgmma"] // 4 and st["ptxas_advice"] in ("", None)


def _tiles(st) -> set[str]:
    return {t for key in ("async_tiles", "sync_tiles") for t in st[key].split(",") if t}


@functools.cache
def _h16_tiles():
    """H = 16 (BLOCK_M = 16, mma.sync): the plain fp8 tile (tile='rows') and the int16 pairs (the default)."""
    shape = uniform_shape(4, 16, 1024)
    return decode_compile_stats(BY_NAME["snapmla+rows"], shape)[0], decode_compile_stats(BY_NAME["snapmla"], shape)[0]


def test_pairs_tile_loads_no_more_synchronously_than_the_fp8_tile():
    """The same latent bytes, read as a [64, 512] e4m3 tile (rows) or [64, 256] int16 code pairs (pairs): the
    pairs tile was made so Triton can software-pipeline it, so it never waits for more tiles per page."""
    rows_tile, pairs_tile = _h16_tiles()
    assert "64x512:f8E4M3FN" in _tiles(rows_tile) and "64x256:i16" in _tiles(pairs_tile)
    assert not any(":f8" in t for t in _tiles(pairs_tile))
    sync = {name: {t for t in st["sync_tiles"].split(",") if t} for name, st in (("rows", rows_tile),
                                                                                ("pairs", pairs_tile))}
    assert len(sync["pairs"]) <= len(sync["rows"]), sync


# Triton versions' pipelining of the H = 16 tiles (see the module docstring): version -> (rows sync tiles,
# pairs sync tiles, a pairs async tile). 3.9: Triton pipelines the 16-bit tile at BLOCK_M = 16 but loads the
# 8-bit one synchronously every page, which is why the pairs tile exists.
PIPELINING_SNAPSHOTS = {"3.9.0": ("64x512:f8E4M3FN", "", "64x256:i16")}


def _triton_version() -> str:
    import triton

    return triton.__version__


@pytest.mark.skipif(_triton_version() not in PIPELINING_SNAPSHOTS, reason="no snapshot for this Triton version")
def test_pairs_tile_is_pipelined_where_the_fp8_tile_is_not_snapshot():
    rows_sync, pairs_sync, pairs_async = PIPELINING_SNAPSHOTS[_triton_version()]
    rows_tile, pairs_tile = _h16_tiles()
    assert rows_tile["sync_tiles"] == rows_sync and pairs_tile["sync_tiles"] == pairs_sync
    assert pairs_async in pairs_tile["async_tiles"]


def test_loop_mix_picks_the_loop_with_the_mma():
    sass = "\n".join([
        "        /*0000*/                   MOV R1, R2 ;",
        "        /*0010*/                   FADD R1, R1, R2 ;",
        "        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;",
        "        /*0030*/                   LDS.128 R8, [R2] ;",
        "        /*0040*/              @P0 BRA 0x10 ;",
        "        /*0050*/                   FMUL R1, R1, R1 ;",
        "        /*0060*/              @P1 BRA 0x50 ;",
    ])
    mix = loop_mix(sass)
    assert mix["loop_total"] == 4 and mix["loop_mma"] == 1 and mix["loop_lds"] == 1 and mix["loop_falu"] == 1
    assert loop_mix("no loop here")["loop_total"] is None


def test_loop_hot_path_leaves_out_what_a_forward_branch_skips():
    """The page loop's hot path: a predicated forward branch inside the loop skips a cold block (the tail
    zeroing of a request's last page); an unpredicated one, or one leaving the loop, skips nothing counted."""
    sass = "\n".join([
        "        /*0000*/                   MOV R1, R2 ;",
        "        /*0010*/                   FADD R1, R1, R2 ;",
        "        /*0020*/              @!P2 BRA 0x50 ;",
        "        /*0030*/                   STS [R2], RZ ;",
        "        /*0040*/                   STS [R2+0x10], RZ ;",
        "        /*0050*/                   HGMMA.64x16x16.F32 R4, gdesc[UR4], R4 ;",
        "        /*0060*/              @!P0 BRA 0x200 ;",
        "        /*0070*/                   F2FP.F16.E4M3.UNPACK_B R8, R9 ;",
        "        /*0080*/              @P0 BRA 0x10 ;",
    ])
    mix = loop_mix(sass)
    assert mix["loop_total"] == 8  # 0x10 .. 0x80
    assert mix["loop_hot"] == 6 and "STS" not in mix["loop_hot_ops"]
    assert mix["loop_hot_ops"]["HGMMA"] == 1 and mix["loop_hot_ops"]["F2FP"] == 1 and mix["loop_hot_ops"]["BRA"] == 3


def test_mufu_under_wgmma_counts_only_while_a_group_is_pending():
    """MUFUs between a group's commit (HGMMA with gsb0) and the wait that leaves none pending count; MUFUs after
    `DEPBAR.LE gsb0, 0x0`, or while only a wait with groups left pending has run, are told apart."""
    from snapquant.kernels.compile_stats import mufu_under_wgmma

    sass = "\n".join([
        "        /*0000*/                   MUFU.EX2 R1, R1 ;",                              # nothing pending
        "        /*0010*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;",
        "        /*0020*/                   HGMMA.64x256x16.F32.BF16 R40, R8, gdesc[UR8], R40, gsb0 ;",
        "        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",                # one group left
        "        /*0040*/                   MUFU.EX2 R2, R2 ;",
        "        /*0050*/                   MUFU.EX2 R3, R3 ;",
        "        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "        /*0070*/                   MUFU.EX2 R4, R4 ;",                              # all retired
    ])
    assert mufu_under_wgmma(sass) == 2
