"""Generation throughput of lm-eval's decode: HF `generate` against snapquant's decode loop (`scripts/bench_eval.py`).

Models: random weights in the shapes of DeepSeek-V2-Lite (27 layers, hidden 2048, 16 heads, kv_lora_rank
512, no q-LoRA, 64 routed + 2 shared experts of width 1408, top-6, first layer dense) and of DeepSeek-V3
(hidden 7168, 128 heads, q-LoRA 1536, 256 routed + 1 shared experts of width 2048, top-8) with as many
layers as fit the GPU (`--v3-layers auto`), bf16, vocabulary cut to `--vocab` (the LM head is not what
is measured). Each cell (preset x batch x context x path) fills a LatentCache with `context` random
latent tokens per request (RMS-normed latent ~ N(0, 1), RoPE key ~ N(0, 1), as `bench_e2e` does; a real
32K prefill at batch 128 would take minutes), then generates `--new-tokens` greedy tokens with the
EOS disabled (every row runs to the end, both paths do the same steps):

    hf      model.generate(..., cache=the filled cache): HF's loop, experts switched to batched_mm for
            decode (transformers' `_optimize_model_for_decode`), one host sync per step
    loop    snapquant.eval.generation.DecodeLoop: DecodeGraph steps captured as a CUDA graph over the
            preallocated cache, experts as grouped GEMMs (snapquant.models.experts), stopping checked
            every 16 steps off the critical path

Per cell: tokens/s = batch x (new tokens - 1) / decode seconds (decode = after the first token: HF's per-step
times from a streamer callback, the loop's from its own timer; capture excluded, reported apart), the
median step time, peak memory, for loop cells every step's time (`step_ms_samples`, CUDA events between
replays, JSON only: the capacity table's decode ratio to bf16 gets a 95 % bootstrap interval and n from
them) and an eager step split (`eager_step_split`): the same
fixed-shape step run uncaptured, timed whole and at every attention / routed-experts module boundary
(CUDA events or perf_counter from forward hooks), with `split_sum_over_step` checking that the parts add
up to the unhooked step. It is the eager step's split, not the graph step's. Before timing, per model
and preset: the first two selections' logits and the greedy tokens of the loop against HF generate from
the same cache (max |logit diff| / max |logit|; the fraction of rows whose first token agrees; the mean
length of the agreeing prefix over the new tokens).

`--e2e-lmeval` first runs, per preset and batch in `--e2e-batches`, `--e2e-n-batches` batches of synthetic
gsm8k-like lm-eval Instances (`--e2e-prompt`-token prompts of a word-level tokenizer, lm-eval's gsm8k stop
strings, greedy, max_gen_toks = `--e2e-new-tokens`) through `SnapquantLM.generate_until`, the call lm-eval's
evaluator makes: rows with path `lmeval` give tokens/s over the whole call (prefill, decode, stopping,
lm-eval's tokenization and post-processing), the path each batch took (decode loop or HF generate), and
a gsm8k-sized cell (1319 prompts) projected from the measured batch times, with cells per hour. From the
ok loop rows the output also derives how many requests of each preset fit the GPU's memory beside the
weights (`capacity`).

Every section is bounded: cells whose cache would not fit are skipped (status `skip: memory`), and no
new cell starts that would end (by a rough per-cell estimate) after `--budget-s` seconds (status `skip:
budget`); results are written after every cell (CSV + Markdown + JSON, atomically) and merged with the rows already in `--out` by key, so a
sweep split over several calls accumulates in one table. `--smoke` runs the same plumbing on CPU with
a tiny model in seconds (the loop's fixed-shape steps uncaptured).
"""

from __future__ import annotations

import argparse
import csv
import inspect
import io
import itertools
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write_json, atomic_write_text
from ..models.stepping import cache_kwarg
from .ncu import short_name
from .results import ratio_interval

COLUMNS = ("model", "layers", "preset", "batch", "context", "path", "new_tokens", "tokens_per_s", "step_ms",
           "eager_step_ms", "eager_attention_ms", "eager_experts_ms", "eager_rest_ms", "split_sum_over_step",
           "split_clock", "prefill_s", "capture_s", "peak_gib", "cache_gib", "weights_gib", "experts", "step_fusions",
           "steady_tokens_per_s", "gen_tokens", "batches", "cell_1319_s", "cell_tokens_per_s", "cells_per_hour", "gen_path", "status")
E2E_PATH = "lmeval"  # the `path` of rows timed through SnapquantLM.generate_until
KEY = ("model", "preset", "batch", "context", "path")
V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
               n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
               q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
               n_group=1, topk_group=1, norm_topk_prob=False, max_position_embeddings=65536)
V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
          num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
          num_experts_per_tok=8, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
          qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4, norm_topk_prob=True,
          routed_scaling_factor=2.5, max_position_embeddings=65536)


