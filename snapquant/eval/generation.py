"""Batched generation for lm-eval requests: one preallocated `LatentCache` per batch, an eager prefill, then
fixed-shape decode steps (a CUDA graph on GPUs) with the stopping rules checked on the host, off the critical path.

    loop = DecodeLoop(model, tokenizer)                     # model patched with snapquant.patch
    plan = decoding_plan(model, {"do_sample": False})       # or the reason the loop cannot reproduce HF
    out = loop.generate(ids, attention_mask, max_length=ids.shape[1] + 256, stop=["\\n\\n", "</s>"], plan=plan)
    out.sequences                                           # what model.generate returns to lm-eval

The output is HF `generate`'s, token for token, under lm-eval's stopping criteria (`MultiTokenEOSCriteria`
per stop string: the batch stops once every row's last len(encode(s)) + 2 generated tokens decoded
have contained the string s at some step, for one s) and HF's own (a row that emits an EOS id is
padded from then on; the batch stops when every row has, or at max_length). The loop evaluates those
rules for every step exactly as HF does, but on the host, every `check_every` steps, on tokens copied
while the device already runs the next steps; the few steps it runs past HF's stop are dropped. So
lm-eval's post-processing (decode, split at the stop strings) sees the same tokens and gives the same
strings. Numerically the steps are HF's own forward calls in `steps="eager"` (bit-identical on CPU);
`steps="static"` / `"graph"` run `snapquant.graphs.DecodeGraph` (positions from the cache lengths,
no mask), and on GPUs the experts through `snapquant.models.experts` (HF generate switches them to
per-token weight gathers for decode), so there the logits differ from HF's by bf16 rounding.

Token selection is HF's: fp32 logits through HF's own logits processors for the merged generation config
(greedy: none; sampling: temperature / top-k / top-p / min-p warpers), argmax or `torch.multinomial`
on the global RNG, one draw per step as HF makes, so a seeded run repeats and, on CPU, draws HF's tokens.
`decoding_plan` returns the reason instead where HF would do more (beam search, repetition penalty,
min length, ...); the caller then uses HF generate.

Batches are whatever the caller passes (lm-eval's Collator sorts a task's requests by length and cuts
them into batch_size rows). The cache and the captured graph are kept and reused by the next batch of
the same size that fits (cropped to zero, prefilled again); configs whose scales freeze at the prefill
get a fresh cache per batch. Finished rows keep their slot until the batch stops (HF's rule). To refill
finished slots with waiting requests instead, `snapquant.eval.refill.run_queue(loop, prompts, ...)` takes a
whole queue (each request then stops on its own; docs/performance.md, "lm-eval generation").
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import LatentCache
from ..errors import ConfigError, ShapeError
from ..models.norms import plan_fused_norms
from ..models.step_kernels import step_kernels
from ..models.stepping import cache_kwarg
from ..patching import patch_state

STEP_MODES = ("auto", "graph", "static", "eager")
# HF logits processors that read only the scores (no history, no host values): safe between graph replays.
SAFE_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")


# ---------------------------------------------------------------------------------------------- plan
@dataclass
class DecodingPlan:
    """How HF generate would pick tokens for a request's gen_kwargs (None fields: not applicable)."""

    do_sample: bool
    processors: Any  # HF LogitsProcessorList (empty for greedy)
    eos_token_ids: list[int]
    description: str


