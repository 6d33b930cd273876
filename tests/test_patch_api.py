"""snapquant.patch / unpatch / patched: errors, re-configuration, backends, mask formats, device_map."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import snapquant
from snapquant import PRESETS
from snapquant.errors import ConfigError
from snapquant.models.tiny import tiny_model
from snapquant.patching import ATTN_IMPLEMENTATION, is_patched, patched_config
from tests.support.patching import batch_inputs, generate, greedy, rel_diff

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


def test_non_mla_model_is_refused_naming_the_class():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ConfigError, match="LlamaForCausalLM has no MLA attention"):
        snapquant.patch(llama, "snapmla")
    assert not is_patched(llama)


def test_old_transformers_is_refused_naming_the_version(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.14.2")
    with pytest.raises(ConfigError, match=r"transformers 5\.14\.2 is too old.*>=5\.15"):
        snapquant.patch(tiny_model("deepseek_v3"), "snapmla")


def test_unknown_family_is_refused_naming_the_class():
    from torch import nn

    class FancyMLAAttention(nn.Module):  # an MLA attention from a family snapquant does not know
        def __init__(self):
            super().__init__()
            self.kv_a_proj_with_mqa = nn.Linear(4, 4)
            self.kv_b_proj = nn.Linear(4, 4)

    holder = nn.Sequential(FancyMLAAttention())
    with pytest.raises(ConfigError, match=r"FancyMLAAttention.*no adapter"):
        snapquant.patch(holder, "snapmla")


def test_backend_errors_are_clear():
    model = tiny_model("deepseek_v3")
    with pytest.raises(ConfigError, match=r"backend='tritn' is not valid.*did you mean 'triton'"):
        snapquant.patch(model, "snapmla", backend="tritn")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="triton"):
            snapquant.patch(model, "snapmla", backend="triton")
    assert not is_patched(model)
    with pytest.raises(ConfigError, match="preset='snapmal' is not valid"):
        snapquant.patch(model, "snapmal")


def test_width_errors_name_the_field():
    with pytest.raises(ConfigError, match="block_size=128 does not divide the nope width 32"):
        snapquant.patch(tiny_model("deepseek_v3"), "ds_v32")


def test_patch_twice_reconfigures_and_context_manager_restores():
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    base = greedy(model, ids, am, 3)[1]
    snapquant.patch(model, "bf16")
    snapquant.patch(model, "snapmla")  # re-configure: hooks are not stacked
    assert patched_config(model) == PRESETS["snapmla"]
    assert sum(1 for m in model.modules() if "_snapquant_hook" in m.__dict__) == 2
    twice = greedy(model, ids, am, 3)[1]
    snapquant.unpatch(model)
    with snapquant.patched(model, "snapmla"):
        once = greedy(model, ids, am, 3)[1]
        with snapquant.patched(model, "bf16"):
            assert patched_config(model) == PRESETS["bf16"]
        assert patched_config(model) == PRESETS["snapmla"]  # the inner block restored the outer config
    assert not is_patched(model)
    assert torch.equal(twice, once)
    assert torch.equal(greedy(model, ids, am, 3)[1], base)
    assert model.config._attn_implementation == "sdpa"  # the model config is never switched


def test_model_level_functions_are_exported():
    assert callable(snapquant.patch) and callable(snapquant.unpatch) and callable(snapquant.patched)
    assert snapquant.LatentCache.__name__ == "LatentCache"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("pads", [(0, 3, 6), (0, 0, 0)], ids=["left_padding", "no_padding"])
def test_mask_formats_and_no_padding(attn, pads):
    """eager gives additive float masks, sdpa bool masks or None (plain causal): all read the same."""
    model = tiny_model("deepseek_v3", attn_implementation=attn)
    ids, am = batch_inputs(pads=pads)
    p0, s0, t0, _ = greedy(model, ids, am, 6)
    with snapquant.patched(model, PRESETS["bf16"].replace(prefill="quantized")):
        p1, s1, t1, _ = greedy(model, ids, am, 6)
    valid = am.bool()
    assert rel_diff(p0[valid], p1[valid]) <= TOL and rel_diff(s0, s1, s0) <= TOL and torch.equal(t0, t1)


def test_packed_sequences_without_cache_use_the_custom_mask():
    """position_ids that restart mark packed sequences: HF builds a block-diagonal mask; prefill=quantized
    must honour it (the general gather path), matching two separate runs."""
    model = tiny_model("deepseek_v3")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 256, (1, 6), generator=g), torch.randint(3, 256, (1, 5), generator=g)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(6), torch.arange(5)])[None]
    cfg = PRESETS["snapmla"].replace(prefill="quantized")
    with snapquant.patched(model, cfg), torch.no_grad():
        both = model(input_ids=packed, position_ids=pos, use_cache=False).logits
        la = model(input_ids=a, use_cache=False).logits
        lb = model(input_ids=b, use_cache=False).logits
    assert rel_diff(both[:, :6], la) <= TOL and rel_diff(both[:, 6:], lb) <= TOL


def test_use_cache_false_prefill_quantized_sees_quantization():
    model = tiny_model("deepseek_v3")
    ids, am = batch_inputs()
    valid = am.bool()
    with torch.no_grad():
        base = model(input_ids=ids, attention_mask=am, use_cache=False).logits
        with snapquant.patched(model, "snapmla"):
            same = model(input_ids=ids, attention_mask=am, use_cache=False).logits
        with snapquant.patched(model, PRESETS["snapmla"].replace(prefill="quantized")):
            quant = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    assert torch.equal(base[valid], same[valid])  # prefill bf16: the stock computation
    assert rel_diff(base[valid], quant[valid]) > 5 * TOL


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate for device_map")
def test_device_map_auto_with_offloaded_weights(tmp_path):
    """from_pretrained(device_map='auto') with weights offloaded to disk (meta tensors + accelerate hooks)."""
    from transformers import AutoModelForCausalLM

    src = tiny_model("deepseek_v3")
    src.save_pretrained(tmp_path / "m")
    ids, am = batch_inputs()
    want_logits, want_toks, _ = generate(src, ids, am, 6)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map="auto", max_memory={"cpu": 200_000},
                                                 offload_folder=str(tmp_path / "off"), dtype=torch.float32)
    att = next(m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa"))
    assert hasattr(att, "_hf_hook") and att.kv_b_proj.weight.device.type == "meta"
    with snapquant.patched(model, "bf16"):
        logits, toks, cache = generate(model, ids, am, 6)
    assert type(cache).__name__ == "LatentCache"
    assert rel_diff(want_logits, logits) <= TOL and torch.equal(want_toks, toks)
    after, _, _ = generate(model, ids, am, 6)
    assert torch.equal(after, want_logits)


def test_attention_name_is_internal():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    model = tiny_model("deepseek_v3")
    with snapquant.patched(model, "snapmla"):
        assert ATTN_IMPLEMENTATION in AttentionInterface._global_mapping
        assert ATTN_IMPLEMENTATION in AttentionMaskInterface._global_mapping  # no unregistered-mask trap
        att = next(m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa"))
        with pytest.raises(ConfigError, match="internal to snapquant"):
            AttentionInterface._global_mapping[ATTN_IMPLEMENTATION](att, None, None, None, None)


# ---------------------------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_identity_preset_is_exact_and_bf16_model_runs_quantized():
    dev = torch.device("cuda")
    model = tiny_model("deepseek_v3").to(dev)
    ids, am = (t.to(dev) for t in batch_inputs())
    _, s0, t0, _ = greedy(model, ids, am, 16)
    with snapquant.patched(model, "bf16"):
        _, s1, t1, _ = greedy(model, ids, am, 16)
    assert rel_diff(s0, s1, s0) <= TOL and torch.equal(t0, t1)
    half = tiny_model("deepseek_v3", dtype=torch.bfloat16).to(dev)
    _, h0, _, _ = greedy(half, ids, am, 4)
    with snapquant.patched(half, "bf16"):
        _, h1, _, cache = greedy(half, ids, am, 4)
    assert rel_diff(h0[0], h1[0], h0) <= 3e-2  # bf16 rounding of q and P in both, in different places
    with snapquant.patched(half, "snapmla"):
        _, h2, _, cache = greedy(half, ids, am, 4)
    layer = next(x for x in cache.layers if type(x).__name__ == "LatentLayer")
    assert layer.store.parts["nope"].codes.dtype == torch.float8_e4m3fn and layer.store.lengths.device.type == "cuda"
    assert torch.isfinite(h2).all()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_device_map_over_two_gpus(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model("deepseek_v3", layers=4).save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map, dtype=torch.float32)
    ids, am = (t.to("cuda:0") for t in batch_inputs())
    want, want_t, _ = generate(model, ids, am, 12)
    with snapquant.patched(model, "bf16"):
        got, got_t, _ = generate(model, ids, am, 12)
    assert rel_diff(want, got.to(want.device), want) <= TOL and torch.equal(want_t, got_t.to(want_t.device))
    with snapquant.patched(model, "snapmla"):
        _, _, cache = generate(model, ids, am, 4)
    devices = [layer.store.lengths.device for layer in cache.latent_layers]
    assert [d.index for d in devices] == [0, 0, 1, 1]


@pytest.mark.gpu
@needs_cuda
def test_auto_backend_runs_the_triton_kernel_on_cuda():
    pytest.importorskip("triton")
    from snapquant.attention.backends import resolve_backend

    kernels = pytest.importorskip("snapquant.kernels")
    dev = torch.device("cuda")
    cfg = PRESETS["snapmla"]
    if not kernels.supports(cfg):
        pytest.skip("the kernels do not implement snapmla")
    assert resolve_backend("auto", cfg, dev).name == "triton"
    model = tiny_model("deepseek_v3", kv_lora_rank=64, qk_rope_head_dim=16, dtype=torch.bfloat16).to(dev)
    ids, am = (t.to(dev) for t in batch_inputs())
    with snapquant.patched(model, cfg, backend="reference"):
        _, ref, ref_t, _ = greedy(model, ids, am, 8)
    with snapquant.patched(model, cfg, backend="auto"):
        _, got, got_t, _ = greedy(model, ids, am, 8)
    assert rel_diff(ref[0], got[0], ref) <= 2e-3
    same = int((ref_t == got_t).all(0).long().cumprod(0).sum())  # steps before any token differs
    assert rel_diff(ref[:same], got[:same], ref) <= 2e-3