# ---------------------------------------------------------------------------------------------- models
def v3_layers_that_fit(free_bytes: float, vocab: int, reserve_gib: float = 40.0) -> int:
    """Decoder layers of the V3 shape (1 dense, the rest MoE) whose bf16 weights fit beside `reserve_gib`."""
    h, moe = V3["hidden_size"], V3["moe_intermediate_size"]
    attn = h * 1536 + 1536 * 128 * 192 + h * 576 + 512 * 128 * 256 + 128 * 128 * h
    moe_layer = (attn + (V3["n_routed_experts"] + 1) * 3 * h * moe + h * V3["n_routed_experts"]) * 2
    dense_layer = (attn + 3 * h * V3["intermediate_size"]) * 2
    budget = free_bytes - reserve_gib * 2**30 - 2 * vocab * h * 2 - dense_layer
    return max(2, 1 + int(budget // moe_layer))


def build_model(shape: str, layers: int | None, dtype: torch.dtype, device: str, vocab: int):
    """A random-weight causal LM of `shape` ('v2lite', 'v3', 'tiny'), eval mode, in `dtype` on `device`."""
    if shape == "tiny":
        from ..models.tiny import tiny_model

        torch.manual_seed(0)
        model = tiny_model("deepseek_v3", moe=True, vocab_size=vocab, dtype=dtype).to(device)
        model.generation_config.eos_token_id = None
        return model
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    base = dict(V2_LITE if shape == "v2lite" else V3, vocab_size=vocab, pad_token_id=0, eos_token_id=None)
    if layers is not None:
        base["num_hidden_layers"] = layers
    cls, model_cls = (DeepseekV2Config, DeepseekV2ForCausalLM) if shape == "v2lite" else \
        (DeepseekV3Config, DeepseekV3ForCausalLM)
    cfg = cls(**base)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16 directly: a V3 MoE layer is 23 GB in bf16, 46 in fp32
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = None  # every row runs to the end on both paths
    return model.eval()


FILL_CHUNK = 2048  # tokens per append when filling a cache: bounds the fill's temporaries, not the cache


def fill_cache(cache, model, batch: int, length: int, seed: int = 1):
    """`length` random latent tokens per request in every MLA layer (drawn on the model's device), appended
    FILL_CHUNK tokens at a time: one draw of the whole [batch, length, r] in fp32 plus the quantizer's
    temporaries is 8 GiB or more at batch 128 and 32K, enough to run a cell that fits out of memory. Each
    chunk is drawn from its own generator (seed, layer, chunk), so a longer fill extends a shorter one.
    Per-tensor presets take their scale from the first append (the first chunk here)."""
    from ..models.registry import find_mla_modules

    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    for li, (_, module, adapter) in enumerate(find_mla_modules(model)):
        r, d = adapter.dims(module)
        layer = cache.layer(module.layer_idx, r, d)
        for c, start in enumerate(range(0, length, FILL_CHUNK)):
            n = min(FILL_CHUNK, length - start)
            g = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + li * 10_007 + c)
            latent = torch.randn(batch, n, r, generator=g, device=dev).to(dtype)
            rope = torch.randn(batch, n, d, generator=g, device=dev).to(dtype)
            layer.append(latent, rope)
            del latent, rope
    return cache


# ---------------------------------------------------------------------------------------------- timing
class _StepClock:
    """An HF streamer that notes the time of every `put` (HF syncs each step to decide whether to stop)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_cell(model, preset: str, batch: int, context: int, path: str, new_tokens: int, steps: str,
             keep_logits: int = 0) -> dict[str, Any]:
    """Fill a cache, generate `new_tokens` greedy tokens through `path`; timings, tokens and kept logits."""
    from ..cache import LatentCache
    from ..eval.generation import DecodeLoop, decoding_plan

    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (batch, context + 1), generator=g).to(dev)
    am = torch.ones_like(ids)
    loop = path == "loop"
    cache = LatentCache(preset, model, max_cache_len=context + new_tokens + 1 if loop else None)
    fill_cache(cache, model, batch, context)
    cache_bytes = cache.nbytes()
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    out: dict[str, Any] = {"cache_gib": cache_bytes / 2**30}
    t0 = time.perf_counter()
    if loop:
        plan = decoding_plan(model, {"do_sample": False})
        dloop = DecodeLoop(model, None, steps=steps, check_every=16, time_steps=True)
        res = dloop.generate(ids, am, max_length=context + 1 + new_tokens, plan=plan, cache=cache,
                             keep_logits=keep_logits)
        # which step kernels ran (the fused rotary only where its bits match torch's on this GPU)
        out["step_fusions"] = (f"norms={'fused' if dloop.fused_norms else 'torch'}; "
                               f"rotary={_rotary_label(dloop.rotary_mode) or 'torch'}")
        _sync(dev)
        out.update(tokens=res.sequences[:, context + 1:], logits=res.logits, prefill_s=res.seconds["prefill"],
                   step_s=res.seconds["decode"] / max(res.steps, 1), decode_s=res.seconds["decode"],
                   step_ms_samples=[x * 1e3 for x in res.step_seconds])
        out["capture_s"] = res.seconds.get("capture", 0.0)
    else:
        clock = _StepClock()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0, use_cache=True, streamer=clock,
                                 **{cache_kwarg(model): cache},
                                 output_logits=keep_logits > 0, return_dict_in_generate=True)
        _sync(dev)
        t = clock.times  # put(prompt), then one put per generated token
        steps_s = [b - a for a, b in itertools.pairwise(t[1:])]
        out.update(tokens=gen.sequences[:, context + 1:], logits=[x.float() for x in (gen.logits or ())][:keep_logits],
                   prefill_s=t[1] - t0, step_s=statistics.median(steps_s) if steps_s else float("nan"),
                   decode_s=t[-1] - t[1], capture_s=0.0)
    out["total_s"] = time.perf_counter() - t0
    out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    out["tokens_per_s"] = batch * (new_tokens - 1) / out["decode_s"] if out["decode_s"] > 0 else float("nan")
    del cache
    return out


def _rotary_label(mode: Any) -> str | None:
    """The fused rotary kernel's contraction mode as the results name it ("mode(1, 0)"), None: not switched in."""
    return None if mode is None else f"mode{tuple(mode)}"


class _Clock:
    """Timestamps in stream order: CUDA events recorded on the current stream (GPU time, including any idle
    gap while the stream waits for the host to launch the next kernel), or `time.perf_counter` on CPU."""

    def __init__(self, cuda: bool) -> None:
        from ..eval.generation import stream_timestamp  # bound once: mark() runs inside forward hooks

        self.cuda, self._stamp = cuda, stream_timestamp

    def mark(self) -> Any:
        return self._stamp(self.cuda)

    def ms(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) if self.cuda else (b - a) * 1e3


def split_intervals(marks: list[tuple[str, str, Any]], ms) -> dict[str, float]:
    """Milliseconds per region from `marks` [(kind, label, timestamp)], kind 'enter' / 'exit' / 'mark',
    in the order they were recorded: every interval between two consecutive marks goes to the innermost
    region open at its start, or to 'rest'. The intervals tile [first mark, last mark], so the regions add
    up to the whole by construction and nested regions are never counted twice."""
    out: dict[str, float] = {"rest": 0.0}
    stack: list[str] = []
    for (kind, label, t0), (_, _, t1) in itertools.pairwise(marks):
        if kind == "enter":
            stack.append(label)
        elif kind == "exit":
            if not stack or stack[-1] != label:
                raise ValueError(f"exit {label!r} does not close the innermost open region {stack[-1:]}")
            stack.pop()
        region = stack[-1] if stack else "rest"
        out[region] = out.get(region, 0.0) + ms(t0, t1)
    return out


def eager_step_split(model, preset: str, batch: int, context: int, steps: int = 5) -> dict[str, Any]:
    """The uncaptured fixed-shape decode step (DecodeGraph(capture=False): the step the CUDA graph records,
    run eagerly) timed whole and split into MLA attention modules / routed-experts modules / the rest (norms,
    projections, router, shared experts, LM head).

    Forward pre/post hooks on those modules put a timestamp (`_Clock`: CUDA events on the stream, or
    perf_counter on CPU) at every module boundary; `split_intervals` gives each interval to the region it
    lies in. Medians over `steps` steps. `split_sum_over_step` = (attention + experts + rest) of the hooked
    steps / the median of the same step timed without hooks: near 1 when the hooks neither double count
    nor slow the step. This is an eager step: on the GPU it includes the launch gaps the CUDA graph removes,
    so it is longer than the graph's `step_ms`; read it as where an eager step's time goes, not as a split of
    the graph step."""
    from ..cache import LatentCache
    from ..graphs import DecodeGraph
    from ..models.experts import expert_modules
    from ..models.registry import find_mla_modules
    from ..models.step_kernels import step_kernels

    dev = next(model.parameters()).device
    clock = _Clock(dev.type == "cuda")
    cache = fill_cache(LatentCache(preset, model, max_cache_len=context + 2 * steps + 8), model, batch, context)
    ids = torch.full((batch, 1), 5, dtype=torch.long, device=dev)
    marks: list[tuple[str, str, Any]] = []
    hooks = []

    def wrap(mod, label: str) -> None:
        hooks.append(mod.register_forward_pre_hook(lambda *a: marks.append(("enter", label, clock.mark()))))
        hooks.append(mod.register_forward_hook(lambda *a: marks.append(("exit", label, clock.mark()))))

    plain: list[float] = []
    parts: list[dict[str, float]] = []
    # the experts and norms as the decode loop runs them on this device (DecodeLoop.step_modules)
    with step_kernels(model, fused=dev.type == "cuda"), torch.no_grad():
        graph = DecodeGraph(model, cache, capture=False)
        for _ in range(2):  # warm-up: kernel selection, allocator
            graph.step(ids)
            graph.rewind(1)
        _sync(dev)
        # plain and hooked steps alternate, so that drift (clocks, a shared host) hits both alike
        for _ in range(steps):
            a = clock.mark()
            graph.step(ids)
            b = clock.mark()
            _sync(dev)
            plain.append(clock.ms(a, b))
            graph.rewind(1)
            try:
                for _, m, _ in find_mla_modules(model):
                    wrap(m, "attention")
                for m in expert_modules(model):
                    wrap(m, "experts")
                marks.clear()
                marks.append(("mark", "start", clock.mark()))
                graph.step(ids)
                marks.append(("mark", "end", clock.mark()))
                _sync(dev)
            finally:
                for h in hooks:
                    h.remove()
                hooks.clear()
            split = split_intervals(marks, clock.ms)
            split["hooked"] = clock.ms(marks[0][2], marks[-1][2])
            parts.append(split)
            graph.rewind(1)
    del graph, cache

    def med(key: str) -> float:
        return statistics.median(p.get(key, 0.0) for p in parts)

    step = statistics.median(plain)
    att, exp, rest = med("attention"), med("experts"), med("rest")
    return {"eager_step_ms": step, "eager_attention_ms": att, "eager_experts_ms": exp, "eager_rest_ms": rest,
            "eager_hooked_ms": med("hooked"), "split_sum_over_step": (att + exp + rest) / step if step > 0 else None,
            "split_clock": "cuda events" if clock.cuda else "cpu perf_counter"}


def kernel_table(run, calls: int, cuda: bool, top: int = 12) -> dict[str, Any]:
    """Where the device time of `run()` goes, per call: `run` is called `calls` times under torch.profiler
    (CUDA kernels on a GPU, including those a CUDA graph replays; aten ops' self time on CPU), then the
    `top` names by total time with their ms and count per call, and `busy_ms` (all of them per call).
    Device time only: compare `busy_ms` with the wall time of the same call to see idle gaps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(calls):
            run()
        if cuda:
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and (ev.device_type != torch.autograd.DeviceType.CPU or not ev.name.startswith("aten::")):
            continue
        us = ev.device_time if cuda else ev.self_cpu_time_total
        t = totals.setdefault(ev.name, [0.0, 0])
        t[0] += us
        t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    busy = sum(v[0] for v in totals.values()) / 1e3 / calls
    return {"busy_ms": busy, "clock": "cuda kernels" if cuda else "cpu aten self time",
            "kernels": [{"name": short_name(n, 90), "ms": v[0] / 1e3 / calls, "count": v[1] / calls,
                         "share": v[0] / 1e3 / calls / busy if busy else None} for n, v in ranked[:top]]}


def step_and_prefill_kernels(model, preset: str, batch: int, context: int, prompt: int = 1024,
                             replays: int = 10, top: int = 12) -> dict[str, Any]:
    """`kernel_table` of the decode step as the loop runs it (captured on CUDA, the static step on CPU) after
    `context` cached tokens, and of one eager prefill of `prompt` tokens per request (what a lm-eval batch
    pays before its first token)."""
    from ..cache import LatentCache
    from ..graphs import DecodeGraph
    from ..models.step_kernels import step_kernels

    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    cache = fill_cache(LatentCache(preset, model, max_cache_len=context + replays + 8), model, batch, context)
    ids = torch.full((batch, 1), 5, dtype=torch.long, device=dev)
    out: dict[str, Any] = {}
    with step_kernels(model, fused=cuda), torch.no_grad():
        graph = DecodeGraph(model, cache, capture=cuda)
        for _ in range(2):
            graph.step(ids)
            graph.rewind(1)

        def step(graph=graph):
            graph.step(ids)
            graph.rewind(1)

        out["step"] = kernel_table(step, replays, cuda, top)
    del step, graph, cache
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g).to(dev)

    def prefill():
        with torch.no_grad():
            model(input_ids=prompt_ids, use_cache=True, **{cache_kwarg(model): LatentCache(preset, model)},
                  **({"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters
                     else {}))

    with step_kernels(model, fused=cuda):  # as the loop's prefill runs (DecodeLoop.step_modules)
        prefill()  # warm-up
        out["prefill"] = kernel_table(prefill, 1, cuda, top)
    return out


# ---------------------------------------------------------------------------------------------- e2e
GSM8K_UNTIL = ("Question:", "</s>", "<|im_end|>")  # lm-eval's gsm8k stop strings
GSM8K_TEST = 1319  # prompts in gsm8k's test split: one sweep cell's generation


def synthetic_tokenizer(vocab: int, stop_every: int = 0):
    """A word-level fast tokenizer over exactly `vocab` ids, built offline: <pad> <s> </s> <unk>, the stop
    strings of `GSM8K_UNTIL` as ordinary words (so a random-weight model can emit them and the stopping rules
    see real matches), then w6, w7, ...; a prompt of n words encodes to n tokens and every id decodes to one word.
    `stop_every=m`: every m-th word is `Question:w<i>` instead, so a random model's greedy answers stop after
    ~m tokens on average, at scattered points (what refilling finished slots needs to show anything)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", *[u for u in GSM8K_UNTIL if u != "</s>"]]
    words += [f"Question:w{i}" if stop_every and i % stop_every == 0 else f"w{i}" for i in range(len(words), vocab)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=1 << 20)


def e2e_requests(tokenizer, n: int, prompt_len: int, max_gen_toks: int, seed: int = 3) -> list:
    """`n` lm-eval generate_until Instances as gsm8k's config makes them: a `prompt_len`-token prompt of
    random words, until = `GSM8K_UNTIL`, greedy (do_sample false, temperature 0), max_gen_toks."""
    from lm_eval.api.instance import Instance

    g = torch.Generator().manual_seed(seed)
    first = 3 + len(GSM8K_UNTIL)  # no stop word and no special token inside a prompt
    ids = torch.randint(first, len(tokenizer), (n, prompt_len), generator=g).tolist()
    ids = [[i if "Question:" not in tokenizer.convert_ids_to_tokens(i) else first for i in r] for r in ids]
    kwargs = {"until": list(GSM8K_UNTIL), "do_sample": False, "temperature": 0.0, "max_gen_toks": max_gen_toks}
    return [Instance("generate_until", {}, (tokenizer.decode(row), dict(kwargs)), i, doc_id=i, task_name="synthetic")
            for i, row in enumerate(ids)]


def project_cell(first_s: float, steady_batch_s: float, batch: int, prompts: int = GSM8K_TEST) -> float:
    """Seconds of one sweep cell's generation over `prompts` requests: the first batch (capture, warm-up)
    as measured, every further batch (the last one partial, costed as a full one: a step costs nearly the
    same at any batch) at the measured steady batch time."""
    return first_s + max(math.ceil(prompts / batch) - 1, 0) * steady_batch_s


def project_queue(total_s: float, requests: int, prompts: int = GSM8K_TEST) -> float:
    """Seconds of one sweep cell's generation when slot refill serves `requests` requests as one queue in
    `total_s` (the graph capture included once, so slightly pessimistic): the same time per request."""
    return total_s * prompts / max(requests, 1)


def run_e2e(model, tokenizer, preset: str, batch: int, n_batches: int, prompt_len: int, new_tokens: int,
            backend: str, generation: str = "auto", gen_steps: str = "auto",
            refill: bool | str = False) -> dict[str, Any]:
    """`n_batches` x `batch` synthetic gsm8k-like requests through `SnapquantLM.generate_until` (what lm-eval's
    evaluator calls: tokenization, left-padded batches, prefill, decode, stopping, post-processing), timed
    per batch; the model must be unpatched (SnapquantLM patches it) and is left patched with `preset`."""
    from ..eval.lm import SnapquantLM

    dev = next(model.parameters()).device
    lm = SnapquantLM(pretrained=model, tokenizer=tokenizer, kv_config=preset, backend=backend, batch_size=batch,
                     device=str(dev), generation=generation, gen_steps=gen_steps, gen_refill=refill)
    # tokens to each answer's stop (the stop word or EOS included): what either batching must generate
    stop_ids = torch.tensor([i for w, i in tokenizer.get_vocab().items()
                             if any(u in w for u in GSM8K_UNTIL)], device=dev)
    batches: list[dict[str, Any]] = []
    loop_seconds: list[dict[str, Any]] = []
    inner = lm._model_generate

    def timed(context, max_length, stop, **kw):  # instance attribute: this LM only
        _sync(dev)
        t = time.perf_counter()
        seq = inner(context, max_length, stop, **kw)
        _sync(dev)
        new = seq[:, context.shape[1]:]
        hit = torch.isin(new, stop_ids)
        first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full_like(hit[:, 0], new.shape[1], dtype=torch.long))
        batches.append({"start": t, "end": time.perf_counter(), "rows": int(context.shape[0]),
                        "prompt": int(context.shape[1]), "new": int(new.shape[1]), "answer": int(first.sum())})
        return seq

    lm._model_generate = timed
    loop = None
    if lm.generation_default[0] == "loop":
        loop = lm.decode_loop()
        loop_generate = loop.generate

        def recorded(*a, **kw):
            res = loop_generate(*a, **kw)
            loop_seconds.append(dict(res.seconds, steps=res.steps))
            return res

        loop.generate = recorded
    reqs = e2e_requests(tokenizer, batch * n_batches, prompt_len, new_tokens)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    texts = lm.generate_until(reqs, disable_tqdm=True)
    t1 = time.perf_counter()
    assert len(texts) == len(reqs)
    info = lm.get_model_info()["snapquant_generation"]
    if loop is not None:
        loop.release()  # its kept cache and graph
    del lm, loop
    tokens = [b["rows"] * b["new"] for b in batches]
    steady = batches[1:] or batches
    steady_s = (t1 - steady[0]["start"]) if len(batches) > 1 else (t1 - t0)  # includes lm-eval's own work
    steady_batch_s = steady_s / len(steady)
    first_s = (batches[1]["start"] - t0) if len(batches) > 1 else (t1 - t0)
    if len(batches) == 1 and len(reqs) > batch:
        # slot refill: one queue served all requests (no batch boundaries), so the cell scales by requests
        cell_s = project_queue(t1 - t0, len(reqs))
    else:
        cell_s = project_cell(first_s, steady_batch_s, batch)
    paths = "; ".join(f"{b['path']} x{b['count']} ({b['reason']})" for b in info["batches"])
    out: dict[str, Any] = {
        "tokens_per_s": sum(tokens) / (t1 - t0), "steady_tokens_per_s": sum(tokens[-len(steady):]) / steady_s,
        "gen_tokens": statistics.mean(b["new"] for b in batches), "gen_path": f"{paths}; steps={info['steps']}"
                    + ("; norms=fused" if (info.get("fused_norms") or {}).get("on") else "")
                    + (f"; rotary={label}" if (label := _rotary_label((info.get("fused_norms") or {})
                                                                       .get("rotary_mode"))) else ""),
        "cell_1319_s": cell_s, "cells_per_hour": 3600.0 / cell_s,
        # the cell's own throughput: its first batch (compilation, probes, capture) spread over 1319 answers
        "cell_tokens_per_s": 1319 * new_tokens / cell_s, "total_s": t1 - t0, "batches": len(batches),
        "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None}
    out["answer_tokens_per_s"] = sum(b["answer"] for b in batches) / (t1 - t0)
    out["answer_tokens"] = sum(b["answer"] for b in batches) / len(reqs)
    if info["refill_stats"]:
        q = info["refill_stats"]
        out.update(refills=sum(x["refills"] for x in q), decode_steps=sum(x["decode_steps"] for x in q),
                   utilisation=sum(x["useful_slot_steps"] for x in q) / max(sum(x["slot_steps"] for x in q), 1))
    if loop_seconds:
        later = loop_seconds[1:] or loop_seconds
        out["prefill_s"] = statistics.mean(x["prefill"] for x in later)
        out["capture_s"] = loop_seconds[0].get("capture", 0.0)
        out["step_ms"] = statistics.mean(x["decode"] / max(x["steps"], 1) for x in later) * 1e3
        # where the first batch's extra time goes (compilation and one-off probes land in its prefill or capture)
        out["first_batch_s"] = first_s
        out["first_prefill_s"] = loop_seconds[0]["prefill"]
        out["first_decode_s"] = loop_seconds[0]["decode"]
    return out


# ---------------------------------------------------------------------------------------------- checks
def check_paths(model, preset: str, batch: int, context: int, new_tokens: int, steps: str) -> dict[str, Any]:
    """The loop against HF generate from the same filled cache: first logits and greedy agreement."""
    hf = run_cell(model, preset, batch, context, "hf", new_tokens, steps, keep_logits=2)
    lp = run_cell(model, preset, batch, context, "loop", new_tokens, steps, keep_logits=2)
    rel = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(lp["logits"], hf["logits"],
                                                                                        strict=True)]
    a, b = lp["tokens"].cpu(), hf["tokens"].cpu()
    same = (a == b).long()
    prefix = same.cumprod(dim=1).sum(dim=1).float()  # agreeing tokens before the first difference, per row
    return {"preset": preset, "batch": batch, "context": context, "new_tokens": new_tokens,
            "logits_rel_step0": rel[0], "logits_rel_step1": rel[1] if len(rel) > 1 else None,
            "first_token_agree": float(same[:, 0].float().mean()), "prefix_agree": float(prefix.mean() / a.shape[1]),
            "token_agree": float(same.float().mean()), "rows": a.shape[0]}


