"""One small adapter per MLA model family, and discovery of MLA attention modules in a model.

Since transformers 5.15 every MLA family in transformers shares one attention skeleton: project the
query, compute the latent (`kv_a_proj_with_mqa` -> `kv_a_layernorm`) and the rotated shared key, call
`cache.update(latent, k_rot, layer_idx)`, expand with `self.expand_kv` (kv_b_proj), then call the
attention function chosen by `config._attn_implementation`. The patch (snapquant.patch) hooks exactly
those three seams, so the family's own code still computes the query, RoPE (interleaved or not,
V2's complex freqs), longcat's LoRA scales, DSA indexers, gates and sinks. One generic adapter
therefore covers the families; per family only the checks differ (what the seams cannot express).

Families are keyed by their transformers module name (`transformers.models.<family>`), so families
missing from an older transformers are simply never matched.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class MLAAdapter:
    """How snapquant reads one family's MLA attention module."""

    family: str
    notes: str = ""
    check: Callable[[nn.Module], None] | None = None
    """Raise ConfigError for module configurations the patch cannot run exactly."""

    def dims(self, module: nn.Module) -> tuple[int, int]:
        """(kv_lora_rank, qk_rope_head_dim) of the cached latent."""
        return int(module.kv_lora_rank), int(module.qk_rope_head_dim)

    def validate(self, module: nn.Module) -> None:
        missing = [a for a in ("kv_b_proj", "num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank",
                               "qk_rope_head_dim", "layer_idx", "expand_kv") if not hasattr(module, a)]
        if missing:
            raise ConfigError(f"{type(module).__name__} ({self.family}) lacks {missing}; this transformers version "
                              f"changed the MLA attention layout")
        if self.check is not None:
            self.check(module)
        if cache_layout(type(module)) is None:
            import transformers

            raise ConfigError(
                f"{type(module).__name__} in transformers {transformers.__version__} does not call cache.update and "
                f"self.expand_kv in its forward; snapquant.patch cannot find the latent-cache seam"
            )
        if int(module.qk_rope_head_dim) <= 0:
            raise ConfigError(f"{type(module).__name__} (layer {module.layer_idx}) has no RoPE part "
                              f"(qk_rope_head_dim=0); the latent cache needs a RoPE width > 0")

    def absorb_weights(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, dn, r], W_UV [H, dv, r]) from kv_b_proj (docs/numerics.md, "MLA in one paragraph")."""
        w = dense_weight(module.kv_b_proj)
        H, dn, dv = int(module.num_heads), int(module.qk_nope_head_dim), int(module.v_head_dim)
        if w.shape != (H * (dn + dv), int(module.kv_lora_rank)):
            raise ConfigError(
                f"{type(module).__name__}.kv_b_proj has weight {tuple(w.shape)}, expected "
                f"[{H}*({dn}+{dv}), {module.kv_lora_rank}]"
            )
        w = w.view(H, dn + dv, w.shape[1])
        return w[:, :dn], w[:, dn:]


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The dense `[out, in]` matrix of a linear layer.

    A plain float nn.Linear gives its weight (no copy). Quantized or offloaded linears (FP8 checkpoints,
    accelerate offload) are applied to the identity once instead, which is exact for any linear map.
    """
    w = getattr(linear, "weight", None)
    if (isinstance(linear, nn.Linear) and isinstance(w, torch.Tensor) and w.dtype.is_floating_point
            and w.element_size() >= 2 and w.device.type != "meta"):
        return w
    n_in = getattr(linear, "in_features", None)
    if n_in is None:
        raise ConfigError(f"cannot read a dense weight from {type(linear).__name__}")
    param = next((p for p in linear.parameters() if p.device.type != "meta"), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = torch.float32
    with torch.no_grad():
        eye = torch.eye(n_in, device=device, dtype=dtype)
        out = linear(eye) - linear(torch.zeros_like(eye[:1]))  # remove any bias
    return out.t().contiguous()


@functools.cache
def cache_layout(cls: type) -> str | None:
    """'latent' if `cls.forward` caches the latent (cache.update before expand_kv, transformers >= 5.15),
    'expanded' if it caches per-head K/V (expand_kv first: DSA families before ~5.2x), None if neither."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    i_update, i_expand = src.find(".update("), src.find("self.expand_kv(")
    if i_update < 0 or i_expand < 0:
        return None
    return "latent" if i_update < i_expand else "expanded"


def _refuse(reason: str) -> Callable[[nn.Module], None]:
    def check(module: nn.Module) -> None:
        raise ConfigError(f"{type(module).__name__} is not supported by snapquant.patch: {reason}")
    return check


def _check_mistral_large4(module: nn.Module) -> None:
    if getattr(module, "is_kv_shared_layer", False) or getattr(module, "store_full_length_kv", False):
        raise ConfigError(
            f"{type(module).__name__} (layer {module.layer_idx}) shares its latent cache across layers "
            f"(kv_sharing_modes); cross-layer KV sharing is not supported by snapquant.patch"
        )


ADAPTERS: dict[str, MLAAdapter] = {a.family: a for a in (
    MLAAdapter("deepseek_v2", "complex freqs_cis RoPE, interleaved layout kept in the cache"),
    MLAAdapter("deepseek_v3", "also Kimi K2 / K2.5 and Moonlight checkpoints; rope_interleave on or off"),
    MLAAdapter("deepseek_v32", "MLA attention; the DSA indexer keys are cached unquantized, top-k masks gather rows"),
    MLAAdapter("longcat_flash", "q and latent scaled by sqrt(hidden/rank) before caching; 2 MLA blocks per layer"),
    MLAAdapter("glm4_moe_lite"),
    MLAAdapter("minicpm3"),
    MLAAdapter("mistral4"),
    MLAAdapter("youtu"),
    MLAAdapter("kimi_linear", "MLA (NoPE) in the full-attention layers; linear layers keep their stock cache"),
    MLAAdapter("axk1"),
    MLAAdapter("axk2", "DSA indexer + output gate"),
    MLAAdapter("bailing_hybrid", "MLA layers of a hybrid linear-attention model"),
    MLAAdapter("glm_moe_dsa", "DSA indexer, shared top-k layers"),
    MLAAdapter("hy_v4", "DSA indexer, attention sinks, output gate"),
    MLAAdapter("hy_v4_vl", "text MLA of the VL model"),
    MLAAdapter("dots3_note", "text MLA with optional DSA indexer and sliding windows"),
    MLAAdapter("mistral_large4", "DSA + per-layer no-RoPE layers", check=_check_mistral_large4),
)}

# Families recognised but refused, with the reason given to the user.
REFUSED: dict[str, str] = {
    "glm5_next": "its indexer reads cache_layer.keys and keeps compressed k-pool state in the cache layer",
}
for _family, _reason in REFUSED.items():
    ADAPTERS[_family] = MLAAdapter(_family, _reason, check=_refuse(_reason))


def family_of(module: nn.Module) -> str:
    """'deepseek_v3' for transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention."""
    parts = type(module).__module__.split(".")
    if len(parts) >= 3 and parts[0] == "transformers" and parts[1] == "models":
        return parts[2]
    return type(module).__module__


def is_mla_attention(module: nn.Module) -> bool:
    return hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj")


def find_mla_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, MLAAdapter]]:
    """Yield (name, module, adapter) for every MLA attention module; raise for unknown families."""
    found = False
    for name, module in model.named_modules():
        if not is_mla_attention(module):
            continue
        found = True
        family = family_of(module)
        adapter = ADAPTERS.get(family)
        if adapter is None:
            raise ConfigError(
                f"{type(module).__name__} (family {family!r}, module {name}) is an MLA attention that snapquant "
                f"has no adapter for; supported families: {', '.join(sorted(f for f in ADAPTERS if f not in REFUSED))}"
            )
        yield name, module, adapter
    if not found:
        raise ConfigError(
            f"{type(model).__name__} has no MLA attention (no module with kv_a_proj_with_mqa); snapquant.patch "
            f"supports DeepSeek-family MLA models: {', '.join(sorted(f for f in ADAPTERS if f not in REFUSED))}"
        )


def mla_attention_classes() -> dict[str, list[type]]:
    """Every attention class in the installed transformers that has `kv_a_proj_with_mqa`, by family.

    Only modeling files whose source mentions the projection are imported (importing all is slow).
    """
    import transformers.models as tm

    out: dict[str, list[type]] = {}
    root = Path(tm.__file__).parent
    for info in pkgutil.iter_modules(tm.__path__):
        path = root / info.name / f"modeling_{info.name}.py"
        if not path.exists() or "kv_a_proj_with_mqa" not in path.read_text(errors="ignore"):
            continue
        try:
            mod = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # an optional dependency of that model is missing: skip, like transformers does
            continue
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if (cls.__module__ == mod.__name__ and issubclass(cls, nn.Module)
                    and "kv_a_proj_with_mqa" in inspect.getsource(cls.__init__)):
                out.setdefault(info.name, []).append(cls)
    return out
