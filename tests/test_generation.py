"""snapquant.eval.generation: the decode loop returns HF generate's tokens under lm-eval's stopping criteria.

On CPU the loop's eager steps are HF's own forward calls and the static steps are DecodeGraph's
fixed-shape step (equal to the eager masked decode bit for bit at these sizes, tests/test_graphs.py),
so the comparisons are exact (torch.equal): same tokens, same stop step, same padding after an EOS.
"""

from __future__ import annotations

import random
from typing import ClassVar

import pytest
import torch

import snapquant
from snapquant.cache import LatentCache
from snapquant.errors import ConfigError
from snapquant.eval.generation import DecodeLoop, DecodingPlan, StopRule, decoding_plan
from snapquant.models.stepping import cache_kwarg
from snapquant.models.tiny import tiny_model
from tests.support.tokenizers import char_tokenizer

pytest.importorskip("lm_eval")
from lm_eval.models.utils_hf import stop_sequences_criteria

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Q1: 2+3=", "hello there, friend", "x", "def f(a):"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def setup():
    tok = char_tokenizer()
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3", moe=True, vocab_size=len(tok))
    snapquant.patch(model, "snapmla", backend="reference")
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    return model, tok, enc.input_ids, enc.attention_mask


def _hf(model, tok, ids, am, stop, max_new, **kw):
    """What lm-eval's HFLM._model_generate asks of HF generate (a fresh LatentCache, as SnapquantLM passes)."""
    P = ids.shape[1]
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=am, max_length=P + max_new, pad_token_id=0,
                              stopping_criteria=stop_sequences_criteria(tok, stop, P, ids.shape[0]), use_cache=True,
                              **{cache_kwarg(model): LatentCache("snapmla", model)}, **kw)


def _loop(loop, model, ids, am, stop, max_new, **kw):
    plan = decoding_plan(model, kw, ids.shape[1])
    assert isinstance(plan, DecodingPlan), plan
    return loop.generate(ids, am, max_length=ids.shape[1] + max_new, plan=plan, stop=stop, pad_token_id=0)


def test_greedy_tokens_equal_hf_generate_with_stop_strings_eos_and_max_tokens(setup):
    model, tok, ids, am = setup
    P = ids.shape[1]
    free = _hf(model, tok, ids, am, [], MAX_NEW, do_sample=False)
    texts = [tok.decode(r, skip_special_tokens=False) for r in free[:, P:]]
    # stop strings every row produces: HF stops where the last row first shows it (the lookback window
    # always covers a 1-character string when its token is generated)
    common = sorted(set.intersection(*(set(t) for t in texts)))
    assert common, texts
    stops = {c: max(t.index(c) for t in texts) for c in common}
    cases = []
    for c, _ in sorted(stops.items(), key=lambda kv: kv[1])[:2]:
        cases.append(([c, "</s>"], {}))
    # EOS: one row's 4th token is the EOS id (that row pads from then on; the others run to the end), and
    # every row's 3rd token (the batch stops at step 3)
    cases.append((["</s>"], {"eos_token_id": int(free[1, P + 3])}))
    cases.append((["</s>"], {"eos_token_id": sorted({int(x) for x in free[:, P + 2]})}))
    hf_lengths = set()
    loops = {(steps, k): DecodeLoop(model, tok, steps=steps, check_every=k)
             for steps, k in (("eager", 7), ("static", 1), ("static", 13))}
    for stop, kw in cases:
        want = _hf(model, tok, ids, am, stop, MAX_NEW, do_sample=False, **kw)
        hf_lengths.add(want.shape[1] - P)
        for loop in loops.values():  # the same loop object across cases: its kept cache is reused
            got = _loop(loop, model, ids, am, stop, MAX_NEW, do_sample=False, **kw)
            assert torch.equal(got.sequences, want), (stop, kw, loop.steps, loop.check_every)
            assert got.new_tokens == want.shape[1] - P
            assert got.steps - (got.new_tokens - 1) < 2 * loop.check_every  # overshoot bound
    # the cases stop inside a chunk and on / across chunk boundaries, and before max_new_tokens
    assert 3 in hf_lengths and any(n < MAX_NEW for n in hf_lengths - {3}), hf_lengths
    ends = {n % k for n in hf_lengths - {MAX_NEW} for _, k in loops}
    assert {0, 1} <= ends, hf_lengths  # a stop on the last step of a chunk, and on the first of the next
    # max_gen_toks: one token (no decode step) and a short run
    for n in (1, 5):
        want = _hf(model, tok, ids, am, ["</s>"], n, do_sample=False)
        got = _loop(loops["eager", 7], model, ids, am, ["</s>"], n, do_sample=False)
        assert torch.equal(got.sequences, want) and got.new_tokens == n


