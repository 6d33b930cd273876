"""snapquant.graphs: the host-sync guard, preallocated LatentCache stores, and DecodeGraph's fixed-shape
decode step (run eagerly on CPU, captured as a CUDA graph on a GPU).

On CPU the step is compared bit for bit with the eager patched model: it runs the same ops, only over the
whole preallocated store (rows past each request's length masked by the reference's lengths) instead of a
slice to the longest request; the masked rows add exact zeros, and at these sizes the sums come out
identical (asserted with torch.equal; were a BLAS to reorder them, the bound would be fp32 summation order).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import snapquant
from snapquant.attention.backends import trusted_lengths
from snapquant.cache import LatentCache, LatentLayer
from snapquant.errors import ConfigError, HostSyncError, ShapeError
from snapquant.graphs import DecodeGraph, allow_host_sync, no_host_sync
from snapquant.models.tiny import tiny_model
from snapquant.reference.absorb import absorb_query, project_output, split_bf16

B, L = 3, 10


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------- no_host_sync
@pytest.mark.parametrize("name, fn", [
    ("item", lambda t: t[0].item()),
    ("int", lambda t: int(t[0])),
    ("float", lambda t: float(t[0])),
    ("bool", lambda t: bool(t[0])),
    ("if", lambda t: 1 if (t > 2).any() else 0),
    ("nonzero", lambda t: t.nonzero()),
    ("where1", lambda t: torch.where(t > 1)),
    ("boolmask", lambda t: t[t > 1]),
    ("tolist", lambda t: t.tolist()),
    ("numpy", lambda t: t.numpy()),
    ("equal", lambda t: torch.equal(t, t)),
    ("unique", lambda t: torch.unique(t)),
])
def test_no_host_sync_raises_naming_the_op(name, fn):
    t = torch.arange(5.0)
    with pytest.raises(HostSyncError, match=r"aten\.|Tensor\.") as e, no_host_sync():
        fn(t)
    assert "no_host_sync" in str(e.value)


def test_no_host_sync_allows_ordinary_ops_and_exempt_blocks():
    t = torch.arange(6.0).view(2, 3)
    with no_host_sync():
        u = (t * 2 + 1).softmax(-1) @ t.T
        u = u.masked_fill(u > 3, 0.0).cumsum(0).clamp(min=0)
        idx = torch.tensor([1, 0])
        t.index_select(0, idx)
        t[idx, torch.tensor([0, 2])] = 5.0
        t.copy_(t.flip(0))
        torch.where(t > 2, t, 0.0)
        with allow_host_sync("test"):
            assert int(t[0, 0]) >= 0
        assert u.shape == (2, 2)
    with pytest.raises(HostSyncError), no_host_sync():  # the exemption ended with its block
        int(t[0, 0])


# ---------------------------------------------------------------------------------------------- preallocation
def test_preallocated_store_allocates_once_and_refuses_to_grow():
    layer = LatentLayer("snapmla", 32, 8, max_cache_len=70)
    layer.append(torch.randn(2, 5, 32), torch.randn(2, 5, 8))
    st = layer.store
    assert st.capacity == 128 and st.parts["nope"].codes.shape == (2, 128, 32)
    ptrs = (st.parts["nope"].codes.data_ptr(), st.lengths.data_ptr())
    for _ in range(60):
        layer.append(torch.randn(2, 1, 32), torch.randn(2, 1, 8))
    layer.crop(-3)
    layer._select(torch.tensor([1, 0]))
    assert (st.parts["nope"].codes.data_ptr(), st.lengths.data_ptr()) == ptrs
    assert layer.seen == 62 and st.lengths.tolist() == [62, 62] and layer.get_max_length() == 70
    with pytest.raises(ShapeError, match="max_cache_len=70"):
        layer.append(torch.randn(2, 9, 32), torch.randn(2, 9, 8))
    assert layer.seen == 62  # nothing was written


def test_default_cache_still_grows():
    layer = LatentLayer("snapmla", 32, 8)
    layer.append(torch.randn(2, 5, 32), torch.randn(2, 5, 8))
    assert layer.store.capacity is None and layer.get_max_length() == -1
    assert layer.store.parts["nope"].codes.shape[1] == 64
    layer.append(torch.randn(2, 100, 32), torch.randn(2, 100, 8))
    assert layer.store.parts["nope"].codes.shape[1] == 128 and layer.seen == 105
    with pytest.raises(ConfigError, match="not preallocated"):
        layer.store.segments(static=True)


def test_bad_max_cache_len_is_refused():
    with pytest.raises(ShapeError, match="max_cache_len"):
        LatentCache("snapmla", max_cache_len=0)


# ---------------------------------------------------------------------------------------------- DecodeGraph
def _ck(model, cache) -> dict:
    """The model's cache keyword: `cache` (transformers >= 5.2x) or `past_key_values` (5.17)."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def _pair(family, preset, max_cache_len=64, seed=0, pads=None, **model_kw):
    """A patched bf16 tiny model and two caches with the same prompt: preallocated (graph) and default (eager)."""
    model = tiny_model(family, dtype=torch.bfloat16, **model_kw)
    snapquant.patch(model, preset, backend="reference")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (B, L), generator=g)
    am = torch.ones_like(ids)
    for b, p in enumerate(pads or ()):
        am[b, :p] = 0
    c_graph = LatentCache(preset, model, max_cache_len=max_cache_len)
    c_eager = LatentCache(preset, model)
    with torch.no_grad():
        model(ids, attention_mask=am, **_ck(model, c_graph))
        model(ids, attention_mask=am, **_ck(model, c_eager))
    return model, c_graph, c_eager, g