def decoding_plan(model: Any, gen_kwargs: dict[str, Any], input_len: int = 1) -> DecodingPlan | str:
    """The token selection HF `generate` would run for `gen_kwargs` (merged with the model's generation
    config as HF merges them), or a one-line reason why the loop cannot reproduce it."""
    kw = {k: v for k, v in gen_kwargs.items() if k not in ("max_length", "max_new_tokens", "use_cache",
                                                            "pad_token_id")}
    try:
        gc, extra = model._prepare_generation_config(None, **kw)
        device = next(model.parameters()).device
        gc._eos_token_tensor = None if gc.eos_token_id is None else torch.as_tensor(gc.eos_token_id, device=device)
        procs = model._get_logits_processor(gc, input_ids_seq_length=input_len, device=device)
    except (AttributeError, TypeError) as e:  # private HF API moved: be safe, use HF generate
        return f"this transformers has no usable _prepare_generation_config/_get_logits_processor ({e})"
    if extra:
        return f"generation kwargs {sorted(extra)} are model inputs the decode loop does not pass"
    if (gc.num_beams or 1) != 1 or (gc.num_return_sequences or 1) != 1:
        return f"num_beams={gc.num_beams}, num_return_sequences={gc.num_return_sequences}: only one greedy or " \
               f"sampled sequence per request"
    for attr in ("assistant_model", "prompt_lookup_num_tokens", "stop_strings", "max_time"):
        if getattr(gc, attr, None):
            return f"generation config {attr}={getattr(gc, attr)!r} is not supported by the decode loop"
    if getattr(gc, "min_new_tokens", None) or (getattr(gc, "min_length", 0) or 0) > 0:
        return f"min_length={gc.min_length}, min_new_tokens={gc.min_new_tokens} is not supported by the decode loop"
    names = [type(p).__name__ for p in procs]
    bad = [n for n in names if n not in SAFE_WARPERS]
    if bad:
        return f"logits processors {bad} (from the generation config) are not supported by the decode loop"
    eos = gc.eos_token_id
    eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else
                                                    torch.as_tensor(eos).flatten().tolist())]
    desc = ("sample " + ", ".join(names)) if gc.do_sample else "greedy"
    return DecodingPlan(bool(gc.do_sample), procs, eos, desc)


def graph_reason(model: Any) -> str | None:
    """Why the captured decode step (`snapquant.graphs.DecodeGraph`) cannot run this patched model on its
    device; None when it can. Checked before any batch, so a refused model goes to HF generate at once."""
    from ..attention.backends import resolve_backend
    from ..cache import LatentLayer
    from ..graphs import DecodeGraph

    state = patch_state(model)
    if state is None:
        return "the model is not patched with snapquant.patch"
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"the model is on {device.type}; CUDA graphs need CUDA"
    cfg = state.config
    if cfg.token_group is not None:
        return f"token_group={cfg.token_group}: the KIVI residual window is not a fixed-shape store"
    try:
        DecodeGraph.check_model(model)
        backend = resolve_backend(state.backend, cfg, device)
    except ConfigError as e:
        return str(e)
    if backend.name != "triton":
        return f"backend={state.backend!r} runs {backend.name!r} for {cfg.label()!r}; capture needs the Triton kernels"
    kinds = {type(layer).__name__ for layer in LatentCache(cfg, model).layers if not isinstance(layer, LatentLayer)}
    if kinds:
        return f"cache layers {sorted(kinds)} are not MLA latent layers (hybrid attention)"
    return None


# ---------------------------------------------------------------------------------------------- stopping
class StopRule:
    """HF's stopping decision for one batch, step by step, from the generated tokens on the host.

    Per stop string (lm-eval's MultiTokenEOSCriteria): window = len(encode(s)) + 2 tokens; at each step
    every row not yet marked decodes its last `window` generated tokens (special tokens kept, as
    `batch_decode` does) and is marked if s appears; the batch stops when one string has marked every
    row. EOS (HF): a row that emitted an EOS id is finished; the batch stops when every row is. And at
    `max_new_tokens`.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], batch: int, max_new_tokens: int,
                 eos_token_ids: Sequence[int]) -> None:
        if stop and tokenizer is None:
            raise ConfigError("tokenizer: stop strings need the tokenizer that decodes the generated tokens")
        self.tokenizer = tokenizer
        self.terms = [(s, len(tokenizer.encode(s, add_special_tokens=False)) + 2) for s in stop]
        self.marked = [[False] * batch for _ in self.terms]
        self.eos = set(int(e) for e in eos_token_ids)
        self.finished = [False] * batch
        self.max_new = max_new_tokens
        self.tokens: list[list[int]] = [[] for _ in range(batch)]

    def feed(self, chunk: list[list[int]]) -> int | None:
        """Add the next generated tokens (`[B][n]`); the number of generated tokens at which HF stops, if
        it stops within them."""
        n = len(chunk[0]) if chunk else 0
        start = len(self.tokens[0])
        for row, new in zip(self.tokens, chunk, strict=True):
            row.extend(new)
        for t in range(start + 1, start + n + 1):
            if self._stops_at(t):
                return t
        return None

    def _stops_at(self, t: int) -> bool:
        for b, row in enumerate(self.tokens):
            if row[t - 1] in self.eos:
                self.finished[b] = True
        stop = all(self.finished) if self.eos else False
        for (s, window), marked in zip(self.terms, self.marked, strict=True):
            rows = [b for b, m in enumerate(marked) if not m]
            if rows:
                texts = self.tokenizer.batch_decode([self.tokens[b][max(0, t - window):t] for b in rows])
                for b, text in zip(rows, texts, strict=True):
                    marked[b] = s in text
            stop = stop or all(marked)
        return stop or t >= self.max_new


# ---------------------------------------------------------------------------------------------- the loop
def stream_timestamp(cuda: bool) -> Any:
    """A timestamp in stream order: a recorded CUDA event (no host sync) or `time.perf_counter()`."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _intervals(marks: list) -> list[float]:
    """Seconds between consecutive marks (call after the stream is synchronized)."""
    if marks and not isinstance(marks[0], float):
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
    return [b - a for a, b in itertools.pairwise(marks)]


