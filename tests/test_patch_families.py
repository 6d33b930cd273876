"""Every supported MLA family, tiny random fp32 models, batch 3 with left padding.

- preset bf16 reproduces the unpatched model: prefill and 32 greedy decode steps bit for bit; with
  `prefill: quantized` (the absorbed pipeline, S > 1 too) within 1e-4 of the logit scale, same tokens;
- snapmla (and other presets) give the same numbers as an independent reference model (HF's own seam +
  quantize_kv + mla_decode_reference, tests/support/patching.py), and really change the logits; the
  reference's attentions read the patched run's attention inputs, so both quantize the same numbers;
- unpatch restores bit-identical logits.
"""

from __future__ import annotations

import copy

import pytest
import torch

import snapquant
from snapquant import PRESETS
from snapquant.cache import LatentCache, LatentLayer
from snapquant.models.registry import REFUSED
from snapquant.models.tiny import available_families, family_axes, tiny_model
from tests.support.patching import (
    batch_inputs,
    generate,
    greedy,
    recording_attention_inputs,
    reference_copy,
    rel_diff,
    replaying_attention_inputs,
)

SUPPORTED = [f for f in available_families() if f not in REFUSED]
# max |diff| / max |logit|. What the compared runs may differ by is fp32 reassociation only: no rounding
# to a coarser format sits downstream of a difference (the bf16 preset of an fp32 model rounds nothing;
# a quantized preset's reference reads the patched run's attention inputs, see _patched_and_reference;
# the one other discontinuity, MoE top-k routing, would need two expert scores tied to ~1e-7).
# Each fp32 sum of n terms is off by at most n * 2^-24 of the sum of their magnitudes (n <= 128 in these
# models: <= 8e-6), and a 2-3 layer model chains a handful of them; observed <= 7e-7 with the default,
# AVX2 and AVX512 kernels. A real wiring error moves the logits by the quantization's own size
# (>= 1e-3), hence also the "quantization is really on" checks against multiples of TOL.
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


def _variants(family: str) -> list[dict]:
    """Two variants covering every axis value of the family (dense/MoE, q-LoRA on/off, interleave, YaRN)."""
    ax = family_axes(family)
    first = dict(moe=ax["moe"][0], q_lora=ax["q_lora"][0], interleave=ax["interleave"][0], yarn=ax["yarn"][0])
    second = dict(moe=ax["moe"][-1], q_lora=ax["q_lora"][-1], interleave=ax["interleave"][-1], yarn=ax["yarn"][-1])
    return [first] if first == second else [first, second]


CASES = [pytest.param(f, v, id=f"{f}-{'-'.join(f'{k}={x}' for k, x in v.items())}")
         for f in SUPPORTED for v in _variants(f)]


def _run(model, ids, am, steps):
    """(prefill scores, step scores, tokens, cache): generate for causal LMs, a forward loop otherwise."""
    prefill, step_scores, toks, cache = greedy(model, ids, am, 0)
    if hasattr(model, "generate") and hasattr(model, "lm_head"):
        step_scores, toks, cache = generate(model, ids, am, steps)
    else:
        _, step_scores, toks, cache = greedy(model, ids, am, steps)
    return prefill, step_scores, toks, cache


@pytest.mark.parametrize("family,variant", CASES)
def test_bf16_preset_reproduces_unpatched(family, variant):
    model = tiny_model(family, **variant)
    ids, am = batch_inputs()
    valid = am.bool()
    p0, s0, t0, _ = _run(model, ids, am, 32)
    snapquant.patch(model, "bf16")
    try:
        p1, s1, t1, cache = _run(model, ids, am, 32)
        # prefill: the stock computation on fresh activations; decode (identity config, reference backend):
        # the stock attention over the exact cache. Bit for bit.
        assert torch.equal(p0[valid], p1[valid])
        assert torch.equal(s0, s1), f"decode logits differ by {rel_diff(s0, s1, s0):.2e} of the scale"
        assert torch.equal(t0, t1)
        assert cache is not None and any(type(layer).__name__ == "LatentLayer" for layer in cache.layers)
        # prefill: quantized with an identity config runs the absorbed S > 1 path over the stored cache
        snapquant.patch(model, PRESETS["bf16"].replace(prefill="quantized"))
        p2, s2, t2, _ = _run(model, ids, am, 4)
        assert rel_diff(p0[valid], p2[valid]) <= TOL
        assert rel_diff(s0[:4], s2, s0) <= TOL and torch.equal(t0[:, :4], t2)
    finally:
        snapquant.unpatch(model)
    p3, s3, t3, _ = _run(model, ids, am, 32)
    assert torch.equal(p0, p3) and torch.equal(s0, s3) and torch.equal(t0, t3), "unpatch must restore exactly"


def _patched_and_reference(model, config, ids, am, steps):
    """(patched run, reference run) of `greedy`; the reference's MLA attentions read the hidden states the
    patched ones read (tests.support.patching: otherwise fp32 noise upstream of a rounding can tip it)."""
    ref = reference_copy(model, config)
    with snapquant.patched(model, config), recording_attention_inputs(model) as inputs:
        run = greedy(model, ids, am, steps)
    with replaying_attention_inputs(ref, inputs):
        ref_run = greedy(ref, ids, am, steps)
    return run, ref_run