def _eager(model, cache, ids):
    with torch.no_grad():
        return model(ids, **_ck(model, cache)).logits


def _same_cache(a: LatentCache, b: LatentCache):
    for la, lb in zip(a.latent_layers, b.latent_layers, strict=True):
        assert la.seen == lb.seen and torch.equal(la.stored, lb.stored)
        assert torch.equal(la.lengths, lb.lengths)
        da, db = la.dense(torch.float32), lb.dense(torch.float32)
        assert torch.equal(da[0], db[0]) and torch.equal(da[1], db[1])


# The static step always runs the absorbed pipeline. With the reference backend, the plain `bf16` preset
# decodes eagerly through the stock attention (bit-exact to the unpatched model); `prefill: quantized` asks
# for the absorbed BF16 pipeline eagerly too, which is what the step must reproduce.
BF16_ABSORBED = snapquant.PRESETS["bf16"].replace(prefill="quantized")


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("preset", [BF16_ABSORBED, "snapmla"], ids=["bf16_absorbed", "snapmla"])
def test_static_step_matches_eager_and_is_sync_free(family, preset):
    model, cg, ce, g = _pair(family, preset)
    graph = DecodeGraph(model, cg)
    assert graph.graph is None and not graph.capture  # CPU: the same fixed-shape step, run eagerly
    for _ in range(4):
        ids = torch.randint(3, 256, (B, 1), generator=g)
        with no_host_sync():
            got = graph.step(ids)
        assert got.shape == (B, 1, 256)
        assert torch.equal(got, _eager(model, ce, ids))
    _same_cache(cg, ce)
    # rewind (sync-free) / crop, then more steps and eager forwards on the same cache
    with no_host_sync():
        graph.rewind(2)
    ce.crop(-2)
    _same_cache(cg, ce)
    cg.crop(-1)
    ce.crop(-1)
    ids = torch.randint(3, 256, (B, 1), generator=g)
    with no_host_sync():
        got = graph.step(ids).clone()
    assert torch.equal(got, _eager(model, ce, ids))
    ids2 = torch.randint(3, 256, (B, 2), generator=g)  # an eager multi-token forward in between
    assert torch.equal(_eager(model, cg, ids2), _eager(model, ce, ids2))
    ids = torch.randint(3, 256, (B, 1), generator=g)
    with no_host_sync():
        got = graph.step(ids).clone()
    assert torch.equal(got, _eager(model, ce, ids))
    _same_cache(cg, ce)


