"""LatentLayer / LatentCache behind the HF Cache API: sizes, crop, reorder, batch select / repeat, and the
generation modes that use them (beam search, assisted decoding), plus bytes per token for every preset."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import snapquant
from snapquant import PRESETS, bytes_per_token
from snapquant.cache import LatentCache, LatentLayer
from snapquant.errors import ConfigError
from snapquant.models.tiny import available_families, tiny_model
from tests.support.patching import batch_inputs, cache_kwarg, generate, greedy, rel_diff

R, D = 32, 8


pytestmark = pytest.mark.usefixtures("one_thread")


def _filled_layer(config="snapmla", seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = LatentLayer(config, R, D)
    lat = torch.randn(3, 6, R, generator=g)
    rope = torch.randn(3, 6, D, generator=g)
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[1, :2] = False
    valid[2, :4] = False
    layer.append(lat, rope, valid)
    layer.append(torch.randn(3, 1, R, generator=g), torch.randn(3, 1, D, generator=g))
    return layer


def test_layer_reports_hf_sizes_and_dequantizes_at_hf_positions():
    layer = _filled_layer("bf16")
    assert layer.get_seq_length() == 7 and layer.get_mask_sizes(1) == (8, 0) and layer.get_max_length() == -1
    assert layer.lengths.tolist() == [7, 5, 3]
    lat, rope = layer.dense(torch.float32)
    assert rope.shape == (3, 7, D)
    assert lat.shape == (3, 7, R) and torch.all(lat[1, :2] == 0) and torch.all(lat[2, :4] == 0)
    assert not torch.all(lat[2, 4:] == 0)
    assert layer.hf_positions()[2, :3].tolist() == [4, 5, 6]


def test_plain_update_api_stores_and_returns_the_dequantized_cache():
    layer = LatentLayer("snapmla")
    k = torch.randn(2, 1, 5, R)
    v = torch.randn(2, 1, 5, D)
    keys, values = layer.update(k, v)
    assert keys.shape == (2, 1, 5, R) and values.shape == (2, 1, 5, D)
    want = snapquant.quantize_kv(k[:, 0], v[:, 0], PRESETS["snapmla"]).dequantize()
    assert torch.equal(keys[:, 0], want[0]) and torch.equal(values[:, 0], want[1])


@pytest.mark.parametrize("arg", [-3, 4, "max_length"])
def test_crop_keeps_the_first_positions(arg):
    layer = _filled_layer()
    ref = _filled_layer()
    before = layer.store.segments()[0].kv.latent.codes_f32().clone()
    if arg == "max_length":
        layer.crop(max_length=4)
    else:
        layer.crop(arg)  # HF >= 5.18: negative = tokens to remove; older: positive = length to keep
    assert layer.get_seq_length() == 4
    assert layer.lengths.tolist() == [4, 2, 0]  # request 2 had 4 leading padding positions
    kept = layer.store.segments()[0].kv.latent.codes_f32()
    assert torch.equal(kept[0, :4], before[0, :4]) and torch.equal(kept[1, :2], before[1, :2])
    layer.crop(0)
    assert layer.get_seq_length() == 4
    assert ref.get_seq_length() == 7


def test_reorder_select_repeat_move_whole_requests():
    layer = _filled_layer()
    codes = layer.store.segments()[0].kv.latent.codes_f32().clone()
    lengths = layer.lengths.clone()
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert layer.lengths.tolist() == lengths[[2, 0, 1]].tolist()
    assert torch.equal(layer.store.segments()[0].kv.latent.codes_f32()[1, :7], codes[0, :7])
    layer.batch_select_indices(torch.tensor([False, True, True]))
    assert layer.lengths.tolist() == [7, 5]
    layer.batch_repeat_interleave(2)
    assert layer.lengths.tolist() == [7, 7, 5, 5]
    assert layer.stored.shape == (4, 7)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0


def test_indexer_keys_follow_the_cache():
    layer = _filled_layer()
    layer.update_indexer(torch.randn(3, 7, 4))
    layer.crop(-2)
    assert layer.indexer_keys.shape == (3, 5, 4)
    layer.batch_repeat_interleave(2)
    assert layer.indexer_keys.shape == (6, 5, 4)


@pytest.mark.skipif("kimi_linear" not in available_families(), reason="kimi_linear needs transformers >= 5.17")
def test_latent_cache_structure_for_hybrid_and_two_block_models():
    kimi = tiny_model("kimi_linear")  # layer 0 linear attention, layers 1-2 MLA
    cache = LatentCache("snapmla", kimi)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[0] != "LatentLayer" and kinds[1:] == ["LatentLayer", "LatentLayer"]
    longcat = tiny_model("longcat_flash")  # two MLA blocks per decoder layer: cache layers 0..3
    assert [type(layer).__name__ for layer in LatentCache("snapmla", longcat).layers] == ["LatentLayer"] * 4


PRESET_NAMES = list(PRESETS)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_generates_and_counts_its_bytes(preset):
    """Cache bytes per token per layer == bytes_per_token(config) (+ O(1) frozen scales, + KIVI residual)."""
    cfg = PRESETS[preset]
    model = tiny_model("deepseek_v3", kv_lora_rank=128)  # 128 so ds_v32's 128-channel blocks fit
    ids, am = batch_inputs(length=40, pads=(0, 3, 9))
    snapquant.patch(model, cfg)
    try:
        logits, _, cache = generate(model, ids, am, 5)
    finally:
        snapquant.unpatch(model)
    assert torch.isfinite(logits).all()
    assert isinstance(cache, LatentCache) and len(cache.latent_layers) == 2
    r, d = 128, 8
    for layer in cache.latent_layers:
        lengths = layer.lengths
        assert lengths.tolist() == [40 + 4, 37 + 4, 31 + 4]  # real tokens only: padding is never stored
        tokens = int(lengths.sum())
        store = layer.store
        if cfg.is_identity:  # the model's own dtype (fp32 here): (r + d) * 4 bytes
            want = tokens * (r + d) * 4
        elif store.group is not None:
            G = store.group
            groups = int((lengths // G).sum())
            want = groups * G * bytes_per_token(cfg, r, d) + int((lengths % G).sum()) * (r + d) * 4
        else:
            shared = sum(p.scale.numel() * p.scale.element_size() for p in store.parts.values()
                         if p.layout == "shared")
            want = tokens * bytes_per_token(cfg, r, d) + shared
        assert layer.nbytes() == want
    layouts = {p.layout for p in cache.latent_layers[0].store.parts.values()}
    if not cfg.is_identity and layouts <= {"row", "none"}:  # per-token layouts: exactly the config's cost
        assert cache.bytes_per_token() == bytes_per_token(cfg, r, d)


def test_beam_search_matches_unpatched_with_the_identity_preset():
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs(batch=2, pads=(0, 4))
    kw = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=am, **kw)
        with snapquant.patched(model, "bf16"):
            got = model.generate(input_ids=ids, attention_mask=am, **kw)
            snapquant.patch(model, "snapmla")
            quant = model.generate(input_ids=ids, attention_mask=am, **kw)  # reorders a real FP8 cache
    assert torch.equal(want, got)
    assert quant.shape == want.shape


def test_assisted_decoding_crops_and_matches_unpatched():
    """Prompt-lookup assisted decoding verifies several tokens at once and crops rejected ones."""
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs(batch=1, length=24, pads=(0,))
    ids[0, 12:] = ids[0, :12]  # repetition so prompt lookup proposes candidates
    kw = dict(max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=am, **kw)
        with snapquant.patched(model, "bf16"):
            got = model.generate(input_ids=ids, attention_mask=am, **kw)
    assert torch.equal(want, got)


def test_forward_without_cache_argument_converts_hf_dynamic_cache_in_place():
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    _, s0, t0, _ = greedy(model, ids, am, 3)
    with snapquant.patched(model, "bf16"):
        _, s1, t1, cache = greedy(model, ids, am, 3)  # model(ids) builds a DynamicCache: converted in place
    assert isinstance(cache, DynamicCache) and all(isinstance(x, LatentLayer) for x in cache.layers)
    assert rel_diff(s0, s1) <= 1e-4 and torch.equal(t0, t1)


def test_cache_filled_without_snapquant_is_refused():
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=am, use_cache=True)
    stock = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    snapquant.patch(model, "snapmla")
    try:
        with pytest.raises(ConfigError, match="written without snapquant"), torch.no_grad():
            model(input_ids=ids[:, -1:], attention_mask=torch.cat([am, am[:, -1:]], 1),
                  **{cache_kwarg(model): stock})
    finally:
        snapquant.unpatch(model)


def test_static_cache_is_refused():
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    with snapquant.patched(model, "snapmla"), pytest.raises(ConfigError, match="static"):
        generate(model, ids, am, 2, cache_implementation="static")


def test_kivi_decode_step_equals_oracle_over_the_stored_cache(monkeypatch):
    """Through the model: the last decode step's attention == float64 attention over what the cache holds."""
    from snapquant import absorb_query, attention_fp64, project_output
    from snapquant.patching import _MLAHook

    cfg = PRESETS["int4_kivi"].replace(token_group=4)
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    seen = []
    original = _MLAHook.attend

    def spy(self, query, mask, scaling, kwargs):
        out = original(self, query, mask, scaling, kwargs)
        lat, rope = self.call.layer.store.dequantize(torch.float64)
        seen.append((self, query.detach().clone(), scaling, out, lat, rope, self.call.layer.lengths.clone()))
        return out

    monkeypatch.setattr(_MLAHook, "attend", spy)
    with snapquant.patched(model, cfg):
        greedy(model, ids, am, 6)  # crosses group boundaries: groups of 4 get quantized as they complete
    hook, q, tau, out, lat, rope, lengths = seen[-1]
    w_uk, w_uv = (w.detach() for w in hook.weights())
    dn = hook.module.qk_nope_head_dim
    qq = q.transpose(1, 2)[:, 0].double()
    o, _ = attention_fp64(absorb_query(qq[..., :dn], qq[..., dn:], w_uk.double()), lat, rope, lengths, tau)
    want = project_output(o, w_uv.double())
    assert torch.allclose(out[:, 0].double(), want, rtol=0, atol=2e-3 * float(want.abs().max()))  # bf16 P
    assert hook.call is None  # the per-call context is cleared after every forward
    assert math.isfinite(float(out.abs().max()))
    # both segments were in play: complete int4 groups and a raw residual window
    assert int(lengths.min()) >= 4 and bool((lengths % 4 != 0).any())
