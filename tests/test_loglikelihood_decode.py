"""Loglikelihoods read through the cache (`direct.decode_loglikelihoods`, `through="decode"`,
`SnapquantLM(loglikelihood="decode")`, calibration's `loglikelihood=`): on an unpatched model the same
numbers as lm-eval's forward pass (to float rounding); on a patched model the decode steps read the
quantized cache, which lm-eval's forward pass never does under `prefill: bf16`."""

from __future__ import annotations

import copy

import pytest
import torch

from snapquant.errors import ConfigError
from snapquant.eval import calibration
from snapquant.eval.tasks import direct
from snapquant.models.tiny import tiny_model
from snapquant.patching import patched
from tests.support.tokenizers import char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("deepseek_v3", vocab_size=128)


def _pairs(seed: int = 0, contexts: int = 4, choices: int = 5) -> list[tuple[list[int], list[int]]]:
    """Contexts of 20-60 tokens, each with continuations of 1-9 tokens (one of exactly one token)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(contexts):
        ctx = torch.randint(4, 128, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist()
        for j in range(choices):
            n = 1 if j == 0 else int(torch.randint(2, 10, (1,), generator=g))
            out.append((ctx, torch.randint(4, 128, (n,), generator=g).tolist()))
    return out


def _hflm(model, max_length: int):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=char_tokenizer(), batch_size=3, device="cpu", max_length=max_length)


def _forward(model, pairs, max_length: int = 512) -> list[tuple[float, bool]]:
    """lm-eval's HFLM computation itself (one forward pass per pair, right-padded batches, no cache)."""
    return _hflm(model, max_length)._loglikelihood_tokens([(None, c, x) for c, x in pairs], disable_tqdm=True)


@pytest.mark.parametrize("max_length,batch_size", [(512, 16), (512, 2), (40, 3)])
def test_unpatched_decode_equals_lm_evals_forward_pass(model, max_length, batch_size):
    """The correctness test: prefill + teacher-forced decode steps give lm-eval's loglikelihoods and greedy
    flags on the unpatched fp32 model (also when a context's choices span several batches, and when
    context + continuation is left-truncated to max_length + 1 tokens)."""
    pairs = _pairs()
    ref = _forward(model, pairs, max_length)
    got = direct.decode_loglikelihoods(model, pairs, batch_size, max_length=max_length)
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in ref], abs=1e-4)
    assert [g for _, g in got] == [g for _, g in ref]
    # a greedy continuation is recognised as such: take the model's own argmax tokens
    ctx = pairs[0][0]
    ids = list(ctx)
    for _ in range(4):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    (ll, greedy), = direct.decode_loglikelihoods(model, [(ctx, ids[len(ctx):])])
    assert greedy and ll == pytest.approx(_forward(model, [(ctx, ids[len(ctx):])])[0][0], abs=1e-4)