def test_step_after_padded_prefill_matches_eager_masked_decode():
    model, cg, ce, g = _pair("deepseek_v3", "snapmla", pads=(0, 3, 6))
    graph = DecodeGraph(model, cg)
    am = torch.ones(B, L, dtype=torch.long)
    am[1, :3] = 0
    am[2, :6] = 0
    for _ in range(3):
        ids = torch.randint(3, 256, (B, 1), generator=g)
        pos = ce.latent_layers[0].lengths.view(B, 1).clone()  # HF generate: cumsum(mask) - 1
        am = torch.cat([am, torch.ones(B, 1, dtype=torch.long)], dim=1)
        with no_host_sync():
            got = graph.step(ids)
        with torch.no_grad():
            want = model(ids, attention_mask=am, position_ids=pos, **_ck(model, ce)).logits
        assert torch.equal(got, want)
    _same_cache(cg, ce)


def test_replay_repeats_the_step_and_max_cache_len_is_enforced():
    model, cg, _, g = _pair("deepseek_v2", "snapmla", max_cache_len=13)
    graph = DecodeGraph(model, cg)
    ids = torch.randint(3, 256, (B, 1), generator=g)
    first = graph.step(ids).clone()
    graph.rewind(1)
    assert torch.equal(graph.replay(), first)  # same token at the same length
    graph.step(ids)
    graph.step(ids)
    assert cg.get_seq_length() == 13
    with pytest.raises(ShapeError, match="max_cache_len=13"):
        graph.step(ids)
    with pytest.raises(ShapeError, match="max_cache_len=13"):
        _eager(model, cg, ids)
    assert cg.get_seq_length() == 13 and cg.latent_layers[0].lengths.tolist() == [13] * B


def test_refusals_name_the_field():
    model, cg, ce, g = _pair("deepseek_v3", "snapmla")
    graph = DecodeGraph(model, cg)
    ids = torch.randint(3, 256, (B, 1), generator=g)
    with pytest.raises(ConfigError, match="attention_mask"):
        graph.step(ids, attention_mask=torch.ones(B, L + 1, dtype=torch.long))
    with pytest.raises(ShapeError, match=r"input_ids must be \[B=3, 1\]"):
        graph.step(torch.randint(3, 256, (B, 2)))
    with pytest.raises(ConfigError, match="max_cache_len"):
        DecodeGraph(model, ce)  # not preallocated
    with pytest.raises(ShapeError, match="empty"):
        DecodeGraph(model, LatentCache("snapmla", model, max_cache_len=64))
    with pytest.raises(ConfigError, match="patched"):
        DecodeGraph(tiny_model("deepseek_v3"), cg)
    with pytest.raises(ConfigError, match="CUDA"):
        DecodeGraph(model, cg, capture=True)
    kivi, ck, _, _ = _pair("deepseek_v3", "int4_kivi")
    with pytest.raises(ConfigError, match="token_group=32"):
        DecodeGraph(kivi, ck)
    cg.batch_select_indices(torch.tensor([0, 2]))  # the batch changed: the graph's buffers are gone
    with pytest.raises(ShapeError, match="new DecodeGraph"):
        graph.step(ids[:2])


def test_triton_operands_skip_the_lengths_check_only_when_trusted():
    from snapquant import PRESETS, quantize_kv
    from snapquant.kernels.backend import operands_from_kv

    kv = quantize_kv(torch.randn(2, 64, 64).bfloat16(), torch.randn(2, 64, 16).bfloat16(), PRESETS["snapmla"])
    lengths = torch.tensor([5, 64])
    with pytest.raises(HostSyncError), no_host_sync():
        operands_from_kv(kv, lengths, PRESETS["snapmla"])
    with no_host_sync(), trusted_lengths():
        ops = operands_from_kv(kv, lengths, PRESETS["snapmla"])
    assert ops.lengths.dtype == torch.int32
    with pytest.raises(ShapeError, match="lengths must lie"):
        operands_from_kv(kv, torch.tensor([5, 65]), PRESETS["snapmla"])


