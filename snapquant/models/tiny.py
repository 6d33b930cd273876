"""Tiny random MLA models of every supported family, for tests and smoke runs (build in ~10 ms).

`tiny_config(family, moe=..., q_lora=..., interleave=..., yarn=...)` returns a config of the family's
text model with kv_lora_rank 32, RoPE 8, 4 heads, 2 MLA layers; `tiny_model(...)` instantiates the
causal LM (or the text model where the family has no text-only causal LM) in fp32, eval mode.
`FAMILY_AXES[family]` says which variant axes the family has (RoPE interleave and YaRN only exist in
some families; q_lora_rank is mandatory in some).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
MOE: dict[str, Any] = dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                           n_group=1, topk_group=1)
DSA: dict[str, Any] = dict(index_topk=2048, index_head_dim=16, index_n_heads=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@dataclass(frozen=True)
class FamilySpec:
    config_cls: str
    model_cls: str
    q_lora_optional: bool = True
    interleave: bool = False  # has config.rope_interleave
    yarn: bool = True  # rope_parameters accepts yarn
    moe: str = "first_k"  # how MoE layers are chosen: first_k | mlp_layer_types | always | none
    extra: tuple[tuple[str, Any], ...] = ()
    attn: str = "sdpa"  # default attention implementation (some families only implement eager)


FAMILIES: dict[str, FamilySpec] = {
    "deepseek_v2": FamilySpec("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": FamilySpec("DeepseekV3Config", "DeepseekV3ForCausalLM", interleave=True),
    "deepseek_v32": FamilySpec("DeepseekV32Config", "DeepseekV32ForCausalLM", q_lora_optional=False,
                               extra=tuple(DSA.items())),
    "longcat_flash": FamilySpec("LongcatFlashConfig", "LongcatFlashForCausalLM", q_lora_optional=False, moe="always"),
    "glm4_moe_lite": FamilySpec("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", interleave=True,
                                moe="mlp_layer_types"),
    "minicpm3": FamilySpec("MiniCPM3Config", "MiniCPM3ForCausalLM", moe="none"),
    "mistral4": FamilySpec("Mistral4Config", "Mistral4ForCausalLM", interleave=True),
    "youtu": FamilySpec("YoutuConfig", "YoutuForCausalLM", interleave=True, moe="none"),
    "kimi_linear": FamilySpec("KimiLinearConfig", "KimiLinearForCausalLM", yarn=False, moe="mlp_layer_types"),
    "axk1": FamilySpec("AXK1Config", "AXK1ForCausalLM", q_lora_optional=False, interleave=True,
                       moe="mlp_layer_types"),
    "axk2": FamilySpec("AXK2Config", "AXK2ForCausalLM", q_lora_optional=False, moe="mlp_layer_types",
                       extra=tuple(DSA.items())),
    "glm_moe_dsa": FamilySpec("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", q_lora_optional=False,
                              moe="mlp_layer_types", extra=tuple(DSA.items())),
    "bailing_hybrid": FamilySpec("BailingHybridConfig", "BailingHybridForCausalLM", yarn=False, moe="first_k"),
    "hy_v4": FamilySpec("HYV4Config", "HYV4ForCausalLM", q_lora_optional=False, moe="mlp_layer_types",
                        extra=tuple(DSA.items()), attn="eager"),
    "hy_v4_vl": FamilySpec("HYV4VLTextConfig", "HYV4VLTextModel", q_lora_optional=False, moe="mlp_layer_types",
                           yarn=False, attn="eager",
                           extra=(*DSA.items(), ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0,
                                                                       "mrope_section": [2, 1, 1]}))),
    "dots3_note": FamilySpec("Dots3NoteTextConfig", "Dots3NoteTextModel", q_lora_optional=False,
                             moe="mlp_layer_types", extra=tuple(DSA.items())),
    "mistral_large4": FamilySpec("MistralLarge4TextConfig", "MistralLarge4TextModel", q_lora_optional=False,
                                 extra=tuple(DSA.items())),
    "glm5_next": FamilySpec("Glm5NextTextConfig", "Glm5NextTextModel", q_lora_optional=False,
                            moe="mlp_layer_types", yarn=False,
                            extra=(*DSA.items(), ("qk_rope_head_dim", 0))),  # NoPE DSA layers
}


def available_families() -> list[str]:
    """Families of FAMILIES present in the installed transformers (older versions lack some)."""
    import importlib.util

    return [f for f in FAMILIES if importlib.util.find_spec(f"transformers.models.{f}") is not None]


def family_axes(family: str) -> dict[str, tuple]:
    """Variant values a family supports: {'moe': (False, True), 'q_lora': ..., 'interleave': ..., 'yarn': ...}."""
    spec = _spec(family)
    return {
        "moe": (False, True) if spec.moe != "none" else (False,),
        "q_lora": (True, False) if spec.q_lora_optional else (True,),
        "interleave": (True, False) if spec.interleave else (None,),
        "yarn": (False, True) if spec.yarn else (False,),
    }


def _spec(family: str) -> FamilySpec:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ConfigError(f"no tiny config for family {family!r}; known: {', '.join(FAMILIES)}") from None


def _module(family: str, kind: str):
    return importlib.import_module(f"transformers.models.{family}.{kind}_{family}")


def tiny_config(family: str, *, moe: bool = False, q_lora: bool = True, interleave: bool | None = None,
                yarn: bool = False, layers: int = 2, **overrides):
    spec = _spec(family)
    kw: dict[str, Any] = dict(BASE)
    kw["num_hidden_layers"] = layers
    kw["q_lora_rank"] = 32 if (q_lora or not spec.q_lora_optional) else None
    kw.update(dict(spec.extra))
    if spec.moe != "none":
        kw.update(MOE)
        if spec.moe == "first_k":
            kw["first_k_dense_replace"] = 1 if moe else layers
        elif spec.moe == "mlp_layer_types":
            kw["mlp_layer_types"] = ["dense"] + ["sparse" if moe else "dense"] * (layers - 1)
    if spec.interleave and interleave is not None:
        kw["rope_interleave"] = interleave
    if family == "longcat_flash":  # two MLA blocks per layer; its own names for the MLP sizes
        kw.update(num_layers=layers, head_dim=8, ffn_hidden_size=128, expert_ffn_hidden_size=32, moe_topk=2,
                  zero_expert_num=1, n_routed_experts=4)
        for k in ("num_hidden_layers", "intermediate_size", "moe_intermediate_size", "n_shared_experts",
                  "num_experts_per_tok", "n_group", "topk_group"):
            kw.pop(k, None)
    if family in ("kimi_linear", "bailing_hybrid"):  # layer 0 linear attention, the rest MLA
        kw["layer_types"] = ["linear_attention"] + ["full_attention"] * layers
        kw["num_hidden_layers"] = layers + 1
        if "mlp_layer_types" in kw:
            kw["mlp_layer_types"] = ["dense"] + kw["mlp_layer_types"]
        kw.update(linear_head_dim=16, linear_num_heads=4) if family == "kimi_linear" else None
    if family == "glm5_next":  # by default 3 of 4 layers are linear attention: make them all MLA
        kw["layer_types"] = ["full_attention"] * layers  # (5.2x renames these "indexed_attention")
    kw.update(overrides)
    cls = getattr(_module(family, "configuration"), spec.config_cls)
    if yarn:  # keep family-specific RoPE fields (e.g. mistral4's llama_4_scaling_beta), switch to YaRN
        defaults = dict(getattr(cls(**kw), "rope_parameters", None) or {})
        kw["rope_parameters"] = {**defaults, **YARN}
    return cls(**kw)


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
               attn_implementation: str | None = None, **config_kw):
    """A randomly initialised tiny model of `family` (eval mode). Deterministic for a given seed."""
    cfg = tiny_config(family, **config_kw)
    cfg._attn_implementation = attn_implementation or _spec(family).attn
    cls = getattr(_module(family, "modeling"), _spec(family).model_cls)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.to(dtype).eval()