@dataclass
class GenerationResult:
    """`sequences [B, P + T]`: the prompt, then what HF generate returns after it (pad after an EOS)."""

    sequences: torch.Tensor
    new_tokens: int  # T
    steps: int  # decode steps run (T - 1 plus the overshoot past HF's stop)
    seconds: dict[str, float] = field(default_factory=dict)
    logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [B, V] of the first `keep_logits` selections
    step_seconds: list[float] = field(default_factory=list)  # each decode step's time (loops with time_steps=True)


class DecodeLoop:
    """Batched greedy / sampled generation of a patched model through a preallocated LatentCache.

    `steps`: 'graph' (DecodeGraph captured as a CUDA graph), 'static' (the same fixed-shape step run
    eagerly: what the graph records, testable on CPU), 'eager' (HF's own forward calls with the growing
    attention mask), 'auto' = graph on CUDA, eager elsewhere. `check_every`: steps between two host
    checks of the stopping rules (each check may let the device run up to `2 * check_every - 1` steps
    past HF's stop, all discarded). `experts`: the MoE experts implementation for the fixed-shape steps
    ('auto': `snapquant.models.experts.plan_decode_experts`; None keeps the model's; eager steps always
    keep the model's, as HF generate on CPU does). `time_steps`: time every decode step (a CUDA event after
    each on the stream, no host sync; `perf_counter` on CPU) into `GenerationResult.step_seconds`, for
    benchmarks that compare step times with an interval. `fused_norms`: run the model's T5-style RMSNorms
    through one Triton kernel each while the loop runs (`snapquant.models.norms`; 'auto' = on CUDA with
    fixed-shape steps, whose outputs already differ from HF generate's by bf16 rounding; True / False), and
    with them DeepSeek-V2's rotary embedding where its kernel gives torch's bits (`snapquant.models.rotary`;
    `rotary_mode` says which contraction matched, None: not switched).
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, steps: str = "auto", check_every: int = 16,
                 experts: str | None = "auto", time_steps: bool = False,
                 fused_norms: bool | str = "auto") -> None:
        state = patch_state(model)
        if state is None:
            raise ConfigError("model: the decode loop needs a model patched with snapquant.patch(model, preset)")
        if steps not in STEP_MODES:
            raise ConfigError(f"steps must be one of {', '.join(STEP_MODES)}, got {steps!r}")
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ConfigError(f"check_every must be a positive int, got {check_every!r}")
        self.model, self.tokenizer, self.state = model, tokenizer, state
        self.device = next(model.parameters()).device
        if steps == "auto":
            steps = "graph" if self.device.type == "cuda" else "eager"
        if steps == "graph" and self.device.type != "cuda":
            raise ConfigError(f"steps='graph' needs the model on CUDA (it is on {self.device}); use 'static' or 'eager'")
        self.steps, self.check_every, self.time_steps = steps, check_every, bool(time_steps)
        self.experts = experts if steps != "eager" else None
        self.fused_norms, self.norms_reason = plan_fused_norms(self.device, steps, fused_norms)
        self.rotary_mode: tuple[int, int] | None = None  # set while step_modules runs
        self._cache_kw = cache_kwarg(model)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._slot: tuple | None = None  # (batch, capacity, cache, graph) kept for the next batch
        self.captures = 0  # CUDA graphs captured so far (one per batch size / capacity)

    @contextmanager
    def step_modules(self) -> Iterator[None]:
        """The model's modules as the loop runs them (`models.step_kernels`: sync-free experts, fused norms and
        rotary), restored after."""
        with step_kernels(self.model, experts=self.experts, fused=self.fused_norms) as info:
            self.rotary_mode = info["rotary_mode"]
            yield

    # ------------------------------------------------------------------ cache and graph
    def _cache(self, batch: int, need: int) -> tuple[LatentCache, Any]:
        if self._slot is not None:
            b, cap, cache, graph = self._slot
            if b == batch and cap >= need:
                for layer in cache.latent_layers:
                    layer.crop(max_length=0)
                return cache, graph
            self._slot = None  # free it before allocating the next one
        cap = need if self.steps == "eager" else -(-need // 256) * 256  # round: fewer captures over a task
        return LatentCache(self.state.config, self.model, max_cache_len=cap), None

    def _keep(self, batch: int, cache: LatentCache, graph: Any) -> None:
        from ..cache import LatentLayer

        if not all(isinstance(layer, LatentLayer) for layer in cache.layers):  # stock layers cannot crop to 0
            self._slot = None
            return
        frozen = any(part.frozen_scale() is not None for layer in cache.latent_layers if layer.store is not None
                     for part in layer.store.parts.values())
        self._slot = None if frozen else (batch, cache.max_cache_len, cache, graph)

    # the refill queue (snapquant.eval.refill) runs its own schedule over the same cache, graph and selection
    def acquire_cache(self, batch: int, need: int) -> tuple[LatentCache, Any]:
        """The kept (cache, graph) when they fit `batch` x `need` positions (cropped to 0), else a new cache."""
        return self._cache(batch, need)

    def keep_cache(self, batch: int, cache: LatentCache, graph: Any) -> None:
        """Keep the cache and graph for the next call (unless its scales froze at the prefill)."""
        self._keep(batch, cache, graph)

    def select(self, logits: torch.Tensor, plan: DecodingPlan, prompt: torch.Tensor) -> torch.Tensor:
        """HF's token selection from the last position's logits."""
        return self._select(logits, plan, prompt)

    def forward_kwargs(self, cache: LatentCache) -> dict[str, Any]:
        """The model's cache argument, and logits_to_keep=1 where the model takes it."""
        return {self._cache_kw: cache, **({"logits_to_keep": 1} if self._logits_to_keep else {})}

    def release(self) -> None:
        """Drop the kept cache and graph (their memory)."""
        self._slot = None

    # ------------------------------------------------------------------ token selection
    @staticmethod
    def _select(logits: torch.Tensor, plan: DecodingPlan, prompt: torch.Tensor) -> torch.Tensor:
        scores = logits[:, -1].to(dtype=torch.float32, copy=True)
        if len(plan.processors):
            scores = plan.processors(prompt, scores)  # whitelisted warpers read only the scores
        if plan.do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return torch.argmax(scores, dim=-1)

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, max_length: int,
                 plan: DecodingPlan, stop: Sequence[str] = (), pad_token_id: int | None = None,
                 cache: LatentCache | None = None, keep_logits: int = 0) -> GenerationResult:
        """Left-padded `input_ids [B, P]` -> HF generate's output for `max_length = P + max_new_tokens`.

        `cache`: a LatentCache (with max_cache_len for fixed-shape steps) that already holds the first
        `cache.get_seq_length()` positions of `input_ids` (HF's convention for continuing from a cache: only
        the rest is prefilled); benchmarks fill it with random latents instead of running long prefills.
        `keep_logits=n` keeps the fp32 logits of the first n token selections (`result.logits`)."""
        if input_ids.dim() != 2:
            raise ShapeError(f"input_ids must be [B, P], got {tuple(input_ids.shape)}")
        B, P = input_ids.shape
        max_new = int(max_length) - P
        if max_new < 1:
            raise ConfigError(f"max_length={max_length} leaves no room to generate after {P} prompt tokens")
        input_ids = input_ids.to(self.device)
        am = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device).long()
        pad = pad_token_id if pad_token_id is not None else (plan.eos_token_ids[0] if plan.eos_token_ids else 0)
        eos = torch.tensor(plan.eos_token_ids or [-1], device=self.device)
        rule = StopRule(self.tokenizer, stop, B, max_new, plan.eos_token_ids)
        times = {"prefill": 0.0, "decode": 0.0, "host_check": 0.0}
        t0 = time.perf_counter()
        with self.step_modules():
            own = cache is None
            past = 0 if own else cache.get_seq_length()
            if not own and not 0 < past < P:
                raise ShapeError(f"the given cache holds {past} positions; input_ids must extend it (P = {P})")
            if own:
                cache, graph = self._cache(B, P + max_new)
            else:
                graph = None
            pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 0)  # HF's prefill positions for left padding
            extra = {"logits_to_keep": 1} if self._logits_to_keep else {}
            out = self.model(input_ids=input_ids[:, past:], attention_mask=am, position_ids=pos[:, past:],
                             use_cache=True, **extra, **{self._cache_kw: cache})
            gen = torch.full((B, max_new), pad, dtype=torch.long, device=self.device)
            finished = torch.zeros(B, dtype=torch.bool, device=self.device)

            kept: list[torch.Tensor] = []

            def take(logits: torch.Tensor, t: int) -> torch.Tensor:
                nonlocal finished
                if len(kept) < keep_logits:
                    kept.append(logits[:, -1].float().clone())
                tok = self._select(logits, plan, input_ids)
                if plan.eos_token_ids:  # HF: finished rows get the pad token, then EOS marks finished
                    tok = torch.where(finished, torch.full_like(tok, pad), tok)
                    finished = finished | torch.isin(tok, eos)
                gen[:, t] = tok
                return tok

            tok = take(out.logits, 0)
            del out
            if self.steps != "eager" and graph is None and max_new > 1:
                from ..graphs import DecodeGraph

                c0 = time.perf_counter()
                graph = DecodeGraph(self.model, cache, capture=self.steps == "graph")
                self.captures += int(self.steps == "graph")
                times["capture"] = time.perf_counter() - c0
            self._sync()
            times["prefill"] = time.perf_counter() - t0 - times.get("capture", 0.0)
            t1 = time.perf_counter()
            marks: list = []
            stop_at, steps = self._decode(tok, take, graph, cache, am, pos[:, -1:], gen, rule, max_new, times, marks)
            self._sync()
            times["decode"] = time.perf_counter() - t1
            step_seconds = _intervals(marks)
        if own:
            self._keep(B, cache, graph)
        seq = torch.cat([input_ids, gen[:, :stop_at]], dim=1)
        return GenerationResult(seq, stop_at, steps, times, kept, step_seconds)

    def _decode(self, tok, take, graph, cache, am, last_pos, gen, rule: StopRule, max_new: int,
                times: dict, marks: list) -> tuple[int, int]:
        """Decode steps 1 .. max_new - 1; the host checks chunk c while the device runs chunk c + 1. With
        `time_steps`, `marks` gets a timestamp before the first step and after each (see `_intervals`)."""
        cuda = self.device.type == "cuda"
        mark = (lambda: marks.append(stream_timestamp(cuda))) if self.time_steps else (lambda: None)
        mark()
        pending = None  # (host buffer, event) of the last chunk copied, not yet checked
        checked = 0  # generated tokens handed to the host so far
        t = 1
        stop_at = None
        while True:
            if t - checked >= self.check_every or t == max_new:
                host = torch.empty((gen.shape[0], t - checked), dtype=torch.long, pin_memory=cuda)
                host.copy_(gen[:, checked:t], non_blocking=cuda)
                event = torch.cuda.Event() if cuda else None
                if event is not None:
                    event.record()
                if pending is not None:
                    stop_at = self._check(pending, rule, times)
                pending, checked = (host, event), t
                if stop_at is not None:
                    break
                if t == max_new:
                    stop_at = self._check(pending, rule, times)
                    break
            if graph is not None:
                logits = graph.step(tok.view(-1, 1))
            else:  # HF's decode call: the mask grows by one real position, positions by one
                am = torch.cat([am, am.new_ones(am.shape[0], 1)], dim=1)
                last_pos = last_pos + 1
                extra = {"logits_to_keep": 1} if self._logits_to_keep else {}
                logits = self.model(input_ids=tok.view(-1, 1), attention_mask=am, position_ids=last_pos,
                                    use_cache=True, **extra, **{self._cache_kw: cache}).logits
            tok = take(logits, t)
            mark()
            t += 1
        return (stop_at if stop_at is not None else max_new), t - 1

    @staticmethod
    def _check(pending, rule: StopRule, times: dict) -> int | None:
        host, event = pending
        if event is not None:
            event.synchronize()
        c0 = time.perf_counter()
        found = rule.feed(host.tolist())
        times["host_check"] += time.perf_counter() - c0
        return found

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