def test_seeded_sampling_repeats_and_draws_hf_generates_tokens(setup):
    model, tok, ids, am = setup
    kw = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9}
    plan = decoding_plan(model, kw, ids.shape[1])
    assert plan.description == "sample TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper"
    loop = DecodeLoop(model, tok, steps="static", check_every=4)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(_loop(loop, model, ids, am, ["</s>"], 12, **kw).sequences)
    torch.manual_seed(5)
    want = _hf(model, tok, ids, am, ["</s>"], 12, **kw)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], want)
    assert not torch.equal(runs[0], runs[2])


def test_decoding_plan_names_what_it_cannot_reproduce(setup):
    model = setup[0]
    assert "RepetitionPenaltyLogitsProcessor" in decoding_plan(model, {"do_sample": False, "repetition_penalty": 1.2})
    assert "num_beams=2" in decoding_plan(model, {"do_sample": False, "num_beams": 2})
    assert "['foo'] are model inputs" in decoding_plan(model, {"do_sample": False, "foo": 1})
    assert "min_length" in decoding_plan(model, {"do_sample": False, "min_new_tokens": 3})


def test_bad_loop_options_are_refused(setup):
    model, tok, ids, am = setup
    with pytest.raises(ConfigError, match="steps must be one of"):
        DecodeLoop(model, tok, steps="fast")
    with pytest.raises(ConfigError, match="check_every"):
        DecodeLoop(model, tok, check_every=0)
    with pytest.raises(ConfigError, match="needs the model on CUDA"):
        DecodeLoop(model, tok, steps="graph")
    with pytest.raises(ConfigError, match="patched"):
        DecodeLoop(tiny_model("deepseek_v3"), tok)
    plan = decoding_plan(model, {"do_sample": False})
    with pytest.raises(ConfigError, match="max_length"):
        DecodeLoop(model, tok).generate(ids, am, max_length=ids.shape[1], plan=plan)


# ---------------------------------------------------------------------------------------------- StopRule
class _FakeTok:
    """Token t decodes to ALPHABET[t]; id 9 is the EOS '</s>' (kept by batch_decode, as HF's default)."""

    ALPHABET: ClassVar[list[str]] = ["a", "b", "c", "ab", "\n", "x", "y", "z", "<pad>", "</s>"]

    def encode(self, s, add_special_tokens=False):
        return [self.ALPHABET.index(ch) if ch in self.ALPHABET else 5 for ch in s]

    def batch_decode(self, rows, **kw):
        return ["".join(self.ALPHABET[int(t)] for t in r) for r in rows]


