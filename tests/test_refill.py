"""snapquant.eval.refill: a queue of requests over fixed slots, finished slots refilled with waiting requests.

Each request's greedy tokens must be what it gets alone (batch 1, `DecodeLoop.generate`), with refill on, off
and 'auto', whatever the check interval; on CPU the static step is the fixed-shape step a CUDA graph replays,
so this is the graph loop's logic without the capture.
"""

from __future__ import annotations

import copy

import pytest
import torch

import snapquant
from snapquant.cache import LatentCache
from snapquant.errors import ConfigError, ShapeError
from snapquant.eval.generation import DecodeLoop, decoding_plan
from snapquant.eval.refill import refill_reason, run_queue, simulate_steps
from snapquant.models.stepping import cache_kwarg
from snapquant.models.tiny import tiny_model
from tests.support.tokenizers import char_tokenizer

pytest.importorskip("lm_eval")

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Q1: 2+3=", "hello there, friend", "x", "def f(a):", "abc", "zzz top", "import os\n", "1,2,3,"]
# stop strings this random model reaches after 5 to 30 tokens, depending on the prompt (and never for some)
STOP = ["(", "[", "3"]
MAX_NEW = 30


@pytest.fixture(scope="module")
def base():
    tok = char_tokenizer()
    torch.manual_seed(0)
    return tiny_model("deepseek_v3", moe=True, vocab_size=len(tok)), tok


def _alone(model, tok, ids, plan):
    loop = DecodeLoop(model, tok, steps="static", check_every=4)
    return [loop.generate(torch.tensor([r]), None, max_length=len(r) + MAX_NEW, plan=plan, stop=STOP)
            .sequences[0, len(r):].tolist() for r in ids]


@pytest.mark.parametrize("preset", ["bf16", "snapmla"])
def test_refilled_slots_give_every_request_its_tokens_alone(base, preset):
    model, tok = copy.deepcopy(base[0]), base[1]
    snapquant.patch(model, preset, backend="reference")
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    plan = decoding_plan(model, {"do_sample": False}, 4)
    alone = _alone(model, tok, ids, plan)
    lengths = sorted(len(a) for a in alone)
    assert lengths[0] <= 8 and lengths[-1] == MAX_NEW, lengths  # very different stop points
    stats = {}
    for refill in (True, False, "auto"):
        for k in (1, 3, 5):
            loop = DecodeLoop(model, tok, steps="static", check_every=k)
            res = run_queue(loop, ids, slots=3, max_new_tokens=MAX_NEW, plan=plan, stop=STOP, refill=refill)
            assert res.tokens == alone, (refill, k)
            stats[refill, k] = res.stats
            if refill != "auto":  # the schedule alone predicts the steps (what the workload projections use)
                assert simulate_steps([len(a) for a in alone], 3, k, refill)["decode_steps"] == res.stats["decode_steps"]
            again = run_queue(loop, ids[::-1], slots=3, max_new_tokens=MAX_NEW, plan=plan, stop=STOP,
                              refill=refill)  # the kept cache and step, another order
            assert again.tokens == alone[::-1], (refill, k)
    for k in (1, 3, 5):
        on, off = stats[True, k], stats[False, k]
        assert on["refills"] > 0 and off["refills"] == 0 and off["batches"] == 3
        assert on["useful_slot_steps"] == off["useful_slot_steps"] == sum(len(a) - 1 for a in alone)
        assert on["decode_steps"] < off["decode_steps"] and on["utilisation"] > off["utilisation"]


def test_max_new_tokens_one_and_more_slots_than_requests(base):
    model, tok = copy.deepcopy(base[0]), base[1]
    snapquant.patch(model, "snapmla", backend="reference")
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:3]]
    plan = decoding_plan(model, {"do_sample": False}, 4)
    loop = DecodeLoop(model, tok, steps="static", check_every=2)
    one = run_queue(loop, ids, slots=2, max_new_tokens=1, plan=plan, refill=True)
    assert [len(t) for t in one.tokens] == [1, 1, 1]
    wide = run_queue(loop, ids, slots=8, max_new_tokens=MAX_NEW, plan=plan, stop=STOP)
    assert wide.stats["slots"] == 3 and wide.tokens == _alone(model, tok, ids, plan)


