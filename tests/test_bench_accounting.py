"""FLOP / byte accounting, shapes and variant selection of the decode benchmark (snapquant.bench)."""

from __future__ import annotations

import math

import pytest
import torch

from snapquant import PRESETS
from snapquant.bench import accounting as acc
from snapquant.bench.shapes import (
    BENCH_SHAPES,
    HEADLINE,
    mixed_shape,
    ordered_shapes,
    parse_shapes,
    uniform_shape,
)
from snapquant.bench.variants import BASELINE, BY_NAME, VARIANTS, select_variants
from snapquant.errors import ConfigError
from snapquant.kernels import PagedMLACache, supports


def test_decode_counts_at_the_headline_shape():
    """B=128, H=16, L=4096 (docs/performance.md): 2 * 16 * 524288 * 1088 FLOPs; 1152 / 644 B per token."""
    tokens = 128 * 4096
    assert acc.decode_flops(16, tokens) == 2 * 16 * tokens * 1088 == 18_253_611_008
    assert acc.cache_bytes(PRESETS["bf16"], tokens) == tokens * 1152 == 603_979_776
    assert acc.cache_bytes(PRESETS["snapmla"], tokens) == tokens * 644
    assert acc.cache_bytes(PRESETS["ds_v32"], tokens) == tokens * 656
    # q (bf16 576) in, out (fp32 512) and lse (fp32) out, per (request, head)
    assert acc.io_bytes(128, 16) == 128 * 16 * (576 * 2 + 512 * 4 + 4)
    assert acc.decode_flops(128, 10, q_tokens=2, r=64, d=16) == 2 * 128 * 2 * 10 * 144


def test_cache_bytes_match_the_kernels_page_pool():
    """The accounting's bytes per token equal what the kernels' page pool actually allocates."""
    for name in ("bf16", "snapmla", "ds_v32"):
        cfg = PRESETS[name]
        cache = PagedMLACache.empty(3, 128, 512, 64, cfg, device="meta")
        tokens = cache.num_pages * 64
        assert acc.cache_bytes(cfg, tokens) == cache.nbytes, name


def test_append_bytes_rate_and_roofline():
    n = 65536
    assert acc.append_bytes(PRESETS["snapmla"], n) == n * (576 * 2 + 644 + 8)
    assert acc.append_bytes(PRESETS["bf16"], n, in_bytes=4) == n * (576 * 4 + 1152 + 8)
    assert acc.rate(4e9, 1e6) == pytest.approx(4.0)  # 4 GB in 1 s
    assert math.isnan(acc.rate(1.0, 0.0))
    # memory-bound: 338 MB at 4250 GB/s ~ 79 us; compute-bound: 0.79 TFLOP at 790 TFLOP/s = 1 ms
    assert acc.roofline_us(337_641_472, 1e9) == pytest.approx(337_641_472 / 4250e3)
    assert acc.roofline_us(1.0, 7.9e11) == pytest.approx(1e3)
    with pytest.raises(ValueError, match="heads"):
        acc.decode_flops(0, 10)
    with pytest.raises(ValueError, match="tokens"):
        acc.cache_bytes(PRESETS["bf16"], -1)


def test_bench_shapes_and_the_mixed_batch():
    got = {(s.batch, s.heads, s.max_len) for s in BENCH_SHAPES if s.uniform}
    assert got == {(128, 16, 4096), (32, 16, 16384), (8, 16, 32768), (32, 64, 8192), (4, 64, 8192),
                   (128, 128, 4096), (64, 128, 8192), (1, 128, 32768)}
    mixed = [s for s in BENCH_SHAPES if not s.uniform]
    assert len(mixed) == 1 and mixed[0] == mixed_shape()  # deterministic
    m = mixed[0]
    assert len(m.lengths) == m.batch == 64 and min(m.lengths) == 128 and max(m.lengths) == 32768
    assert m.tokens == sum(m.lengths) and "mixed" in m.label
    assert list(m.lengths) != sorted(m.lengths)  # shuffled: long and short requests interleave
    order = [s.name for s in ordered_shapes()]
    assert order[: len(HEADLINE)] == list(HEADLINE) and len(order) == 9