@pytest.mark.parametrize("family", SUPPORTED)
def test_snapmla_matches_independent_reference(family):
    model = tiny_model(family, **_variants(family)[0])
    ids, am = batch_inputs()
    valid = am.bool()
    base_p, base_s, _, _ = greedy(model, ids, am, 6)
    (p, s, t, cache), (ref_p, ref_s, ref_t, _) = _patched_and_reference(model, "snapmla", ids, am, 6)
    assert rel_diff(ref_p[valid], p[valid], base_p) <= TOL  # bf16 prefill: stock
    assert rel_diff(ref_s, s, base_s) <= TOL, f"patched vs reference: {rel_diff(ref_s, s, base_s):.2e}"
    assert torch.equal(ref_t, t)
    # quantization is really on: the first decode step moves by far more than the tolerance
    assert rel_diff(base_s[0], s[0], base_s) > 5 * TOL
    # the patched decode really went through a quantized cache: one snapmla LatentLayer per MLA attention,
    # holding every real token (prompt without its padding, plus the 6 decoded) and nothing else
    latent_layers = [layer for layer in cache.layers if isinstance(layer, LatentLayer)]
    n_mla = sum(hasattr(m, "kv_a_proj_with_mqa") for m in model.modules())
    assert n_mla > 0 and len(latent_layers) == n_mla, f"{len(latent_layers)} latent cache layers, {n_mla} MLA"
    n_real = int(am.sum()) + 6 * am.shape[0]
    assert all(layer.config == PRESETS["snapmla"] and layer.num_stored_tokens() == n_real for layer in latent_layers)


_CONSISTENCY = [
    ("deepseek_v3", {}, PRESETS["snapmla"].replace(prefill="quantized")),
    ("deepseek_v3", {"kv_lora_rank": 128}, PRESETS["ds_v32"]),
    ("deepseek_v3", {"kv_lora_rank": 128}, PRESETS["ds_model1"]),
    ("deepseek_v3", {}, PRESETS["rope_fp8_per_token"]),
    ("deepseek_v3", {}, PRESETS["int8_per_token"]),
    ("deepseek_v3", {}, PRESETS["e5m2_per_token"]),
    ("deepseek_v3", {}, PRESETS["snapmla_naive_pv"]),
    ("deepseek_v3", {}, PRESETS["per_tensor_fp8"]),
    ("deepseek_v2", {}, PRESETS["snapmla_q_fp8"].replace(prefill="quantized")),
    # DSA top-k smaller than the context: decode gathers each query's selected rows
    # (eager: transformers 5.15's sdpa path folds the top-k mask into a bool mask incorrectly)
    ("deepseek_v32", {"index_topk": 4, "attn_implementation": "eager"}, PRESETS["snapmla"]),
    ("deepseek_v32", {"index_topk": 4, "attn_implementation": "eager"}, PRESETS["snapmla"].replace(prefill="quantized")),
    ("hy_v4", {"index_topk": 5}, PRESETS["snapmla"]),  # + attention sinks
    ("longcat_flash", {}, PRESETS["snapmla"].replace(prefill="quantized")),
    ("kimi_linear", {}, PRESETS["snapmla_kv_only"]),
]
CONSISTENCY = [c for c in _CONSISTENCY if c[0] in SUPPORTED]


@pytest.mark.parametrize("family,kw,config", CONSISTENCY,
                         ids=[f"{f}-{c.label()}-{c.prefill}-{kw}" for f, kw, c in CONSISTENCY])
def test_quantized_presets_match_independent_reference(family, kw, config):
    model = tiny_model(family, **kw)
    ids, am = batch_inputs()
    valid = am.bool()
    base_p, base_s, _, _ = greedy(model, ids, am, 5)
    (p, s, t, _), (ref_p, ref_s, ref_t, _) = _patched_and_reference(model, config, ids, am, 5)
    assert rel_diff(ref_p[valid], p[valid], base_p) <= TOL
    assert rel_diff(ref_s, s, base_s) <= TOL
    assert torch.equal(ref_t, t)
    if config.prefill == "quantized":
        assert rel_diff(base_p[valid], p[valid], base_p) > 20 * TOL


def test_replayed_attentions_read_the_recorded_inputs():
    """The replay helper really feeds every MLA attention the recorded hidden states: a copy whose
    embeddings differ (so its own attention inputs differ) reproduces the recorded run's attention
    outputs bit for bit under replay, and not without it."""
    model = tiny_model("deepseek_v3")
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(1.5)
    ids, am = batch_inputs()

    def attention_outputs(m, replay=None):
        outs = []
        mods = [x for x in m.modules() if hasattr(x, "kv_a_proj_with_mqa")]
        hooks = [x.register_forward_hook(lambda _m, _a, out: outs.append(out[0].clone())) for x in mods]
        try:
            if replay is None:
                greedy(m, ids, am, 2)
            else:
                with replaying_attention_inputs(m, replay):
                    greedy(m, ids, am, 2)
        finally:
            for h in hooks:
                h.remove()
        return outs

    with recording_attention_inputs(model) as inputs:
        want = attention_outputs(model)
    assert all(torch.equal(a, b) for a, b in zip(want, attention_outputs(other, inputs), strict=True))
    assert not torch.equal(want[0], attention_outputs(other)[0])


def test_bf16_model_cache_is_the_1152_byte_layout():
    """In a bf16 model the identity cache is bf16: bytes/token = bytes_per_token(bf16) (1152 at DeepSeek dims)."""
    model = tiny_model("deepseek_v3", dtype=torch.bfloat16)
    ids, am = batch_inputs()
    snapquant.patch(model, "bf16")
    _, _, cache = generate(model, ids, am, 4)
    assert isinstance(cache, LatentCache)
    assert cache.bytes_per_token() == snapquant.bytes_per_token(PRESETS["bf16"], 32, 8) == (32 + 8) * 2
    assert snapquant.bytes_per_token(PRESETS["bf16"]) == 1152