def test_refill_is_refused_where_a_request_cannot_take_a_slot(base):
    model, tok = copy.deepcopy(base[0]), base[1]
    snapquant.patch(model, "snapmla", backend="reference")
    plan = decoding_plan(model, {"do_sample": False}, 4)
    assert "eager" in refill_reason(DecodeLoop(model, tok, steps="eager"))
    with pytest.raises(ConfigError, match="fixed-shape"):
        run_queue(DecodeLoop(model, tok, steps="eager"), [[1, 2]], slots=1, max_new_tokens=2, plan=plan, refill=False)
    with pytest.raises(ConfigError, match="refill must be"):
        run_queue(DecodeLoop(model, tok, steps="static"), [[1, 2]], slots=1, max_new_tokens=2, plan=plan,
                  refill="yes")
    frozen = copy.deepcopy(base[0])
    snapquant.patch(frozen, "per_tensor_fp8", backend="reference")
    reason = refill_reason(DecodeLoop(frozen, tok, steps="static"))
    assert reason is not None and "per_tensor" in reason
    cache = LatentCache("snapmla", model, max_cache_len=8)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cache_kwarg(model): cache})
    with pytest.raises(ShapeError, match="room for 100"):
        cache.latent_layers[0].load_request(0, None, 100)



def test_lm_eval_groups_go_through_the_queue_with_the_same_strings(base):
    """SnapquantLM(gen_refill=...): the same generate_until strings with refill, without, and from HF generate."""
    from lm_eval.api.instance import Instance

    from snapquant.eval import SnapquantLM

    tok = base[1]
    kw = {"until": STOP, "max_gen_toks": MAX_NEW, "do_sample": False}
    reqs = [Instance("generate_until", {}, (p, dict(kw)), i) for i, p in enumerate(PROMPTS)]
    texts, infos = {}, {}
    for generation, refill in (("hf", False), ("loop", True), ("loop", False), ("loop", "auto")):
        lm = SnapquantLM(pretrained=copy.deepcopy(base[0]), tokenizer=tok, kv_config="snapmla", batch_size=3,
                         device="cpu", generation=generation, gen_steps="static", gen_check_every=2,
                         gen_refill=str(refill))
        texts[generation, refill] = lm.generate_until(reqs)
        infos[generation, refill] = lm.get_model_info()["snapquant_generation"]
    assert texts["loop", True] == texts["loop", False] == texts["loop", "auto"] == texts["hf", False]
    assert len(set(texts["hf", False])) > 2
    stats = infos["loop", True]["refill_stats"]
    assert len(stats) == 1 and stats[0]["refills"] > 0 and stats[0]["requests"] == len(PROMPTS)
    assert infos["loop", False]["refill_stats"] == [] and infos["loop", False]["refill"] is False
    with pytest.raises(ConfigError, match="gen_refill must be"):
        SnapquantLM(pretrained="/nonexistent/checkpoint", gen_refill="maybe")


@pytest.mark.gpu
def test_refill_through_the_captured_graph_gives_the_static_steps_tokens():
    """On CUDA the queue replays one captured step while slots are refilled in place: every request's tokens
    equal the uncaptured fixed-shape step's (same kernels), with refills happening and one capture."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tok = char_tokenizer()
    torch.manual_seed(0)
    model = tiny_model("deepseek_v3", moe=True, vocab_size=len(tok), dtype=torch.bfloat16, kv_lora_rank=64,
                       qk_rope_head_dim=16).cuda()  # kernel widths (powers of two >= 16)
    snapquant.patch(model, "snapmla", backend="triton")
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS * 3]
    plan = decoding_plan(model, {"do_sample": False}, 4)
    static = run_queue(DecodeLoop(model, tok, steps="static", check_every=4), ids, slots=5, max_new_tokens=MAX_NEW,
                       plan=plan, stop=STOP, refill=True)
    graph_loop = DecodeLoop(model, tok, steps="graph", check_every=4)
    graph = run_queue(graph_loop, ids, slots=5, max_new_tokens=MAX_NEW, plan=plan, stop=STOP, refill=True)
    assert graph.stats["refills"] > 0 and graph_loop.captures == 1
    assert graph.tokens == static.tokens
