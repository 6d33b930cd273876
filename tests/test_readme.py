"""The README's "Using it" code, run as written on the shipped embedded model.

The snippets are read from README.md itself, so the README and these tests cannot drift apart. Only the
names a reader supplies are bound here (`path` = the embedded model's folder, a prompt, ...); the GPU
snippet runs on CPU with `backend="triton"` replaced by the reference backend.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import snapquant as sq
from snapquant.embedded import EMBEDDED_PATH, has_weights
from tests.support.log_capture import fresh_warning_once, transformers_warnings

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPT = "import os\n\n\ndef main():\n"

pytestmark = [pytest.mark.skipif(not has_weights(), reason="embedded weights not trained/installed yet"),
              pytest.mark.usefixtures("one_thread")]


def readme_python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section titled `section` (up to the next `## ` heading)."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_section_has_the_two_snippets():
    blocks = readme_python_blocks("Using it")
    assert len(blocks) >= 2
    assert "sq.patch(model, \"snapmla\")" in blocks[0] and "model.generate(" in blocks[0]
    assert "sq.DecodeGraph(model, cache)" in blocks[1]


def test_using_it_snippet_decodes_through_the_quantized_cache(monkeypatch):
    """The first snippet, on the embedded model: its patched `generate` really reads the FP8 cache.

    Every logit row the model computes is recorded (a hook on lm_head of the model the snippet loads).
    The patched generate's first step (prefill, bf16) must equal the unpatched one exactly, and its
    second step (the first decode step, same input token) must differ: that is the quantized cache.
    """
    code = readme_python_blocks("Using it")[0]
    loaded, rows = [], []
    original = AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        model = original(*args, **kwargs)
        model.lm_head.register_forward_hook(lambda _m, _i, out: rows.append(out[:, -1].detach().float().clone()))
        loaded.append(model)
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    namespace = {"path": str(EMBEDDED_PATH), "prompt": PROMPT}
    with torch.no_grad():
        exec(compile(code, str(README), "exec"), namespace)
    model, tok = namespace["model"], namespace["tok"]  # the snippet ends by loading the embedded model
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and tok.padding_side == "left"
    first = loaded[0]  # the snippet's own model (loaded[1] is load_embedded's), unpatched again by the snippet
    assert len(loaded) == 2 and not sq.is_patched(first)
    out, prompt_len = namespace["out"], len(tok(PROMPT)["input_ids"])
    patched_rows = list(rows)
    assert len(patched_rows) == out.shape[1] - prompt_len >= 2  # one logit row per generated token

    rows.clear()
    with torch.no_grad():
        first.generate(**tok(PROMPT, return_tensors="pt"), max_new_tokens=2)
    assert torch.equal(rows[0], patched_rows[0])  # prefill: the stock bf16 computation
    assert out[0, prompt_len] == rows[0].argmax()  # so both runs feed the same token to the decode step
    moved = (rows[1] - patched_rows[1]).abs().max() / rows[1].abs().max()
    assert moved > 1e-3, f"snapmla decode moved the logits by only {moved:.2e} of their scale"


def test_fast_decode_snippet_runs_on_cpu_without_deprecation_warnings():
    """The DecodeGraph snippet with the reference backend: runs, returns [B, 1, V] logits, and calls the
    model with the cache keyword this transformers version names (no `past_key_values` deprecation)."""
    code = readme_python_blocks("Using it")[1]
    assert 'backend="triton"' in code
    code = code.replace('backend="triton"', 'backend="reference"')
    model, tok = sq.load_embedded(dtype="bfloat16")
    prompt_ids = tok([PROMPT, "x = 1\n"], return_tensors="pt", padding=True).input_ids[:, -3:]
    namespace = {"sq": sq, "model": model, "prompt_ids": prompt_ids, "prompt_len": prompt_ids.shape[1],
                 "new_tokens": 4, "next_ids": torch.tensor([[10], [11]])}
    fresh_warning_once()
    with warnings.catch_warnings(record=True) as caught, transformers_warnings() as logged, torch.no_grad():
        warnings.simplefilter("always")
        exec(compile(code, str(README), "exec"), namespace)
    assert namespace["logits"].shape == (2, 1, model.config.vocab_size)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not [m for m in deprecations if "past_key_values" in m], deprecations
    assert not [m for m in logged if "past_key_values" in m], logged