# ---------------------------------------------------------------------------------------------- fp32 absorption
def test_fp32_absorption_reads_16bit_weights_with_fp32_products():
    g = torch.Generator().manual_seed(1)
    w_uk = torch.randn(4, 16, 32, generator=g).bfloat16()
    w_uv = torch.randn(4, 16, 32, generator=g).bfloat16()
    q = torch.randn(3, 2, 4, 24, generator=g).bfloat16()
    got = absorb_query(q[..., :16], q[..., 16:], w_uk, fp32=True)
    want = absorb_query(q[..., :16].float(), q[..., 16:].float(), w_uk.float())
    assert got.dtype == torch.float32 and torch.equal(got, want)  # CPU: the exact conversion fallback
    o = torch.randn(3, 2, 4, 32, generator=g)
    assert torch.equal(project_output(o, w_uv, fp32=True), project_output(o, w_uv.float()))
    hi, mid, lo = split_bf16(o * 1e3)
    assert torch.equal(hi.double() + mid.double() + lo.double(), (o * 1e3).double())


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["snapmla", "bf16"])
def test_cuda_graph_replay_matches_eager_triton(preset):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = "cuda"
    # kernel widths (powers of two >= 16): kv_lora_rank 64, RoPE 16
    model = tiny_model("deepseek_v3", dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16).to(dev)
    snapquant.patch(model, preset, backend="triton")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (B, 70), generator=g).to(dev)
    cg = LatentCache(preset, model, max_cache_len=200)
    ce = LatentCache(preset, model)
    with torch.no_grad():
        model(ids, **_ck(model, cg))
        model(ids, **_ck(model, ce))
    graph = DecodeGraph(model, cg)
    assert graph.graph is not None
    for _ in range(5):
        nxt = torch.randint(3, 256, (B, 1), generator=g).to(dev)
        got = graph.step(nxt).clone()
        want = _eager(model, ce, nxt)
        # Same kernels and bit-exact quantize-append; the fp32 absorption products may sum in another order.
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    _same_cache(cg, ce)
    graph.rewind(1)
    ce.crop(-1)
    nxt = torch.randint(3, 256, (B, 1), generator=g).to(dev)
    got = graph.step(nxt).clone()
    want = _eager(model, ce, nxt)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


@pytest.mark.parametrize("preset", ["snapmla", "ds_v32", "bf16"])
def test_kernel_append_writes_the_same_bits_as_the_reference_quantizer(preset):
    """The CUDA static append (fused Triton quantize-append on the store's buffers viewed as pages), run in
    the Triton interpreter, against the quantize_kv path it replaces."""
    pytest.importorskip("triton")
    from snapquant import PRESETS

    cfg = PRESETS[preset].replace(block_size=32) if preset == "ds_v32" else PRESETS[preset]
    g = torch.Generator().manual_seed(3)
    layers = [LatentLayer(cfg, 64, 16, max_cache_len=100) for _ in range(2)]
    prompt = (torch.randn(2, 70, 64, generator=g).bfloat16(), torch.randn(2, 70, 16, generator=g).bfloat16())
    for layer in layers:
        layer.append(*prompt)
    layers[0].store.kernel_append = True
    layers[1].store.kernel_append = False
    for _ in range(2):
        new = (torch.randn(2, 1, 64, generator=g).bfloat16() * 3, torch.randn(2, 1, 16, generator=g).bfloat16())
        for layer in layers:
            layer.append_static(*new)
    assert layers[0].store._static  # the paged view was built
    a, b = layers[0].store, layers[1].store
    assert torch.equal(a.lengths, b.lengths) and a.lengths.tolist() == [72, 72]
    for name in ("nope", "rope"):
        pa, pb = a.parts[name], b.parts[name]
        assert torch.equal(pa.codes.view(torch.uint8) if pa.codes.element_size() == 1 else pa.codes,
                           pb.codes.view(torch.uint8) if pb.codes.element_size() == 1 else pb.codes)
        assert (pa.scale is None) == (pb.scale is None)
        if pa.scale is not None:
            assert torch.equal(pa.scale, pb.scale)
