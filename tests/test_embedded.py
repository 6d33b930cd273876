"""The embedded model: architecture within its size bounds, offline loading, shipped artefacts."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from snapquant import PRESETS
from snapquant.embedded import (
    EMBEDDED_PATH,
    TINY_ARCH,
    embedded_config,
    has_weights,
    load_embedded,
    load_tokenizer,
)
from snapquant.errors import ConfigError


def test_architecture_meets_the_size_bounds():
    cfg = embedded_config()
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    assert 2 * n_params <= 30e6  # bf16 bytes
    assert 384 <= cfg.hidden_size <= 512 and 6 <= cfg.num_hidden_layers <= 8
    assert cfg.num_attention_heads == cfg.num_key_value_heads == 8
    assert 128 <= cfg.kv_lora_rank <= 256 and cfg.qk_rope_head_dim == 32
    assert cfg.q_lora_rank and cfg.rope_interleave and cfg.max_position_embeddings == 4096
    assert 1 <= cfg.num_hidden_layers - cfg.first_k_dense_replace <= 2  # MoE layers
    assert cfg.vocab_size == len(load_tokenizer())
    for preset in PRESETS.values():
        preset.check_dims(cfg.kv_lora_rank, cfg.qk_rope_head_dim)


def test_kv_heads_must_equal_heads():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        embedded_config(num_key_value_heads=1)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(embedded_config(TINY_ARCH)).eval()
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    for f in EMBEDDED_PATH.glob("tokenizer*"):
        shutil.copy2(f, path / f.name)
    return model, path


def test_load_embedded_roundtrip_offline(saved_tiny, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref, path = saved_tiny
    model, tok = load_embedded(dtype="float32", path=path)
    assert not model.training and model.dtype == torch.float32
    ids = tok("def main():\n    return 1\n", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5)
    half, _ = load_embedded(dtype=torch.bfloat16, path=path)
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16


def test_load_embedded_errors(tmp_path, saved_tiny):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_embedded(path=tmp_path)
    with pytest.raises(ConfigError, match="dtype"):
        load_embedded(dtype="float99", path=saved_tiny[1])


needs_weights = pytest.mark.skipif(not has_weights(), reason="embedded weights not trained/installed yet")


@needs_weights
def test_shipped_model_loads_and_generates():
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_PATH, local_files_only=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    model, tok = load_embedded(dtype="float32")
    ids = tok("import os\n\n\ndef main():\n", return_tensors="pt").input_ids
    text = tok.decode(model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:])
    assert len(text.strip()) > 0


@needs_weights
def test_shipped_artefacts_and_quality_bar():
    shards = list(EMBEDDED_PATH.glob("*.safetensors"))
    assert all(f.stat().st_size < 15e6 for f in shards) and sum(f.stat().st_size for f in shards) <= 30e6
    for name in ("README.md", "training_log.jsonl", "tokenizer.json", "corpus_manifest.jsonl"):
        assert (EMBEDDED_PATH / name).is_file(), name
    state = json.loads((EMBEDDED_PATH / "training_state.json").read_text())
    scores = state["bf16_scores"]
    assert scores["sq_kv_retrieval_1k"] >= 0.9 and scores["sq_kv_retrieval_2k"] >= 0.9
    assert scores["sq_kv_retrieval_4k"] >= 0.7
    assert "sq_kv_retrieval_4k" in (EMBEDDED_PATH / "README.md").read_text()


@needs_weights
def test_shipped_model_generates_with_its_cache():
    """generation_config.json must not switch the cache off: a patched model's generate reads it."""
    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(EMBEDDED_PATH).use_cache is True
    model, _ = load_embedded(dtype="float32")
    assert model.generation_config.use_cache is True


@needs_weights
def test_batched_generate_pads_left_without_a_warning():
    from tests.support.log_capture import transformers_warnings

    model, tok = load_embedded(dtype="float32")
    enc = tok(["def main():\n", "import os\nimport sys\n"], return_tensors="pt", padding=True)
    with transformers_warnings() as logged:
        out = model.generate(**enc, max_new_tokens=2, do_sample=False)
    assert out.shape == (2, enc.input_ids.shape[1] + 2)
    assert not [m for m in logged if "padding" in m], logged


def test_long_texts_are_tokenized_without_the_model_length_warning():
    """Fidelity/sensitivity cut rows from whole documents and the tasks count tokens of long documents:
    neither feeds the model more than its context, so transformers' length warning is not printed."""
    from snapquant.analysis.text import token_batches
    from snapquant.eval.tasks.sq_utils import token_counter
    from tests.support.log_capture import transformers_warnings

    long_text = "def f(x):\n    return x + 1\n\n\n" * 800  # > 4096 tokens
    with transformers_warnings() as logged:
        tok = load_tokenizer()
        assert len(tok(long_text)["input_ids"]) > tok.model_max_length  # a plain call does warn ...
    assert [m for m in logged if "Token indices sequence length" in m]
    with transformers_warnings() as logged:
        rows = token_batches(load_tokenizer(), [long_text, "x = 1\n"], seq_len=128, num_sequences=40)
        n = token_counter(load_tokenizer())(long_text)
    assert rows.shape == (40, 128) and n > 4096
    assert not [m for m in logged if "Token indices sequence length" in m], logged  # ... these do not
