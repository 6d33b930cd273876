"""snapquant.bench.compile_stats: kernels compiled for Hopper (sm_90) on a machine without a GPU."""

from __future__ import annotations

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
    # the default pairs tile: the latent as int16 code pairs, prefetched; one e4m3x2 -> f16x2 cvt per pair
    assert "64x256:i16" in st["async_tiles"] and "64x256" not in st["sync_tiles"]
    assert st["cvt_e4m3"] > 0
    if st.get("regs") is None:
        pytest.skip("cuobjdump not bundled with this triton: no register / SASS report")
    assert 0 < st["regs"] <= 255 and st["loop_total"] > st["loop_mma"] > 0
    # ptxas keeps its wgmma asynchronous (our BF16 kernel at H >= 64 it serializes: docs/history/perf-notes.md, section 10)
    assert st["wgmma_waits"] < st["wgmma"] // 4 and st["ptxas_advice"] in ("", None)


def test_pairs_tile_is_pipelined_where_the_fp8_tile_is_not():
    """H = 16 (BLOCK_M = 16, mma.sync): Triton loads the 8-bit latent tile synchronously every page
    (tile='rows') but software-pipelines the same bytes read as int16 pairs (tile='pairs', the default)."""
    shape = uniform_shape(4, 16, 1024)
    rows_tile = decode_compile_stats(BY_NAME["snapmla+rows"], shape)[0]
    pairs_tile = decode_compile_stats(BY_NAME["snapmla"], shape)[0]
    assert "64x512:f8E4M3FN" in rows_tile["sync_tiles"]
    assert "64x256:i16" in pairs_tile["async_tiles"] and not pairs_tile["sync_tiles"]


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
