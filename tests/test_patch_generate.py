"""`generate` on a patched model: it must read the quantized cache, and the bf16 preset is the unpatched model.

- a generation without a cache (`use_cache=False`, passed or from the model's generation_config) would re-run
  the stock attention every step and never read the quantized cache: refused, naming use_cache; forward
  calls without a cache (lm-eval loglikelihood scoring, teacher-forced fidelity) are not generations and
  keep running; `prefill: quantized` quantizes those calls too, so its generation without a cache is allowed;
- the `bf16` preset reproduces the unpatched model bit for bit on a bf16 model: 3 left-padded prompts,
  greedy tokens and every step's logits equal (the absorbed pipeline rounds its bf16 query and P elsewhere,
  an ulp that flips exact ties, which is why decode runs the stock attention for identity configs).
"""

from __future__ import annotations

import pytest
import torch

import snapquant
from snapquant import PRESETS
from snapquant.cache import LatentCache
from snapquant.embedded import has_weights, load_embedded
from snapquant.errors import ConfigError
from snapquant.models.tiny import tiny_model
from tests.support.patching import batch_inputs, generate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_generate_without_cache_is_refused_naming_use_cache():
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    with snapquant.patched(model, "snapmla"):
        with pytest.raises(ConfigError, match=r"^use_cache: .*'snapmla'.*use_cache=False was passed"):
            model.generate(input_ids=ids, attention_mask=am, max_new_tokens=2, use_cache=False, pad_token_id=0)
        model.generation_config.use_cache = False  # as the shipped embedded model once had it
        with pytest.raises(ConfigError, match="generation_config has use_cache=False"):
            model.generate(input_ids=ids, attention_mask=am, max_new_tokens=2, pad_token_id=0)
        # asking for the cache explicitly overrides the model's default, and the LatentCache is read
        _, _, cache = generate(model, ids, am, 2, use_cache=True)
        assert isinstance(cache, LatentCache) and cache.latent_layers[0].num_stored_tokens() > 0


def test_forward_without_cache_is_not_a_generation():
    """Loglikelihood scoring calls the model without a cache: not refused; with `prefill: bf16` it is the
    stock computation by design (quantization shows in decode), bit for bit."""
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    valid = am.bool()
    with torch.no_grad():
        base = model(input_ids=ids, attention_mask=am, use_cache=False).logits
        with snapquant.patched(model, "snapmla"):
            scored = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    assert torch.equal(base[valid], scored[valid])


def test_quantized_prefill_generates_the_same_without_a_cache():
    """With `prefill: quantized` every no-cache step attends to the quantized latent: for a per-token
    (causal-consistent) format the same greedy tokens as cached decode, so it is allowed."""
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    with snapquant.patched(model, PRESETS["snapmla"].replace(prefill="quantized")):
        with torch.no_grad():
            cached = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, min_new_tokens=4,
                                    do_sample=False, pad_token_id=0, use_cache=True)
            uncached = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, min_new_tokens=4,
                                      do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_bf16_preset_on_a_bf16_model_is_bit_exact(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    ids, am = batch_inputs()  # 3 prompts, left-padded by 0, 3 and 6 tokens
    s0, t0, _ = generate(model, ids, am, 12)
    with snapquant.patched(model, "bf16"):
        s1, t1, cache = generate(model, ids, am, 12)
    assert isinstance(cache, LatentCache)  # the patched decode really ran over the latent cache
    assert torch.equal(t0, t1) and torch.equal(s0, s1)


@pytest.mark.skipif(not has_weights(), reason="embedded weights not trained/installed yet")
def test_bf16_preset_on_the_shipped_bf16_model_greedy_decode_is_unchanged():
    """The shipped model in bf16, three prompts left-padded by its own tokenizer, greedy decode."""
    model, tok = load_embedded(dtype="bfloat16")
    prompts = ["def main():\n", "import os\nimport sys\n\n\nclass Config:\n", "x = {'a': 1, 'b': 2}\nassert x['a'] =="]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc.attention_mask[:, 0] == 0).any() and (enc.attention_mask[:, -1] == 1).all()  # left padding
    s0, t0, _ = generate(model, enc.input_ids, enc.attention_mask, 8)
    with snapquant.patched(model, "bf16"):
        s1, t1, _ = generate(model, enc.input_ids, enc.attention_mask, 8)
    assert torch.equal(t0, t1) and torch.equal(s0, s1)
