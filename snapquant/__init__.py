"""snapquant: FP8 latent KV-cache quantization for MLA (DeepSeek-family) models.

Data flow: config (`KVQuantConfig`, `PRESETS`) -> quantizers (`quantize_kv`) -> reference decode
(`mla_decode_reference`, float64 `mla_decode_oracle`) -> kernels / model patching -> eval -> results.
"""

from .config import AXES, KVQuantConfig
from .errors import ConfigError, NonFiniteInputError, ShapeError
from .presets import PRESETS, load_presets, register_preset, resolve_config
from .quant import QuantizedKV, QuantizedTensor, bytes_per_token, calibrate, quantize_kv
from .reference import (
    absorb_query,
    attention_fp64,
    mla_decode_oracle,
    mla_decode_reference,
    project_output,
    quantize_query,
    split_kv_b,
)

__version__ = "0.1.0"

__all__ = [
    "AXES", "PRESETS", "ConfigError", "KVQuantConfig", "NonFiniteInputError", "QuantizedKV", "QuantizedTensor",
    "ShapeError", "__version__", "absorb_query", "attention_fp64", "bytes_per_token", "calibrate",
    "load_presets", "mla_decode_oracle", "mla_decode_reference", "project_output", "quantize_kv",
    "quantize_query", "register_preset", "resolve_config", "split_kv_b",
]


# Model patching. Imported on first use: it pulls in transformers, which `import snapquant`
# alone should not pay for.
_LAZY = {
    "patch": "patching", "unpatch": "patching", "patched": "patching", "is_patched": "patching",
    "patched_config": "patching",
    "LatentCache": "cache", "LatentLayer": "cache",
    "load_embedded": "embedded", "EMBEDDED_PATH": "embedded",  # the shipped trained model
    "DecodeGraph": "graphs", "no_host_sync": "graphs",  # CUDA-graph decode steps
}
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        # Bind every name of that module at once, so later lookups skip this hook.
        for n, m in _LAZY.items():
            if m == _LAZY[name]:
                globals()[n] = getattr(module, n)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
