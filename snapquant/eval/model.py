"""Loading the model an evaluation runs on: `embedded` or a Hugging Face checkpoint directory.

    load_model(name, ...)       -> (model in eval mode, tokenizer)
    checkpoint_mla_dims(name)   (kv_lora_rank, qk_rope_head_dim) from config.json, without loading weights
    model_info(model)           MLA dims and identity of a loaded model, recorded in every result
    load_tokenizer(name, ...)   the tokenizer alone (reports decode the fidelity tokens with it; the fidelity
                                text is drawn with it before the model loads)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def resolve_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available on this machine; use device: cpu")
    return device


def load_model(
    model: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    device_map: str | dict | None = None,
    tokenizer: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """-> (model in eval mode, tokenizer). `device_map` ("auto") spreads a big model over the visible GPUs."""
    import torch

    kw = dict(model_kwargs or {})
    torch_dtype = None if dtype == "auto" else getattr(torch, TORCH_DTYPES[dtype])
    if model == "embedded":
        try:
            from ..embedded import load_embedded  # the shipped trained MLA model
        except ImportError:
            raise ConfigError("model: 'embedded' needs snapquant.embedded.load_embedded, missing here") from None
        try:
            m, tok = load_embedded(dtype=torch_dtype or torch.float32, device=resolve_device(device))
        except FileNotFoundError as e:
            raise ConfigError(f"model: 'embedded': {e}") from None
        return m.eval(), tok

    path = Path(model)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ConfigError(f"model={model!r}: not 'embedded' and not a checkpoint directory with config.json "
                          f"(hub names cannot be downloaded here; pass a local path)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device_map is not None:
        kw["device_map"] = device_map
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype or "auto", **kw)
    if device_map is None:
        m = m.to(resolve_device(device))
    tok = AutoTokenizer.from_pretrained(tokenizer or str(path))
    return m.eval(), tok


def checkpoint_mla_dims(model: str) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim) of `model` from its config.json, without loading weights.

    Raises ConfigError naming the model when it has no weights, no config.json or no MLA dims.
    """
    import json

    if model == "embedded":
        from ..embedded import EMBEDDED_PATH, has_weights

        if not has_weights(EMBEDDED_PATH):
            raise ConfigError(f"model: 'embedded': no weights in {EMBEDDED_PATH} yet (train them with "
                              f"scripts/train_embedded_model.py)")
        path = EMBEDDED_PATH
    else:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model={model!r}: not 'embedded' and not a checkpoint directory with config.json")
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    r, d = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if not r or not d:
        raise ConfigError(f"model={model!r} ({cfg.get('model_type')}): config.json has no kv_lora_rank / "
                          f"qk_rope_head_dim; snapquant needs an MLA (DeepSeek-family) model")
    return int(r), int(d)


def model_info(model: Any) -> dict[str, Any]:
    """MLA dims and identity of a loaded model, recorded in every cell result."""
    from ..analysis.capture import mla_attention_modules

    cfg = model.config
    mods = mla_attention_modules(model)
    m0 = mods[0]
    return {
        "class": type(model).__name__,
        "model_type": getattr(cfg, "model_type", None),
        "name_or_path": getattr(cfg, "_name_or_path", None) or getattr(model, "name_or_path", None),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": str(next(model.parameters()).device),
        "kv_lora_rank": int(m0.kv_lora_rank),
        "qk_rope_head_dim": int(m0.qk_rope_head_dim),
        "num_heads": int(getattr(m0, "num_heads", getattr(cfg, "num_attention_heads", 0))),
        "num_mla_layers": len(mods),
    }


def load_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    """The tokenizer `load_model` would return for `model` (and `tokenizer`), without loading weights."""
    if model == "embedded" and tokenizer is None:
        from ..embedded import load_tokenizer as embedded_tokenizer

        try:
            return embedded_tokenizer()
        except (FileNotFoundError, OSError) as e:
            raise ConfigError(f"model: 'embedded': {e}") from None
    from transformers import AutoTokenizer

    src = tokenizer or model
    if not Path(src).is_dir():
        raise ConfigError(f"tokenizer {src!r} is not a local directory (hub names cannot be downloaded here)")
    return AutoTokenizer.from_pretrained(src)


def token_decoder(model: str, tokenizer: str | None = None, loaded: Any = None) -> Any:
    """`ids -> text` with the tokenizer of `model` (or the `loaded` one), or None when it cannot be loaded here."""
    tok = loaded
    if tok is None:
        try:
            tok = load_tokenizer(model, tokenizer)
        except (ConfigError, OSError, ValueError):
            return None

    def decode(ids: Any) -> str:
        return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return decode
