"""The step-by-step decode loop (`snapquant.models.stepping`) against full forwards of the same tokens."""

from __future__ import annotations

import inspect

import pytest
import torch

from snapquant import ConfigError
from snapquant.models.stepping import cache_kwarg, decode_step, decode_steps, output_cache

pytestmark = pytest.mark.usefixtures("one_thread")
# float32 on CPU: a cached step and a full forward sum the same products in a different order
# (SDPA over T keys vs one query row); 2e-5 is ~100 ulp of logits of magnitude ~1 after 2 layers.
ATOL = 2e-5


@pytest.fixture(scope="module")
def model():
    from snapquant.models.tiny import tiny_model

    torch.manual_seed(0)
    return tiny_model("deepseek_v3")


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(11)
    return torch.randint(3, 256, (2, 12), generator=g)


def test_cache_kwarg_is_the_forward_argument_and_output_cache_finds_it(model):
    assert cache_kwarg(model) in inspect.signature(model.forward).parameters
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
    cache = output_cache(out)
    assert cache is not None and cache.get_seq_length() == 3
    assert output_cache({"cache": 1}) == 1 and output_cache({"past_key_values": 2}) == 2
    assert output_cache({"logits": 0}) is None


def test_teacher_forced_steps_predict_what_the_full_forward_predicts(model, ids):
    outs = list(decode_steps(model, ids, prompt_len=4))
    assert len(outs) == 1 + (12 - 4 - 1)  # the prefill, then positions 4 .. 10
    with torch.no_grad():
        full = model(input_ids=ids).logits
    torch.testing.assert_close(outs[0].logits, full[:, :4], atol=ATOL, rtol=0)
    steps = torch.cat([o.logits for o in outs[1:]], dim=1)  # the step at t consumed ids[:, t]
    torch.testing.assert_close(steps, full[:, 4:11], atol=ATOL, rtol=0)


def test_greedy_steps_feed_the_argmax_and_match_a_full_forward_of_what_they_fed(model, ids):
    prompt = ids[:, :5]
    outs = list(decode_steps(model, prompt, greedy_steps=4))
    assert len(outs) == 5
    fed = torch.cat([o.logits[:, -1:].argmax(-1) for o in outs[:-1]], dim=1)  # the 4 tokens fed
    with torch.no_grad():
        full = model(input_ids=torch.cat([prompt, fed], dim=1)).logits
    torch.testing.assert_close(torch.cat([o.logits[:, -1:] for o in outs], dim=1), full[:, 4:], atol=ATOL, rtol=0)
    top2 = full[:, 4:8].topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * ATOL  # where the argmax is not a near-tie
    assert torch.equal(fed[clear], full[:, 4:8].argmax(-1)[clear]) and clear.float().mean() > 0.5


def test_decode_step_takes_an_int_or_a_position_tensor(model, ids):
    with torch.no_grad():
        first = model(input_ids=ids[:, :6], use_cache=True)
        a = decode_step(model, ids[:, 6:7], 6, output_cache(first))
        first = model(input_ids=ids[:, :6], use_cache=True)
        b = decode_step(model, ids[:, 6:7], torch.full((2, 1), 6), output_cache(first))
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)


@pytest.mark.parametrize("prompt_len", [0, 11, 13])
def test_a_teacher_forced_prompt_must_leave_a_step(model, ids, prompt_len):
    with pytest.raises(ConfigError, match="prompt_len"):
        next(decode_steps(model, ids, prompt_len=prompt_len))
