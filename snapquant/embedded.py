"""The embedded model: a small DeepSeek-V3-architecture LM trained here on Python source.

`load_embedded()` returns it with its tokenizer, offline. Weights live in
`snapquant/assets/embedded/` (safetensors shards, tokenizer, model card); they are produced by
`scripts/train_embedded_model.py`. `EMBEDDED_ARCH` is the architecture the trainer builds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EMBEDDED_PATH = Path(__file__).resolve().parent / "assets" / "embedded"

# MLA with q-LoRA and interleaved RoPE, one MoE layer (the last), 4K positions; ~14.6M parameters
# (tied embeddings) = ~29 MB in bf16. kv_lora_rank 256 is divisible by every preset's block size.
EMBEDDED_ARCH: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,  # must equal num_attention_heads for transformers' MLA
    "q_lora_rank": 192,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "rope_interleave": True,
    "first_k_dense_replace": 5,
    "moe_intermediate_size": 256,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 1,
}

# A few-second CPU stand-in with the same structure (for the trainer's --tiny smoke run and tests).
TINY_ARCH: dict[str, Any] = {
    **EMBEDDED_ARCH,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 1024,
}

WEIGHT_GLOBS = ("model.safetensors", "model-*.safetensors")


def embedded_config(arch: dict[str, Any] | None = None, **overrides: Any):
    """A `DeepseekV3Config` for the embedded architecture (or `arch`), with overrides."""
    from transformers import DeepseekV3Config

    kw = {**(EMBEDDED_ARCH if arch is None else arch), **overrides}
    if kw["num_key_value_heads"] != kw["num_attention_heads"]:
        from .errors import ConfigError

        raise ConfigError("num_key_value_heads must equal num_attention_heads (transformers' MLA expands "
                          f"one latent to all heads); got {kw['num_key_value_heads']} vs {kw['num_attention_heads']}")
    return DeepseekV3Config(**kw)


def has_weights(path: Path | str = EMBEDDED_PATH) -> bool:
    """True when `path` holds a config and safetensors weights (i.e. the model has been trained)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(any(path.glob(g)) for g in WEIGHT_GLOBS)


def load_tokenizer(path: Path | str = EMBEDDED_PATH):
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    # Left padding, whatever an older tokenizer_config.json says: the model is decoder-only, so batched
    # `generate` must continue every row right after its last real token.
    return AutoTokenizer.from_pretrained(str(path), padding_side="left")


def load_embedded(dtype: Any = "bfloat16", device: Any = "cpu", path: Path | str = EMBEDDED_PATH,
                  attn_implementation: str = "sdpa"):
    """(model, tokenizer) of the embedded model, in eval mode, loaded without any network access.

    `dtype` is a torch dtype or its name ("bfloat16", "float32"); `device` anything `.to()` takes.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not has_weights(path):
        raise FileNotFoundError(
            f"no embedded model weights in {path}: train them with scripts/train_embedded_model.py "
            "(see its docstring) and install them with its `install` command")
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            from .errors import ConfigError

            raise ConfigError(f"dtype={dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn_implementation,
                                                 local_files_only=True)
    model.to(device).eval()
    return model, load_tokenizer(path)