# ---------------------------------------------------------------------------------------------- output
# Step-split columns of earlier versions (torch.profiler ranges): they added up to 10-20x the step, so they
# are dropped from merged rows rather than shown beside the validated split.
LEGACY_SPLIT = ("attention_ms", "experts_ms", "rest_ms", "kernel_ms")


def _clean(row: dict) -> dict:
    row = {k: v for k, v in row.items() if k not in LEGACY_SPLIT}
    if row.get("split_clock") == "gpu kernels":
        row.pop("split_clock")
    return row


def _merge(old: list[dict], new: list[dict]) -> list[dict]:
    keyed = {tuple(str(r.get(k)) for k in KEY): _clean(r) for r in old}
    for r in new:
        keyed[tuple(str(r.get(k)) for k in KEY)] = r
    return list(keyed.values())


def capacity(rows: list[dict], memory_gib: float | None) -> list[dict]:
    """Per (model, context, batch) with an ok decode-loop row for a preset: the largest batch whose weights +
    per-request memory fit `memory_gib`, two ways: 'peak' counts everything the measured peak holds beyond the
    weights as per request (conservative), 'cache' counts only the cache bytes per request (the rest of the
    measured peak as fixed); with each preset's ratio to bf16's, and the decode tokens/s ratio to bf16 at the
    measured batch."""
    if not memory_gib:
        return []
    ok = [r for r in rows if r.get("path") == "loop" and r.get("status") == "ok" and r.get("peak_gib")
          and r.get("weights_gib") and r.get("cache_gib")]
    out = []
    samples: dict[tuple, list[float]] = {}
    for r in sorted(ok, key=lambda r: (r["model"], int(r["context"]), int(r["batch"]), r["preset"])):
        samples[(r["model"], int(r["context"]), int(r["batch"]), r["preset"])] = r.get("step_ms_samples") or []
        B, peak, w, cache = int(r["batch"]), float(r["peak_gib"]), float(r["weights_gib"]), float(r["cache_gib"])
        per_peak, per_cache = (peak - w) / B, cache / B
        fixed = peak - w - cache
        out.append({"model": r["model"], "context": int(r["context"]), "batch": B, "preset": r["preset"],
                    "tokens_per_s": r.get("tokens_per_s"), "memory_gib": memory_gib, "per_request_gib_peak": per_peak,
                    "per_request_gib_cache": per_cache,
                    "max_batch_peak": int(max(memory_gib - w, 0) // per_peak) if per_peak > 0 else None,
                    "max_batch_cache": int(max(memory_gib - w - fixed, 0) // per_cache) if per_cache > 0 else None})
    for c in out:
        base = next((x for x in out if (x["model"], x["context"], x["batch"], x["preset"]) ==
                     (c["model"], c["context"], c["batch"], "bf16")), None)
        for k in ("max_batch_peak", "max_batch_cache", "tokens_per_s"):
            ok_ = base is not None and base.get(k) and c.get(k) is not None
            c[f"{k}_vs_bf16"] = float(c[k]) / float(base[k]) if ok_ else None
        # the decode speed ratio's interval: bf16's step times over this preset's (same batch), bootstrapped
        mine, theirs = (samples.get((c["model"], c["context"], c["batch"], p), []) for p in (c["preset"], "bf16"))
        ci = ratio_interval(theirs, mine) if base is not None and c["preset"] != "bf16" else None
        c["tokens_per_s_vs_bf16_lo"], c["tokens_per_s_vs_bf16_hi"] = ci if ci else (None, None)
        # the statistic that interval is for: bf16's median step over this preset's (tokens_per_s_vs_bf16 is the
        # ratio of the rows' mean rates, which can sit just outside a tight interval of the medians)
        c["median_step_ratio_vs_bf16"] = statistics.median(theirs) / statistics.median(mine) if ci else None
        c["steps_n"] = len(mine)
    return out


def _ci(c: dict) -> str:
    """A capacity row's decode ratio to bf16: with step samples the ratio of median steps, its interval and n
    ('1.175 [1.172, 1.177] (n = 63)'), else the ratio of mean tokens/s alone."""
    lo, hi, med = c.get("tokens_per_s_vs_bf16_lo"), c.get("tokens_per_s_vs_bf16_hi"), c.get("median_step_ratio_vs_bf16")
    if lo is None or hi is None or med is None:
        v = c.get("tokens_per_s_vs_bf16")
        return "" if v is None else f"{v:.2f}"
    return f"{med:.3f} [{lo:.3f}, {hi:.3f}] (n = {c.get('steps_n')})"


def write_outputs(out: Path, rows: list[dict], checks: list[dict], env: dict) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out.with_suffix(".csv"), buf.getvalue())
    mem = env.get("memory_gib")
    mem = float(mem) * float(env.get("mem_frac", 1.0)) if mem else None
    cap = capacity(rows, mem)
    atomic_write_json(out.with_suffix(".json"), {"env": env, "rows": rows, "checks": checks, "capacity": cap}, indent=2)

    def f(v, fmt):
        return "" if v is None or v == "" else format(float(v), fmt)

    def order(r):
        return (r["model"], r["preset"], int(r["batch"]), int(r["context"]), r["path"])

    decode = [r for r in rows if not str(r.get("path")).startswith(E2E_PATH)]
    e2e = [r for r in rows if str(r.get("path")).startswith(E2E_PATH)]
    lines = [f"# lm-eval generation throughput: HF generate vs the snapquant decode loop ({env.get('device')})", "",
             f"Random-weight models, {env.get('dtype')} weights. Last call: commit {env.get('git_commit')}, torch "
             f"{env.get('torch')}, transformers {env.get('transformers')}, `{env.get('command')}`; rows merged "
             f"from earlier calls keep their own numbers (the JSON has only the last call's environment).", ""]
    if e2e:
        lines += ["## End to end through lm-eval's `generate_until`", "",
                  "`SnapquantLM.generate_until` on synthetic gsm8k-like requests (prompts of `context` random words = "
                  "tokens, until = Question: / </s> / <|im_end|>, greedy, max_gen_toks = new tokens), timed around the "
                  "whole call: tokenization, left-padded batches, prefill, decode, stopping, post-processing. "
                  "tokens/s = generated tokens (rows x new tokens per batch) / seconds, over all batches (the first "
                  "one captures the graph) and over the later ones (steady). 1319-prompt cell = the first batch + "
                  "ceil(1319 / batch) - 1 steady batches: gsm8k's test split at this prompt length, every answer "
                  "running to the token limit (an upper bound; real prompts are shorter or longer); a +refill row served "
                  "all its requests as one queue, so its cell is its seconds x 1319 / requests; cell tokens/s = "
                  "1319 x new tokens / cell seconds (the first batch's one-off costs spread over the cell).", "",
                  "| model | preset | batch | prompt | new | batches | tokens/s | steady tokens/s | ms/step | prefill s "
                  "| 1319-prompt cell s | cell tokens/s | cells/h | peak GiB | path | status |", "|" + "---|" * 16]
        for r in sorted(e2e, key=order):
            lines.append(f"| {r['model']} ({r.get('layers')}L) | {r['preset']} | {r['batch']} | {r['context']} | "
                         f"{f(r.get('gen_tokens'), '.0f')} | {r.get('batches', '')} | {f(r.get('tokens_per_s'), '.0f')} | "
                         f"{f(r.get('steady_tokens_per_s'), '.0f')} | {f(r.get('step_ms'), '.2f')} | "
                         f"{f(r.get('prefill_s'), '.2f')} | {f(r.get('cell_1319_s'), '.0f')} | "
                         f"{f(r.get('cell_tokens_per_s'), '.0f')} | "
                         f"{f(r.get('cells_per_hour'), '.1f')} | {f(r.get('peak_gib'), '.1f')} | {r['path']}: {r.get('gen_path') or ''}"
                         f"{_refill_note(r)} | "
                         f"{r.get('status', '')} |")
        lines.append("")
    lines += ["## Decode after a filled cache", "",
              "`new_tokens` greedy tokens per request after a cache filled with `context` random latent tokens; tokens/s = "
              "batch x (new tokens - 1) / decode seconds. Eager split: the uncaptured fixed-shape step timed with "
              f"{env.get('split_clock') or 'CUDA events'} at the module boundaries (forward hooks); an eager step is not "
              "the graph step (it includes launch gaps the graph removes): eager ms is the same step unhooked, "
              "sum/step = (attention + experts + rest) / eager ms (about 1: nothing counted twice).", "",
              "| model | preset | batch | context | path | tokens/s | ms/step | eager ms | eager attention | eager experts "
              "| eager rest | sum/step | peak GiB | cache GiB | experts | status |", "|" + "---|" * 16]
    for r in sorted(decode, key=order):
        lines.append(f"| {r['model']} ({r.get('layers')}L) | {r['preset']} | {r['batch']} | {r['context']} | {r['path']} | "
                     f"{f(r.get('tokens_per_s'), '.0f')} | {f(r.get('step_ms'), '.2f')} | {f(r.get('eager_step_ms'), '.2f')} | "
                     f"{f(r.get('eager_attention_ms'), '.2f')} | {f(r.get('eager_experts_ms'), '.2f')} | "
                     f"{f(r.get('eager_rest_ms'), '.2f')} | {f(r.get('split_sum_over_step'), '.3f')} | "
                     f"{f(r.get('peak_gib'), '.1f')} | {f(r.get('cache_gib'), '.2f')} | {r.get('experts') or ''} | "
                     f"{r.get('status', '')} |")
    if cap:
        lines += ["", f"Requests that fit {mem:.0f} GiB (GPU memory x mem_frac) beside the weights, from each ok decode-loop "
                  "row: 'peak' counts all of the measured peak beyond the weights as per request, 'cache' only the cache "
                  "(the rest of the peak as fixed); ratios against bf16 at the same model, context and batch:", "",
                  "| model | context | batch | preset | tokens/s | vs bf16 | GiB/request (peak) | max batch (peak) | vs bf16 "
                  "| GiB/request (cache) | max batch (cache) | vs bf16 |", "|" + "---|" * 12]
        for c in cap:
            lines.append(f"| {c['model']} | {c['context']} | {c['batch']} | {c['preset']} | {f(c['tokens_per_s'], '.0f')} | "
                         f"{_ci(c) or f(c['tokens_per_s_vs_bf16'], '.2f')} | {f(c['per_request_gib_peak'], '.3f')} | "
                         f"{c['max_batch_peak']} | {f(c['max_batch_peak_vs_bf16'], '.2f')} | "
                         f"{f(c['per_request_gib_cache'], '.3f')} | {c['max_batch_cache']} | "
                         f"{f(c['max_batch_cache_vs_bf16'], '.2f')} |")
    profiled = [r for r in decode if isinstance(r.get("kernels"), dict) and "step" in r["kernels"]]
    if profiled:
        lines += ["", "Where the device time goes (torch.profiler over 10 replays of the captured step, and over one "
                  "eager prefill of the e2e prompt length at the same batch): busy = the kernels' summed time per "
                  "call (step ms - busy = idle gaps), then the heaviest kernels with ms per call:", "",
                  "| model | preset | batch | context | step ms | step busy ms | step kernels | prefill busy ms | "
                  "prefill kernels |", "|" + "---|" * 9]
        for r in sorted(profiled, key=order):
            k = r["kernels"]

            def top(t, n=5):
                return "; ".join(f"`{x['name']}` {x['ms']:.2f}" for x in t["kernels"][:n])

            lines.append(f"| {r['model']} | {r['preset']} | {r['batch']} | {r['context']} | "
                         f"{f(r.get('step_ms'), '.2f')} | {f(k['step']['busy_ms'], '.2f')} | {top(k['step'])} | "
                         f"{f(k['prefill']['busy_ms'], '.1f')} | {top(k['prefill'])} |")
    if checks:
        lines += ["", "Loop vs HF generate from the same cache (max |logit diff| / max |logit| of the first two "
                  "selections; greedy agreement over the new tokens, per row):", "",
                  "| model | preset | batch | context | logits step 0 | logits step 1 | first token | agreeing prefix | "
                  "tokens equal |", "|" + "---|" * 9]
        for c in checks:
            lines.append(f"| {c.get('model')} | {c['preset']} | {c['batch']} | {c['context']} | "
                         f"{f(c['logits_rel_step0'], '.2e')} | {f(c['logits_rel_step1'], '.2e')} | "
                         f"{c['first_token_agree']:.3f} | {c['prefix_agree']:.3f} | {c['token_agree']:.3f} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------- main
def _refill_note(r: dict) -> str:
    """Answer tokens/s (to each answer's stop) and slot use of --refill rows."""
    if "/stop" not in str(r.get("path")) or r.get("answer_tokens_per_s") is None:
        return ""
    util = f", slot use {r['utilisation']:.2f}, {r['refills']} refills" if r.get("utilisation") is not None else ""
    return f" (answers: {r['answer_tokens']:.0f} tokens, {r['answer_tokens_per_s']:.0f} tokens/s{util})"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="v2lite,v3", help="comma-separated: v2lite, v3")
    p.add_argument("--v3-layers", default="auto", help="decoder layers of the V3 shape (auto: as many as fit)")
    p.add_argument("--presets", default="bf16,snapmla")
    p.add_argument("--batches", default="32,128")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--paths", default="hf,loop", help="decode cells: hf, loop (empty: none, e.g. with --e2e-lmeval)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared loop vs HF (0: no check)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no cell that would end (by a rough estimate) after this many seconds")
    p.add_argument("--mem-frac", type=float, default=0.85, help="skip cells whose weights + cache exceed this "
                                                                 "fraction of GPU memory")
    p.add_argument("--no-split", action="store_true", help="skip the eager step split")
    p.add_argument("--kernels", action="store_true",
                   help="loop cells: torch.profiler kernel table of the captured step and of one prefill of "
                        "--e2e-prompt tokens per request (JSON + a Markdown section)")
    p.add_argument("--e2e-lmeval", action="store_true",
                   help="first, per preset: synthetic gsm8k-like requests through SnapquantLM.generate_until")
    p.add_argument("--e2e-batches", default="32,128", help="batch sizes of the --e2e-lmeval cells")
    p.add_argument("--e2e-prompt", type=int, default=1024, help="prompt tokens per --e2e-lmeval request")
    p.add_argument("--e2e-new-tokens", type=int, default=256, help="max_gen_toks of the --e2e-lmeval requests")
    p.add_argument("--e2e-n-batches", type=int, default=3, help="batches per --e2e-lmeval cell (the first captures)")
    p.add_argument("--e2e-generation", default="auto", help="SnapquantLM generation= for --e2e-lmeval (auto, loop, hf)")
    p.add_argument("--refill", type=int, default=0, metavar="M",
                   help="--e2e-lmeval on a workload whose answers stop at scattered points (every M-th word is a stop "
                        "word): per batch size a row without slot refill (path lmeval/stopM) and one with it "
                        "(lmeval/stopM+refill); 0: the plain rows")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing run: tiny model, small cells, seconds")
    p.add_argument("--out", default="results/bench/eval_h200")
    args = p.parse_args(argv)

    from ..errors import ConfigError
    from ..presets import resolve_config

    try:  # bad options: one line, before any model is built
        models = [m for m in args.models.split(",") if m]
        for m in models:
            if m not in ("v2lite", "v3"):
                raise ConfigError(f"--models: unknown model shape {m!r} (v2lite, v3)")
        presets = [p_ for p_ in args.presets.split(",") if p_]
        for pr in presets:
            resolve_config(pr)
        paths = [x for x in args.paths.split(",") if x]
        if set(paths) - {"hf", "loop"}:
            raise ConfigError(f"--paths: unknown path in {args.paths!r} (hf, loop)")
        batches, contexts, e2e_batches = _ints(args.batches), _ints(args.contexts), _ints(args.e2e_batches)
        if args.new_tokens < 2:
            raise ConfigError("--new-tokens must be at least 2 (the first token is the prefill's)")
        if args.e2e_generation not in ("auto", "loop", "hf"):
            raise ConfigError(f"--e2e-generation must be auto, loop or hf, got {args.e2e_generation!r}")
        if args.e2e_n_batches < 1 or args.e2e_prompt < 1 or args.e2e_new_tokens < 1:
            raise ConfigError("--e2e-n-batches, --e2e-prompt and --e2e-new-tokens must be positive")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import transformers

    import snapquant

    from ..environment import environment
    from ..models.experts import experts_implementation, plan_decode_experts

    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    e2e_steps = "auto"
    if args.smoke:
        torch.set_num_threads(1)
        models = ["tiny"]
        batches = [2, 3] if args.batches == p.get_default("batches") else batches
        contexts = [16, 40] if args.contexts == p.get_default("contexts") else contexts
        e2e_batches = [2] if args.e2e_batches == p.get_default("e2e_batches") else e2e_batches
        args.new_tokens, args.check_tokens = min(args.new_tokens, 6), min(args.check_tokens, 5)
        args.e2e_prompt, args.e2e_new_tokens = min(args.e2e_prompt, 24), min(args.e2e_new_tokens, 6)
        args.e2e_n_batches = min(args.e2e_n_batches, 2)
        if args.e2e_generation == "auto":  # on CPU auto means HF generate: run the loop's plumbing instead
            args.e2e_generation, e2e_steps = "loop", "static"
    dtype = torch.bfloat16 if cuda else torch.float32
    steps = "graph" if cuda else "static"
    backend = args.backend if cuda else "reference"
    out = Path(args.out)
    recorded = environment()
    total_mem = torch.cuda.get_device_properties(0).total_memory if cuda else None
    env = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "git_commit": recorded.get("git_commit"), "dtype": str(dtype).replace("torch.", ""),
           "new_tokens": args.new_tokens, "backend": backend, "steps": steps, "smoke": args.smoke,
           "split_clock": "cuda events" if cuda else "cpu perf_counter", "vocab": args.vocab,
           "memory_gib": total_mem / 2**30 if total_mem else None, "mem_frac": args.mem_frac,
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "environment": recorded}
    if args.e2e_lmeval:
        env["e2e"] = {"prompt": args.e2e_prompt, "new_tokens": args.e2e_new_tokens, "n_batches": args.e2e_n_batches,
                      "generation": args.e2e_generation, "until": list(GSM8K_UNTIL)}
    old = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    rows: list[dict] = [_clean(r) for r in old.get("rows", [])] if not args.smoke else []
    checks: list[dict] = list(old.get("checks", [])) if not args.smoke else []

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    def emit(row: dict) -> None:
        nonlocal rows
        rows = _merge(rows, [row])
        shown = {k: v for k, v in row.items() if not k.endswith("_samples") and k != "kernels"}  # JSON only
        print(f"[{time.perf_counter() - start:6.0f}s] {json.dumps(shown)}", flush=True)
        write_outputs(out, rows, checks, env)

    for shape in models:
        layers = None
        if shape == "v3":
            free = torch.cuda.mem_get_info()[0] if cuda else 0
            layers = v3_layers_that_fit(free, args.vocab) if args.v3_layers == "auto" else int(args.v3_layers)
        t = time.perf_counter()
        model = build_model(shape, layers, dtype, device, args.vocab if shape != "tiny" else 99)
        n_layers = model.config.num_hidden_layers
        weights = sum(x.numel() * x.element_size() for x in model.parameters())
        print(f"[{time.perf_counter() - start:6.0f}s] built {shape}: {n_layers} layers, {weights / 2**30:.1f} GiB "
              f"in {time.perf_counter() - t:.0f}s", flush=True)
        base = {"model": shape, "layers": n_layers, "weights_gib": weights / 2**30}
        tokenizer = synthetic_tokenizer(model.config.vocab_size, args.refill) if args.e2e_lmeval else None
        e2e_paths = [(f"{E2E_PATH}/stop{args.refill}", False), (f"{E2E_PATH}/stop{args.refill}+refill", True)] \
            if args.refill else [(E2E_PATH, False)]
        for preset in presets:
            bpt = _bytes_per_token(preset, model)
            for B, (e2e_path, refill) in ((B, x) for B in e2e_batches for x in e2e_paths) if args.e2e_lmeval else ():
                row = {**base, "preset": preset, "batch": B, "context": args.e2e_prompt, "path": e2e_path,
                       "new_tokens": args.e2e_new_tokens}
                need = weights + bpt * B * (args.e2e_prompt + args.e2e_new_tokens) * n_layers
                estimate = _estimate_s(cuda, "e2e", B, args.e2e_prompt, args.e2e_new_tokens, args.e2e_n_batches)
                if total_mem is not None and need > args.mem_frac * total_mem:
                    row["status"] = f"skip: memory ({need / 2**30:.0f} GiB)"
                elif estimate > left():
                    row["status"] = f"skip: budget (~{estimate:.0f}s > {max(left(), 0):.0f}s left)"
                else:
                    row.update(_measure_e2e(model, tokenizer, preset, B, args, backend, e2e_steps, cuda, refill))
                snapquant.unpatch(model)  # SnapquantLM patched it
                emit(row)
            snapquant.patch(model, preset, backend=backend)
            experts = plan_decode_experts(model).implementation
            if args.check_tokens and paths and _estimate_s(cuda, "hf", batches[0], contexts[0], args.check_tokens) \
                    + _estimate_s(cuda, "loop", batches[0], contexts[0], args.check_tokens) < left():
                try:
                    c = check_paths(model, preset, batches[0], contexts[0], args.check_tokens, steps)
                    c["model"] = shape
                    checks = [x for x in checks if (x.get("model"), x["preset"]) != (shape, preset)] + [c]
                    print(f"[{time.perf_counter() - start:6.0f}s] check {shape} {preset}: {json.dumps(c)}", flush=True)
                except Exception as e:  # keep going: the timings are still worth having
                    print(f"check {shape} {preset} failed: {type(e).__name__}: {e}", flush=True)
            for B in batches if paths else ():
                for L in contexts:
                    for path in paths:
                        row = {**base, "preset": preset, "batch": B, "context": L, "path": path,
                               "new_tokens": args.new_tokens, "experts": experts if path == "loop"
                               else "batched_mm (HF decode)" if cuda else experts_implementation(model)}
                        need = weights + bpt * B * (L + args.new_tokens) * n_layers
                        estimate = _estimate_s(cuda, path, B, L, args.new_tokens)
                        if total_mem is not None and need > args.mem_frac * total_mem:
                            row["status"] = f"skip: memory ({need / 2**30:.0f} GiB)"
                        elif estimate > left():
                            row["status"] = f"skip: budget (~{estimate:.0f}s > {max(left(), 0):.0f}s left)"
                        else:
                            row.update(_measure(model, preset, B, L, path, args, steps, cuda))
                        emit(row)
            snapquant.unpatch(model)
        del model
        if cuda:
            torch.cuda.empty_cache()
    write_outputs(out, rows, checks, env)
    print(f"wrote {out.with_suffix('.md')} in {time.perf_counter() - start:.0f}s", flush=True)
    return 0


def _estimate_s(cuda: bool, kind: str, batch: int, context: int, new_tokens: int, n_batches: int = 1) -> float:
    """A rough upper estimate of a cell's seconds on an H200 (V2-Lite shape), from the measured step times
    (loop ~20-27 ms, HF generate ~200-400 ms) and a prefill of ~50K tokens/s; 0 on CPU (smoke runs)."""
    if not cuda:
        return 0.0
    if kind == "e2e":
        return 15.0 + n_batches * (new_tokens * 0.03 + batch * context / 50_000 + 1.0)
    if kind == "hf":
        return 5.0 + new_tokens * (0.25 + batch * 0.0015)
    return 12.0 + new_tokens * 0.03 + batch * context * 4e-7  # loop: fill, capture, eager split


def _bytes_per_token(preset: str, model) -> float:
    """Cache bytes per token per MLA layer for `preset` (from the config alone)."""
    from ..models.registry import find_mla_modules
    from ..presets import resolve_config
    from ..quant.layout import bytes_per_token

    _, module, adapter = next(iter(find_mla_modules(model)))
    r, d = adapter.dims(module)
    return float(bytes_per_token(resolve_config(preset), r, d))


def _measure(model, preset: str, B: int, L: int, path: str, args, steps: str, cuda: bool) -> dict[str, Any]:
    try:
        res = run_cell(model, preset, B, L, path, args.new_tokens, steps)
        row = {"tokens_per_s": res["tokens_per_s"], "step_ms": res["step_s"] * 1e3, "prefill_s": res["prefill_s"],
               "capture_s": res["capture_s"], "peak_gib": res["peak_gib"], "cache_gib": res["cache_gib"],
               "status": "ok", "step_fusions": res.get("step_fusions")}
        if res.get("step_ms_samples"):  # each decode step (JSON only): the intervals of the ratios to bf16
            row["step_ms_samples"] = res["step_ms_samples"]
        del res
        if path == "loop" and args.kernels:
            try:
                row["kernels"] = step_and_prefill_kernels(model, preset, B, L, prompt=args.e2e_prompt)
            except Exception as e:  # the throughput above stands without it
                row["kernels"] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                traceback.print_exc()
        if path == "loop" and not args.no_split:
            try:
                row.update(eager_step_split(model, preset, B, L))
            except Exception as e:  # the throughput above stands without its split
                row["split_clock"] = f"error: {type(e).__name__}: {str(e)[:80]}"
                traceback.print_exc()
        return row
    except torch.cuda.OutOfMemoryError as e:
        return {"status": f"oom: {str(e)[:80]}"}
    finally:
        if cuda:
            torch.cuda.empty_cache()


def _measure_e2e(model, tokenizer, preset: str, B: int, args, backend: str, gen_steps: str, cuda: bool,
                 refill: bool = False) -> dict[str, Any]:
    try:
        res = run_e2e(model, tokenizer, preset, B, args.e2e_n_batches, args.e2e_prompt, args.e2e_new_tokens,
                      backend, args.e2e_generation, gen_steps, refill)
        return {**res, "status": "ok"}
    except ImportError as e:  # lm-eval (or datasets) missing: the decode cells still run
        return {"status": f"skip: {type(e).__name__}: {str(e)[:80]}"}
    except torch.cuda.OutOfMemoryError as e:
        return {"status": f"oom: {str(e)[:80]}"}
    except Exception as e:  # one device call measures many cells: record this one's failure, go on
        traceback.print_exc()
        return {"status": f"error: {type(e).__name__}: {str(e)[:80]}"}
    finally:
        if cuda:
            torch.cuda.empty_cache()
