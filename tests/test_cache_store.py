"""The latent store (snapquant.attention.storage) and absorbed attention over it, against the foundation.

Stored codes and scales must be exactly what `quantize_kv` gives for the same tokens (per-token formats),
or what the documented policy gives (per-tensor / per-channel scales frozen at the first append; KIVI
groups quantized when complete, residual kept raw), and attention over the store must equal the
reference decode (or the float64 oracle, for KIVI's two segments) on the same stored values.
"""

from __future__ import annotations

import math

import pytest
import torch

from snapquant import (
    PRESETS,
    attention_fp64,
    bytes_per_token,
    mla_decode_reference,
    project_output,
    quantize_kv,
    split_kv_b,
)
from snapquant.attention.absorbed import absorbed_attention, merge_lse
from snapquant.attention.masks import hf_visibility, indices_visibility, token_validity
from snapquant.attention.storage import DenseLatentStore, native_format
from snapquant.errors import ConfigError, ShapeError
from snapquant.quant.scales import get_scale_format

R, D = 64, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def _chunks(B=3, sizes=(7, 1, 5, 1, 1), seed=0, pad_first=(0, 2, 5)):
    """Random latent/rope chunks [B, S, w] with left padding in the first chunk."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, S in enumerate(sizes):
        lat = torch.randn(B, S, R, generator=g) * (1 + 3 * torch.rand(B, S, 1, generator=g))
        rope = torch.randn(B, S, D, generator=g) * 4
        valid = torch.ones(B, S, dtype=torch.bool)
        if i == 0:
            for b, p in enumerate(pad_first[:B]):
                valid[b, :p] = False
                lat[b, :p] = float("nan")  # padding may hold anything; it must never be stored
        out.append((lat, rope, valid))
    return out


def _valid_tokens(chunks, b):
    lat = torch.cat([c[0][b][c[2][b]] for c in chunks])
    rope = torch.cat([c[1][b][c[2][b]] for c in chunks])
    return lat, rope


ROW_PRESETS = ["snapmla", "snapmla_kv_only", "rope_fp8_per_token", "e5m2_per_token", "int8_per_token",
               "per_tensor_fp8"]


@pytest.mark.parametrize("preset", [*ROW_PRESETS, "ds_v32", "ds_v32_vllm", "ds_model1"])
def test_stored_codes_equal_quantize_kv_of_the_valid_tokens(preset):
    cfg = PRESETS[preset].replace(block_size=32) if "ds_" in preset else PRESETS[preset]
    store = DenseLatentStore(cfg, R, D, torch.float32)
    chunks = _chunks()
    for lat, rope, valid in chunks:
        store.append(lat, rope, valid)
    (seg,) = store.segments()
    for b in range(3):
        lat, rope = _valid_tokens(chunks, b)
        n = lat.shape[0]
        assert int(store.lengths[b]) == n
        want = quantize_kv(lat[None], rope[None], cfg)
        got_l, got_r = seg.kv.latent, seg.kv.rope
        assert torch.equal(got_l.data[b, :n].view(torch.uint8) if got_l.data.element_size() == 1 else got_l.data[b, :n],
                           want.latent.data[0].view(torch.uint8) if want.latent.data.element_size() == 1
                           else want.latent.data[0])
        assert torch.equal(got_l.token_scales()[b, :n], want.latent.token_scales()[0])
        assert torch.equal(got_r.codes_f32()[b, :n], want.rope.codes_f32()[0])
        assert torch.equal(got_r.token_scales()[b, :n], want.rope.token_scales()[0])
    tokens = int(store.lengths.sum())
    shared = sum(p.scale.numel() * p.scale.element_size() for p in store.parts.values() if p.layout == "shared")
    assert store.nbytes() == tokens * bytes_per_token(cfg, R, D) + shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_config_keeps_the_model_dtype_exactly(dtype):
    store = DenseLatentStore(PRESETS["bf16"], R, D, dtype)
    chunks = [(lat.to(dtype), rope.to(dtype), v) for lat, rope, v in _chunks()]
    for lat, rope, valid in chunks:
        store.append(lat, rope, valid)
    (seg,) = store.segments()
    assert seg.kv.latent.fmt is native_format(dtype)
    lat_all, rope_all = store.dequantize(dtype)
    for b in range(3):
        lat, rope = _valid_tokens(chunks, b)
        assert torch.equal(lat_all[b, : lat.shape[0]], lat) and torch.equal(rope_all[b, : rope.shape[0]], rope)
    assert store.nbytes() == int(store.lengths.sum()) * (R + D) * torch.finfo(dtype).bits // 8


def test_per_tensor_dynamic_scale_is_frozen_at_the_first_append():
    cfg = PRESETS["per_tensor_fp8_dynamic"]
    store = DenseLatentStore(cfg, R, D, torch.float32)
    chunks = _chunks()
    store.append(*chunks[0])
    lat0, rope0, valid0 = chunks[0]
    qmax = 448.0
    want_n = lat0[valid0].abs().amax() / qmax  # over valid tokens of the whole batch (padding excluded)
    want_r = rope0[valid0].abs().amax() / qmax
    later = [(lat * 3, rope * 3, v) for lat, rope, v in chunks[1:]]  # beyond the frozen range: saturates
    for c in later:
        store.append(*c)
    (seg,) = store.segments()
    assert torch.equal(seg.kv.latent.scale_f32().flatten(), want_n.flatten())
    assert torch.equal(seg.kv.rope.scale_f32().flatten(), want_r.flatten())
    for b in range(3):
        lat, rope = _valid_tokens([chunks[0], *later], b)
        n = lat.shape[0]
        want = quantize_kv(lat[None], rope[None], cfg, nope_scale=want_n.view(1, 1, 1), rope_scale=want_r.view(1, 1, 1))
        assert torch.equal(seg.kv.latent.codes_f32()[b, :n], want.latent.codes_f32()[0])
        assert torch.equal(seg.kv.rope.codes_f32()[b, :n], want.rope.codes_f32()[0])
    assert float(seg.kv.latent.codes_f32().abs().max()) == 448.0  # later tokens saturate, never inf / NaN
    assert store.nbytes() == int(store.lengths.sum()) * bytes_per_token(cfg, R, D) + 2 * 4


def test_per_channel_whole_sequence_scale_is_frozen_per_request():
    cfg = PRESETS["int4_kivi"].replace(token_group=None)
    store = DenseLatentStore(cfg, R, D, torch.float32)
    chunks = _chunks()
    for c in chunks:
        store.append(*c)
    (seg,) = store.segments()
    lat0, _, valid0 = chunks[0]
    for b in range(3):
        want = lat0[b][valid0[b]].abs().amax(0) / 7.0
        assert torch.allclose(seg.kv.latent.scale_f32()[b, 0], want, rtol=0, atol=0)


def _kivi_store(G=4, sizes=(7, 1, 5, 1, 1, 3), dtype=torch.float32):
    cfg = PRESETS["int4_kivi"].replace(token_group=G)
    store = DenseLatentStore(cfg, R, D, dtype)
    chunks = _chunks(sizes=sizes)
    for c in chunks:
        store.append(*c)
    return cfg, store, chunks


def test_kivi_quantizes_complete_groups_and_keeps_the_residual_raw():
    G = 4
    cfg, store, chunks = _kivi_store(G)
    q_seg, r_seg = store.segments()
    for b in range(3):
        lat, rope = _valid_tokens(chunks, b)
        n = lat.shape[0]
        full = n // G * G
        assert int(q_seg.lengths[b]) == full and int(r_seg.lengths[b]) == n - full
        assert int(r_seg.offset[b]) == full
        for g in range(full // G):
            sl = slice(g * G, (g + 1) * G)
            want = quantize_kv(lat[None, sl], rope[None, sl], cfg)  # per_channel over exactly G tokens
            assert torch.equal(q_seg.kv.latent.codes_f32()[b, sl], want.latent.codes_f32()[0])
            assert torch.equal(q_seg.kv.latent.token_scales()[b, sl], want.latent.token_scales()[0])
            assert torch.equal(q_seg.kv.rope.codes_f32()[b, sl], want.rope.codes_f32()[0])
        assert torch.equal(r_seg.kv.latent.codes_f32()[b, : n - full], lat[full:])
        assert torch.equal(r_seg.kv.rope.codes_f32()[b, : n - full], rope[full:])
    groups = int((store.lengths // G).sum())
    res = int((store.lengths % G).sum())
    want_bytes = groups * G * (R + D) // 2 + groups * (R + D) * 4 + res * (R + D) * 4
    assert store.nbytes() == want_bytes
    # at a multiple of G the cache costs exactly bytes_per_token (360 B at DeepSeek dims)
    assert bytes_per_token(PRESETS["int4_kivi"]) == 360
    assert groups * G * bytes_per_token(cfg, R, D) == groups * G * (R + D) // 2 + groups * (R + D) * 4


def test_kivi_crop_only_within_the_residual_window():
    G = 4
    _, store, _ = _kivi_store(G)
    lengths = store.lengths.clone()
    q_len = store.quantized_lengths().clone()
    store.truncate(torch.maximum(q_len, lengths - 1))
    assert torch.equal(store.quantized_lengths(), q_len)
    with pytest.raises(ConfigError, match="completed token group"):
        store.truncate(q_len - 1)


def _attention_inputs(B=3, H=4, dn=8, dv=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(H * (dn + dv), R, generator=g) / math.sqrt(R)
    w_uk, w_uv = split_kv_b(w, H, dn, dv)
    q = torch.randn(B, H, 1, dn + D, generator=g)
    return q, w_uk, w_uv


@pytest.mark.parametrize("preset", ["snapmla", "ds_v32", "ds_v32_vllm", "per_tensor_fp8_dynamic",
                                    "per_tensor_fp8_vllm", "bf16"])
def test_decode_over_the_store_equals_the_reference_on_the_same_cache(preset):
    cfg = PRESETS[preset].replace(block_size=32) if preset.startswith("ds_v32") else PRESETS[preset]
    store = DenseLatentStore(cfg, R, D, torch.float32)
    for c in _chunks(sizes=(40, 30, 1)):
        store.append(*c)
    q, w_uk, w_uv = _attention_inputs()
    (seg,) = store.segments()
    positions = (store.lengths - 1)[:, None]
    round16 = not cfg.is_identity
    out = absorbed_attention(q, w_uk, w_uv, [seg], positions, softmax_scale=0.2, config=cfg,
                             backend=mla_decode_reference, round_16bit=round16)
    from snapquant import absorb_query

    qq = q.transpose(1, 2)[:, 0]
    q_abs = absorb_query(qq[..., :8], qq[..., 8:], w_uk)
    o, _ = mla_decode_reference(q_abs, seg.kv, store.lengths, 0.2, cfg, round_16bit=round16)
    want = project_output(o, w_uv)
    assert torch.equal(out[:, 0], want)


def test_kivi_decode_merges_segments_like_one_softmax():
    """Two segments merged by LSE == float64 attention over [dequantized groups ++ raw residual]."""
    G = 8
    cfg, store, chunks = _kivi_store(G, sizes=(20, 7, 1, 1))
    q, w_uk, w_uv = _attention_inputs()
    positions = (store.lengths - 1)[:, None]
    out = absorbed_attention(q, w_uk, w_uv, store.segments(), positions, softmax_scale=0.2, config=cfg,
                             backend=mla_decode_reference, round_16bit=False)
    lat, rope = store.dequantize(torch.float64)
    from snapquant import absorb_query

    qq = q.transpose(1, 2)[:, 0].double()
    q_abs = absorb_query(qq[..., :8], qq[..., 8:], w_uk.double())
    o, _ = attention_fp64(q_abs, lat, rope, store.lengths, 0.2)
    want = project_output(o, w_uv.double())
    assert torch.allclose(out[:, 0].double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # and the dequantized store really is [quantize_kv(groups) ++ raw residual]
    for b in range(3):
        lat_b, _ = _valid_tokens(chunks, b)
        n = lat_b.shape[0]
        full = n // G * G
        assert torch.equal(lat[b, full:n].float(), lat_b[full:])


def test_general_path_with_full_visibility_equals_the_standard_path():
    cfg = PRESETS["snapmla"]
    store = DenseLatentStore(cfg, R, D, torch.float32)
    for c in _chunks(sizes=(70, 1)):
        store.append(*c)
    q, w_uk, w_uv = _attention_inputs()
    (seg,) = store.segments()
    positions = (store.lengths - 1)[:, None]
    L = store.max_length
    vis = (torch.arange(L).view(1, 1, L) < store.lengths.view(-1, 1, 1))
    kw = dict(softmax_scale=0.2, config=cfg, backend=mla_decode_reference, round_16bit=True)
    a = absorbed_attention(q, w_uk, w_uv, [seg], positions, **kw)
    b = absorbed_attention(q, w_uk, w_uv, [seg], positions, visibility=vis, **kw)
    assert torch.allclose(a, b, rtol=0, atol=1e-6 * float(a.abs().max()))


def test_sparse_visibility_gathers_the_selected_rows():
    """A DSA-style selection equals the reference run on quantize_kv of exactly the selected tokens."""
    cfg = PRESETS["snapmla"]
    store = DenseLatentStore(cfg, R, D, torch.float32)
    chunks = _chunks(sizes=(90, 1))
    for c in chunks:
        store.append(*c)
    q, w_uk, w_uv = _attention_inputs()
    L = store.max_length
    g = torch.Generator().manual_seed(5)
    vis = (torch.rand(3, 1, L, generator=g) < 0.3) & (torch.arange(L).view(1, 1, L) < store.lengths.view(-1, 1, 1))
    positions = (store.lengths - 1)[:, None]
    out = absorbed_attention(q, w_uk, w_uv, store.segments(), positions, softmax_scale=0.2, config=cfg,
                             backend=mla_decode_reference, round_16bit=True, visibility=vis)
    from snapquant import absorb_query

    for b in range(3):
        lat, rope = _valid_tokens(chunks, b)
        sel = vis[b, 0, : lat.shape[0]]
        kv = quantize_kv(lat[sel][None], rope[sel][None], cfg)
        qq = q.transpose(1, 2)[b : b + 1, 0]
        o, _ = mla_decode_reference(absorb_query(qq[..., :8], qq[..., 8:], w_uk), kv, None, 0.2, cfg)
        want = project_output(o, w_uv)[0]
        assert torch.allclose(out[b, 0], want, rtol=0, atol=1e-6 * float(want.abs().max()))


def test_merge_lse_and_sinks_equal_one_softmax():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, R + D, generator=g, dtype=torch.float64)
    lat = torch.randn(2, 30, R, generator=g, dtype=torch.float64)
    rope = torch.randn(2, 30, D, generator=g, dtype=torch.float64)
    full, lse = attention_fp64(q, lat, rope, None, 0.1)
    a = attention_fp64(q, lat[:, :11], rope[:, :11], None, 0.1)
    b = attention_fp64(q, lat[:, 11:], rope[:, 11:], None, 0.1)
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], -math.inf))
    out, lse2 = merge_lse([a[0], b[0], empty[0]], [a[1], b[1], empty[1]])
    assert torch.allclose(out, full, atol=1e-12) and torch.allclose(lse2, lse, atol=1e-12)
    # a sink logit per head is a softmax column with value 0: out * sigmoid(lse - sink)
    sink = torch.randn(4, generator=g, dtype=torch.float64)
    k = torch.cat([lat, rope], -1)
    logits = torch.einsum("bhd,btd->bht", q, k) * 0.1
    p = torch.softmax(torch.cat([logits, sink.view(1, 4, 1).expand(2, 4, 1)], -1), -1)[..., :-1]
    want = torch.einsum("bht,btr->bhr", p, lat)
    assert torch.allclose(full * torch.sigmoid(lse - sink)[..., None], want, atol=1e-12)


def test_masks_are_read_in_every_format():
    B, S, T = 2, 3, 5
    causal = torch.ones(S, T, dtype=torch.bool).tril(T - S)
    pad = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    want = causal[None] & pad[:, None]
    as_bool = want[:, None]
    as_float = torch.where(as_bool, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(hf_visibility(as_bool, B, S, T), want)
    assert torch.equal(hf_visibility(as_float, B, S, T), want)
    assert torch.equal(hf_visibility(pad.long(), B, S, T), want)  # flash-attention 2D padding mask
    assert hf_visibility(None, B, S, T) is None
    assert torch.equal(token_validity(as_bool, B, S, T - S), torch.tensor([[1, 1, 1], [1, 1, 1]], dtype=torch.bool))
    prefill = (torch.ones(5, 5, dtype=torch.bool).tril()[None] & pad[:, None])[:, None]
    assert token_validity(prefill, B, 5, 0).tolist() == pad.tolist()
    with pytest.raises(ShapeError, match="additive attention biases"):
        hf_visibility(as_float + 0.5, B, S, T)
    with pytest.raises(ShapeError, match="covers"):
        hf_visibility(as_bool, B, S, T + 1)
    with pytest.raises(ShapeError, match="not supported"):
        hf_visibility(object(), B, S, T)
    sel = indices_visibility(torch.tensor([[[0, 4, 9]]]), 5)
    assert sel.tolist() == [[[True, False, False, False, True]]]


def test_store_rejects_bad_shapes_and_batch_changes():
    store = DenseLatentStore(PRESETS["snapmla"], R, D, torch.float32)
    with pytest.raises(ShapeError, match="latent"):
        store.append(torch.zeros(2, 3, R + 1), torch.zeros(2, 3, D))
    store.append(torch.zeros(2, 3, R), torch.zeros(2, 3, D))
    with pytest.raises(ShapeError, match="batch"):
        store.append(torch.zeros(3, 1, R), torch.zeros(3, 1, D))
    with pytest.raises(ShapeError, match="activation dtype"):
        native_format(torch.float64)
    assert get_scale_format("fp32").bytes_per_scale == 4
