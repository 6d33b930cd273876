"""PagedMLACache, `supports`, and input validation of the kernel launchers (CPU; cheap)."""

from __future__ import annotations

import math

import pytest
import torch

from snapquant import PRESETS, quantize_kv
from snapquant.errors import ConfigError, ShapeError
from snapquant.kernels import PagedMLACache, layout_of, mla_decode, supports, unsupported_reason


def _kv(config, B=2, T=100, r=64, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_kv(torch.randn(B, T, r, generator=g).bfloat16(), torch.randn(B, T, d, generator=g).bfloat16(),
                       config)


def raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


# ---------------------------------------------------------------------------------- supports / layouts
@pytest.mark.parametrize("name,layout", [
    ("snapmla", "snapmla"), ("snapmla_kv_only", "snapmla"), ("snapmla_q_fp8", "snapmla"), ("ds_v32", "ds_v32"),
    ("bf16", "bf16"),
])
def test_supported_presets(name, layout):
    assert supports(PRESETS[name]) and layout_of(PRESETS[name]) == layout
    assert supports(PRESETS[name], 512, 64)


@pytest.mark.parametrize("name,why", [
    ("snapmla_naive_pv", "pv='fp8_naive'"), ("per_tensor_fp8", "rope_dtype='fp8_e4m3'"),
    ("int4_kivi", "nope_dtype='int4'"), ("e5m2_per_token", "nope_dtype='fp8_e5m2'"),
    ("ds_model1", "scale_format='e8m0'"), ("int8_per_token", "nope_dtype='int8'"),
])
def test_unsupported_presets_say_why(name, why):
    assert not supports(PRESETS[name])
    assert why in unsupported_reason(PRESETS[name])


def test_unsupported_knobs_and_widths():
    snap = PRESETS["snapmla"]
    assert "pv_block=128" in unsupported_reason(snap.replace(pv_block=128))
    assert "kv_lora_rank=48" in unsupported_reason(snap, 48, 64)
    assert "rope_dim=8" in unsupported_reason(snap, 32, 8)  # the tiny test models' RoPE width
    assert "bf16 cache layout takes query='bf16'" in unsupported_reason(PRESETS["bf16"].replace(query="fp8_e4m3"))
    assert "block_size=128 does not divide" in unsupported_reason(PRESETS["ds_v32"], 64, 16)
    assert "block_size=8 must be a power of two >= 16" in unsupported_reason(PRESETS["ds_v32"].replace(block_size=8), 64, 16)


# ---------------------------------------------------------------------------------- container
@pytest.mark.parametrize("name", ["snapmla", "ds_v32", "bf16"])
def test_round_trip_through_pages(name):
    config = PRESETS[name].replace(block_size=32) if name == "ds_v32" else PRESETS[name]
    kv = _kv(config)
    lengths = torch.tensor([100, 37])
    cache = PagedMLACache.from_quantized_kv(kv, lengths, shuffle=True, extra_pages=5,
                                           generator=torch.Generator().manual_seed(0))
    assert cache.layout == layout_of(config) and cache.num_pages == 2 * 2 + 5 and cache.capacity == 128
    assert sorted(cache.block_table.flatten().tolist()) != list(range(4))  # really shuffled
    back = cache.to_quantized_kv(100)
    assert torch.equal(raw(back.latent.data[0]), raw(kv.latent.data[0]))
    assert torch.equal(raw(back.latent.data[1, :37]), raw(kv.latent.data[1, :37]))
    assert (raw(back.latent.data[1, 37:]) == 0).all()  # beyond the length: zeros, never garbage
    assert torch.equal(back.rope.data[0], kv.rope.data[0])
    if kv.latent.scale is not None:
        assert torch.equal(back.latent.scale[0], kv.latent.scale[0])
        assert (back.latent.scale[1, 37:] == 1).all()
    assert back.rope_prescaled == kv.rope_prescaled and back.latent.granularity == kv.latent.granularity


def test_bytes_per_token_of_the_page_pool():
    """644 / 656 / 1152 bytes per token at DeepSeek widths, as docs/numerics.md ("Bytes per token") states."""
    for name, per_token in (("snapmla", 644), ("ds_v32", 656), ("bf16", 1152)):
        cache = PagedMLACache.empty(1, 64, 512, 64, PRESETS[name])
        assert cache.nbytes == 64 * per_token


def test_container_validation():
    cfg = PRESETS["snapmla"]
    good = PagedMLACache.empty(2, 64, 64, 16, cfg)
    parts = dict(latent=good.latent, scale=good.scale, rope=good.rope, block_table=good.block_table,
                 lengths=good.lengths, config=cfg)

    def build(**kw):
        return PagedMLACache(**{**parts, **kw})

    with pytest.raises(ShapeError, match=r"latent has dtype torch\.bfloat16"):
        build(latent=good.latent.to(torch.bfloat16))
    with pytest.raises(ShapeError, match=r"latent must be \[num_pages, 64, r\]"):
        build(latent=good.latent.view(4, 32, 64))
    with pytest.raises(ShapeError, match="rope must have shape"):
        build(rope=good.rope[:1])
    with pytest.raises(ShapeError, match="scale must have shape"):
        build(scale=good.scale[:, :32])
    with pytest.raises(ShapeError, match=r"block_table has dtype torch\.int64"):
        build(block_table=good.block_table.long())
    with pytest.raises(ShapeError, match="lengths must have shape"):
        build(lengths=good.lengths[:1])
    with pytest.raises(ShapeError, match="rope is on meta"):
        build(rope=good.rope.to("meta"))
    with pytest.raises(ShapeError, match="latent must be contiguous in its last dim"):
        build(latent=torch.zeros(2, 64, 64, 2).to(torch.float8_e4m3fn)[..., 0])
    with pytest.raises(ConfigError, match="kv_lora_rank=48 must be a power of two"):
        PagedMLACache.empty(1, 64, 48, 16, cfg)
    with pytest.raises(ConfigError, match="no page layout"):
        PagedMLACache.empty(1, 64, 64, 16, PRESETS["int4_kivi"])
    with pytest.raises(ShapeError, match="scale must be None for the bf16 layout"):
        build(config=PRESETS["bf16"], latent=good.latent.to(torch.bfloat16))


# ---------------------------------------------------------------------------------- decode validation
def _decode_case():
    kv = _kv(PRESETS["snapmla"], B=2, T=100)
    cache = PagedMLACache.from_quantized_kv(kv, torch.tensor([100, 50]))
    q = torch.randn(2, 4, 80).bfloat16()
    return q, cache


def test_decode_rejects_bad_queries():
    q, cache = _decode_case()
    with pytest.raises(ShapeError, match=r"q_abs has dtype torch\.int64"):
        mla_decode(q.long(), cache, 0.1)
    with pytest.raises(ShapeError, match="q_abs's last dim is 81"):
        mla_decode(torch.randn(2, 4, 81), cache, 0.1)
    with pytest.raises(ShapeError, match="q_abs has batch 3"):
        mla_decode(torch.randn(3, 4, 80), cache, 0.1)
    with pytest.raises(ShapeError, match="q_abs must be 3-d or 4-d"):
        mla_decode(torch.randn(2, 80), cache, 0.1)
    with pytest.raises(ShapeError, match="q_abs is on meta"):
        mla_decode(q.to("meta"), cache, 0.1)
    with pytest.raises(ShapeError, match="q_abs must be contiguous in its last dim"):
        mla_decode(torch.randn(2, 4, 80, 2)[..., 0], cache, 0.1)
    with pytest.raises(ShapeError, match="softmax_scale must be a positive finite float"):
        mla_decode(q, cache, math.nan)
    with pytest.raises(ConfigError, match="num_splits=0 is not valid; allowed values: a positive int"):
        mla_decode(q, cache, 0.1, num_splits=0)
    with pytest.raises(ConfigError, match="block_m=24 is not valid; allowed values: a power of two >= 16"):
        mla_decode(q, cache, 0.1, block_m=24)


def test_decode_rejects_bad_cache_values_before_launch():
    q, cache = _decode_case()
    cache.block_table[1, 0] = cache.num_pages  # a page the pool does not have, in use by request 1
    with pytest.raises(ShapeError, match="block_table has an entry outside"):
        mla_decode(q, cache, 0.1)
    cache.block_table[1, 0] = -1
    with pytest.raises(ShapeError, match="block_table has an entry outside"):
        mla_decode(q, cache, 0.1)
    q, cache = _decode_case()
    cache.block_table[1, 1] = 99  # not in use (length 50 < 64): fine
    mla_decode(q, cache, 0.1, num_splits=1)
    cache.lengths[0] = cache.capacity + 1
    with pytest.raises(ShapeError, match="beyond the pages"):
        mla_decode(q, cache, 0.1)
    cache.lengths[0] = -1
    with pytest.raises(ShapeError, match="negative"):
        mla_decode(q, cache, 0.1)


def test_decode_rejects_configs_that_do_not_match_the_cache():
    q, cache = _decode_case()
    with pytest.raises(ConfigError, match="reads the ds_v32 layout but the cache holds the snapmla layout"):
        mla_decode(q, cache, 0.1, PRESETS["ds_v32"].replace(block_size=32))
    with pytest.raises(ConfigError, match="does not implement config 'snapmla_naive_pv'"):
        mla_decode(q, cache, 0.1, PRESETS["snapmla_naive_pv"])
    with pytest.raises(ShapeError, match="paged_cache must be a PagedMLACache"):
        mla_decode(q, cache.to_quantized_kv(), 0.1)