@pytest.mark.parametrize("seed", range(6))
def test_stop_rule_stops_where_hf_with_lm_evals_criteria_stops(seed):
    """Random token streams fed in random chunks: the stop step equals HF's loop (pad substitution after an
    EOS, EosTokenCriteria, lm-eval's MultiTokenEOSCriteria per string, max length), multi-token strings
    included, whatever the chunk boundaries."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    rng = random.Random(seed)
    tok = _FakeTok()
    B, P, max_new = 3, 2, 40
    stops = rng.sample(["ab", "b\n", "\n\n", "c", "xyz", "</s>"], 3)
    eos = [9]
    raw = torch.tensor([[rng.choice([0, 1, 2, 3, 4, 4, 5, 6, 7, 9 if rng.random() < 0.05 else 5])
                         for _ in range(max_new)] for _ in range(B)])
    crit = stop_sequences_criteria(tok, stops, P, B)
    crit.extend([EosTokenCriteria(eos_token_id=eos), MaxLengthCriteria(max_length=P + max_new)])
    ids = torch.zeros(B, P, dtype=torch.long)
    unfinished = torch.ones(B, dtype=torch.long)
    for t in range(max_new):  # HF's _sample bookkeeping
        nxt = raw[:, t] * unfinished + 8 * (1 - unfinished)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        unfinished = unfinished & ~crit(ids, None)
        if unfinished.max() == 0:
            break
    want = ids.shape[1] - P
    # the same streams (HF's padded tokens, and what the loop would have generated past the stop)
    stream = torch.cat([ids[:, P:], torch.full((B, max_new - want), 8)], dim=1).tolist()
    rule = StopRule(tok, stops, B, max_new, eos)
    got, pos = None, 0
    while got is None:
        n = rng.randint(1, 7)
        got = rule.feed([row[pos:pos + n] for row in stream])
        pos += n
    assert got == want, (stops, raw.tolist())


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_graph_loop_replays_the_static_step_and_agrees_with_hf():
    """Captured steps replay exactly what the same fixed-shape step computes uncaptured (same kernels, same
    grouped experts), and greedy decode agrees with HF generate (which differs by bf16 rounding: its decode
    runs the experts as batched_mm and the attention with masks)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tok = char_tokenizer()
    torch.manual_seed(0)
    # kernel widths (powers of two >= 16): kv_lora_rank 64, RoPE 16
    model = tiny_model("deepseek_v3", moe=True, vocab_size=len(tok), dtype=torch.bfloat16, kv_lora_rank=64,
                       qk_rope_head_dim=16).cuda()
    snapquant.patch(model, "snapmla", backend="triton")
    enc = tok(PROMPTS * 4, return_tensors="pt", padding=True, padding_side="left").to("cuda")
    ids, am = enc.input_ids, enc.attention_mask
    graph = DecodeLoop(model, tok, steps="graph", check_every=8)
    static = DecodeLoop(model, tok, steps="static", check_every=8)
    a = _loop(graph, model, ids, am, ["</s>"], 40, do_sample=False)
    b = _loop(static, model, ids, am, ["</s>"], 40, do_sample=False)
    assert graph.captures == 1 and torch.equal(a.sequences, b.sequences)
    again = _loop(graph, model, ids, am, ["</s>"], 40, do_sample=False)  # the kept graph, re-prefilled cache
    assert graph.captures == 1 and torch.equal(again.sequences, a.sequences)
    want = _hf(model, tok, ids, am, ["</s>"], 40, do_sample=False)
    P = ids.shape[1]
    n = min(want.shape[1], a.sequences.shape[1]) - P
    first = (a.sequences[:, P] == want[:, P]).float().mean()
    assert first == 1.0 and (a.sequences[:, P:P + n] == want[:, P:P + n]).float().mean() >= 0.5


def test_time_steps_records_one_time_per_decode_step_within_the_decode_time(setup):
    """`time_steps=True` gives each decode step's seconds (for ratio intervals in benchmarks) without
    changing the tokens; the steps' times add up to at most the decode's wall time."""
    model, tok, ids, am = setup
    timed = DecodeLoop(model, tok, steps="static", check_every=4, time_steps=True)
    plain = DecodeLoop(model, tok, steps="static", check_every=4)
    a = _loop(timed, model, ids, am, [], 9, do_sample=False)
    b = _loop(plain, model, ids, am, [], 9, do_sample=False)
    assert torch.equal(a.sequences, b.sequences) and b.step_seconds == []
    assert len(a.step_seconds) == a.steps and all(s > 0 for s in a.step_seconds)
    assert sum(a.step_seconds) <= a.seconds["decode"]