def test_choice_loglikelihoods_through_decode_match_forward_on_text(model):
    tok = char_tokenizer()
    contexts = ["def f(x):\n    return x", "a = [1, 2, 3]\nb ="]
    choices = [[" + 1\n", " * 2", "\n"], [" a", " sum(a)\n", " len(a) + 1"]]
    fwd = direct.choice_loglikelihoods(model, tok, contexts, choices, share_context=False)
    dec = direct.choice_loglikelihoods(model, tok, contexts, choices, batch_size=2, through="decode")
    for a, b in zip(fwd, dec, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    with pytest.raises(ConfigError, match=r"^through must be one of forward, decode"):
        direct.choice_loglikelihoods(model, tok, contexts, choices, through="prefill")
    with pytest.raises(ConfigError, match="share_context"):
        direct.choice_loglikelihoods(model, tok, contexts, choices, share_context=True, through="decode")


def test_patched_decode_reads_the_quantized_cache_and_forward_does_not(model):
    """per_tensor_fp8 (`prefill: bf16`): lm-eval's forward pass scores exactly what the unpatched model
    scores; the decode steps read the FP8 cache and move the loglikelihoods (not the one-token
    continuations, whose log-prob comes from the bf16 prefill); batching the choices changes nothing."""
    pairs = _pairs(seed=1)
    m = copy.deepcopy(model)
    base_fwd = _forward(m, pairs)
    base_dec = direct.decode_loglikelihoods(m, pairs)
    with patched(m, "per_tensor_fp8", backend="reference"):
        fwd = _forward(m, pairs)
        dec = direct.decode_loglikelihoods(m, pairs, batch_size=8)
        one = direct.decode_loglikelihoods(m, pairs, batch_size=1)
    assert [ll for ll, _ in fwd] == [ll for ll, _ in base_fwd]
    moved = [abs(a[0] - b[0]) for a, b in zip(dec, base_dec, strict=True)]
    single = [len(x) == 1 for _, x in pairs]
    assert max(d for d, s in zip(moved, single, strict=True) if not s) > 1e-3
    assert all(d < 1e-5 for d, s in zip(moved, single, strict=True) if s)
    assert [ll for ll, _ in one] == pytest.approx([ll for ll, _ in dec], abs=1e-5)


def test_snapquant_lm_loglikelihood_decode(model):
    from lm_eval.api.instance import Instance

    from snapquant.eval import SnapquantLM

    tok = char_tokenizer()
    reqs = [Instance("loglikelihood", {}, (f"Q{i}: 2+{i}=", ans), i)
            for i in range(3) for ans in (str(2 + i), f" {3 + i}0")]
    unpatched = _hflm(copy.deepcopy(model), 512).loglikelihood(reqs, disable_tqdm=True)
    out, info = {}, {}
    for path in ("forward", "decode"):
        lm = SnapquantLM(pretrained=copy.deepcopy(model), tokenizer=tok, kv_config="per_tensor_fp8", batch_size=2,
                         device="cpu", **({"loglikelihood": path} if path == "decode" else {}))
        out[path] = lm.loglikelihood(reqs, disable_tqdm=True)
        info[path] = lm.get_model_info()["snapquant_loglikelihood"]
        if path == "decode":  # the same numbers as the direct harness on the same patched model
            pairs = [lm._encode_pair(*r.args) for r in reqs]
            ref = direct.decode_loglikelihoods(lm.model, pairs)
            assert [ll for ll, _ in out[path]] == pytest.approx([ll for ll, _ in ref], abs=1e-6)
            assert [g for _, g in out[path]] == [g for _, g in ref]
            rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("abc def ghi",), 0)],
                                               disable_tqdm=True)
            assert not lm._ll_decode and rolling[0] < 0  # perplexity stays on the forward pass
    assert info == {"forward": "forward", "decode": "decode"}
    assert [ll for ll, _ in out["forward"]] == [ll for ll, _ in unpatched]  # default: lm-eval's pass
    assert max(abs(a[0] - b[0]) for a, b in zip(out["decode"], unpatched, strict=True)) > 1e-4
    with pytest.raises(ConfigError, match=r"^loglikelihood must be one of forward, decode"):
        SnapquantLM(pretrained="/nonexistent/checkpoint", loglikelihood="fast")


def test_calibration_checks_the_loglikelihood_path():
    with pytest.raises(ConfigError, match=r"^loglikelihood must be"):
        calibration.score(None, None, calibration.Setting("sq_code_completion_mc"), 1, loglikelihood="both")
    with pytest.raises(ConfigError, match=r"^loglikelihood must be"):
        calibration.calibrate(None, None, [], 1, loglikelihood="both")
    with pytest.raises(ConfigError, match="batch_size"):
        direct.decode_loglikelihoods(None, [([1], [2])], batch_size=0)


def test_sweep_key_reaches_snapquant_lm():
    from types import SimpleNamespace

    from snapquant import PRESETS
    from snapquant.sweep import SweepSpec
    from snapquant.sweep.evaluate import LmEvalEvaluator

    base = {"name": "t", "model": "embedded", "tasks": ["sq_code_completion_mc"], "presets": ["bf16"]}
    fwd, dec = SweepSpec.from_dict(base), SweepSpec.from_dict({**base, "loglikelihood": "decode"})
    assert fwd.loglikelihood == "forward" and dec.loglikelihood == "decode"
    assert SweepSpec.from_dict(dec.to_dict()) == dec
    assert fwd.eval_key() == SweepSpec.from_dict({**base, "loglikelihood": "forward"}).eval_key() != dec.eval_key()
    with pytest.raises(ConfigError, match="loglikelihood"):
        SweepSpec.from_dict({**base, "loglikelihood": "prefill"})

    class LM:  # SnapquantLM's signature: takes kv_config and loglikelihood
        def __init__(self, pretrained, tokenizer, batch_size, kv_config=None, loglikelihood="forward"):
            self.kw = {"kv_config": kv_config, "loglikelihood": loglikelihood}

    ev = SimpleNamespace(_lm_class=LM, model=None, tokenizer=None)
    cell = SimpleNamespace(config=PRESETS["per_tensor_fp8"])
    assert LmEvalEvaluator._make_lm(ev, dec, cell).kw["loglikelihood"] == "decode"
    assert LmEvalEvaluator._make_lm(ev, fwd, cell).kw["loglikelihood"] == "forward"
