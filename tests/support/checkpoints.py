"""A random few-second checkpoint of the embedded architecture, with the embedded tokenizer."""

import shutil
from pathlib import Path

import pytest


def tiny_checkpoint(out: Path) -> Path:
    """Writes the checkpoint into `out` (skips the test where the checkout has no embedded tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from snapquant.embedded import EMBEDDED_PATH, TINY_ARCH, embedded_config

    if not (EMBEDDED_PATH / "tokenizer.json").is_file():
        pytest.skip("no embedded tokenizer in this checkout")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(embedded_config(TINY_ARCH)).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (EMBEDDED_PATH / f).is_file():
            shutil.copy(EMBEDDED_PATH / f, out / f)
    return out
