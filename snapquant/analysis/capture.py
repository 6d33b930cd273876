"""Capturing what an MLA model caches, per layer, without patching it.

Since transformers 5.15 the DeepSeek-family attention writes the post-`kv_a_layernorm` latent into
the cache's keys slot and the rotated shared key `k_rot` into its values slot, so one plain
forward with `use_cache=True` yields both for every layer in the returned `DynamicCache`. The
query is not cached: we read it by routing the attention call through a registered attention
function that records `query_states` (post-RoPE, per head) and then runs the stock SDPA
attention, so the model's own outputs are unchanged. The same name is registered as a mask
function (sdpa's), because an unregistered name would silently get no causal mask.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ShapeError
from ..models.stepping import output_cache

CAPTURE_IMPL = "snapquant_capture"


@dataclass
class LayerCapture:
    layer_idx: int
    latent: torch.Tensor
    """[B, T, kv_lora_rank] as cached (post kv_a_layernorm)."""
    rope: torch.Tensor
    """[B, T, qk_rope_head_dim] as cached (rotated)."""
    query: torch.Tensor | None
    """[B, H, S, qk_nope_head_dim + qk_rope_head_dim] the attention saw (post-RoPE)."""
    scaling: float | None
    module: Any
    f64: dict = field(default_factory=dict, repr=False)
    """Float64 copies of the weights / query, made once per layer by analyses that need them."""

    @property
    def kv_lora_rank(self) -> int:
        return self.latent.shape[-1]

    @property
    def rope_dim(self) -> int:
        return self.rope.shape[-1]


def _register() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    if CAPTURE_IMPL in ALL_MASK_ATTENTION_FUNCTIONS:
        return

    def capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        sink = getattr(module, "_snapquant_capture", None)
        if sink is not None:
            sink.append((query.detach(), scaling))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)

    AttentionInterface.register(CAPTURE_IMPL, capture_attention)
    AttentionMaskInterface.register(CAPTURE_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def mla_attention_modules(model: Any) -> list[Any]:
    """The MLA attention modules of a model (those with kv_a_proj_with_mqa and kv_b_proj), in layer order."""
    mods = [m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa") and hasattr(m, "kv_b_proj")]
    if not mods:
        raise ShapeError(
            f"{type(model).__name__} has no MLA attention (no module with kv_a_proj_with_mqa and kv_b_proj); "
            f"snapquant analyses DeepSeek-family latent-cache models"
        )
    return sorted(mods, key=lambda m: getattr(m, "layer_idx", 0))


@contextmanager
def _capturing(model: Any):
    _register()
    mods = mla_attention_modules(model)
    configs = {id(model.config): model.config}
    for m in mods:
        if hasattr(m, "config"):
            configs[id(m.config)] = m.config
    saved = {k: c._attn_implementation for k, c in configs.items()}
    for m in mods:
        m._snapquant_capture = []
    try:
        for c in configs.values():
            c._attn_implementation = CAPTURE_IMPL
        yield mods
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]
        for m in mods:
            m._snapquant_capture = None


@torch.no_grad()
def capture_mla(model: Any, input_ids: torch.Tensor) -> list[LayerCapture]:
    """One teacher-forced forward over `input_ids` [B, T] (no padding) -> per-layer latent, RoPE, query."""
    if input_ids.dim() != 2:
        raise ShapeError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    device = next(model.parameters()).device
    with _capturing(model) as mods:
        out = model(input_ids=input_ids.to(device), use_cache=True)
        cache = output_cache(out)
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise ShapeError(f"{type(model).__name__} returned {type(cache).__name__}, not a layered Cache")
        caps = []
        for m in mods:
            idx = m.layer_idx
            lay = layers[idx]
            keys, values = lay.keys, lay.values
            r, d = m.kv_lora_rank, m.qk_rope_head_dim
            if keys is None or keys.shape[-1] != r or values.shape[-1] != d:
                raise ShapeError(
                    f"{type(model).__name__} layer {idx}: the cache does not hold the MLA latent "
                    f"(keys {None if keys is None else tuple(keys.shape)}, expected [..., {r}]); "
                    f"transformers>=5.15 is needed"
                )
            q, scaling = m._snapquant_capture[-1] if m._snapquant_capture else (None, None)
            caps.append(LayerCapture(idx, keys[:, 0].float(), values[:, 0].float(), q, scaling, m))
    return caps