def test_parse_shapes():
    assert [s.name for s in parse_shapes("128x16x4096,2x4x130")] == ["128x16x4096", "2x4x130"]
    assert parse_shapes("mixed64x16")[0].tokens == mixed_shape().tokens
    assert len(parse_shapes(None, quick=True)) == 4
    with pytest.raises(ConfigError, match="not a known name"):
        parse_shapes("huge")
    with pytest.raises(ConfigError, match="batch"):
        uniform_shape(0, 16, 4096)


def test_every_kernel_variant_is_supported_and_checked_against_an_earlier_one():
    names = [v.name for v in VARIANTS]
    assert len(names) == len(set(names))
    for v in VARIANTS:
        if v.impl == "kernel":
            assert supports(v.config(), 512, 64), v.name
        if v.check_vs is not None:  # the reference is measured before (lower or equal priority, earlier)
            ref = BY_NAME[v.check_vs]
            assert ref.priority <= v.priority and names.index(ref.name) < names.index(v.name), v.name
            assert 0 <= v.tol <= 0.25
            # tol 0 (the same bits) only where the variant claims it: the integer widening of the same products,
            # or the same kernels with the combine launched differently (pdl) or pages prefetched into L2 (the
            # narrow Gluon kernels, the defaults at <= 16 rows on Hopper)
            same_products = dict(v.knobs).get("widen", "cvt") != "cvt" and v.check_vs == "snapmla"
            same_kernels = v.check_vs == v.name.split("+")[0] and (
                set(dict(v.knobs)) == {"pdl"} or dict(v.knobs) == {"tile": "gluon", "l2_prefetch": v.knobs[0][1]})
            assert v.tol > 0 or same_products or same_kernels, v.name
    core_modes = {(v.layout, v.mode) for v in VARIANTS if v.priority == 0 and v.family == "fp8"}
    assert core_modes == {("snapmla", m) for m in ("q8p8", "q8p16", "q16p8", "q16p16")}  # every FP8 mode
    assert {v.impl for v in VARIANTS if v.priority == 0} == {"kernel", "torch_matmul", "flashmla"}


def test_select_variants():
    all_v = select_variants()
    assert [v.priority for v in all_v] == sorted(v.priority for v in all_v)
    assert select_variants("snapmla")[0].name == BASELINE  # the baseline always comes along
    assert [v.name for v in select_variants("snapmla")] == [BASELINE, "snapmla", "flashmla"]  # and the anchor
    names = {v.name for v in select_variants("snapmla+*")}
    assert names >= {"snapmla+balanced", "snapmla+rcp", "snapmla+bm64"} and BASELINE in names
    assert all(v.priority == 0 for v in select_variants(max_priority=0))
    quick = {v.name for v in select_variants(quick=True)}
    assert BASELINE in quick and "torch" in quick and len(quick) < len(VARIANTS) / 2
    with pytest.raises(ConfigError, match="matches nothing"):
        select_variants("nope*")


def test_variant_knobs_resolve_per_shape():
    h16, h128 = uniform_shape(128, 16, 4096), uniform_shape(128, 128, 4096)
    v = BY_NAME["snapmla+balanced+parts4"]
    assert v.kernel_kwargs(h16, 132) == {"num_splits": 528, "schedule": "balanced"}  # 4 x 132 / 1 row tile
    assert v.kernel_kwargs(h128, 132)["num_splits"] == 264  # two 64-row tiles share the SMs
    assert BY_NAME["snapmla+bm64"].applies(h16) and not BY_NAME["snapmla+bm64"].applies(h128)
    assert BY_NAME["ds_v32"].applies(h16) and not BY_NAME["ds_v32"].applies(uniform_shape(4, 64, 8192))
    assert BY_NAME["snapmla"].config().query == "fp8_e4m3" and BY_NAME["snapmla_kv_only"].config().pv == "bf16"
    assert BY_NAME["snapmla+rcp"].knob_label == "p_div=rcp" and BY_NAME["bf16"].knob_label == "default"


def test_block_table_of_the_harness():
    from snapquant.bench.harness import _block_table

    bt, pages = _block_table([1, 130, 64], torch.device("cpu"))
    assert pages == 1 + 3 + 1
    assert bt.tolist() == [[0, 0, 0], [1, 2, 3], [4, 4, 4]]  # own pages, padded with the last one
