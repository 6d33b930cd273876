"""A queue of generation requests over a fixed number of slots, with finished slots refilled.

    res = run_queue(loop, prompts, slots=32, max_new_tokens=256, plan=plan, stop=["\\n\\n"], refill="auto")
    res.tokens[i]          request i's generated tokens, to its own stop (the order of `prompts`)
    res.stats              decode steps, slot-steps, useful slot-steps (utilisation), refills, seconds

The first `slots` requests are prefilled together (left padded) into one preallocated LatentCache; then
fixed-shape decode steps (`DecodeLoop`'s 'static' or 'graph' steps) run every slot. Each request stops on its
own (lm-eval's rule for one row: a stop string in its last len(encode(s)) + 2 tokens, EOS, max tokens), found
on the host every `check_every` steps, as `DecodeLoop.generate` checks a batch. A slot whose request stopped
is then, if `refill` says so, given the next waiting request: a batch-1 prefill into a scratch cache, its
rows copied into that slot (`LatentLayer.load_request`; every other slot keeps its cache) and the slot's
length set in place, so the captured step (positions from the lengths) runs on with no re-capture. A slot
with nothing to do is emptied (length 0) so that its garbage tokens never outgrow the cache. Without refill
the slots run until every request of the batch has stopped, then the next `slots` requests are prefilled
(a partial last batch repeats its last request in the spare slots).

Each request's tokens are the ones it gets alone (batch 1), up to fp32 reassociation between batch shapes:
the refilled and the batched prefill store the same latents, and every step reads only the slot's rows.
Unlike `DecodeLoop.generate` it does not reproduce HF's batch rule (HF keeps a stopped row generating until
the whole batch stops), which lm-eval's post-processing cuts at the stop string anyway.

`refill="auto"` refills a slot when a request is waiting and its batch-1 prefill costs less than the idle
slot-steps it removes: the slot would otherwise idle until the batch's longest request ends, estimated as
the longest finished request so far (max_new_tokens before any has finished) minus what the slot's
batch-mates have generated; one slot-step costs step time / slots. Both times are measured as it runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from .generation import DecodeLoop, DecodingPlan, StopRule

REFILL_MODES = (True, False, "auto")


@dataclass
class QueueResult:
    tokens: list[list[int]]  # per request, in the order of the prompts, to its own stop
    stats: dict[str, Any] = field(default_factory=dict)


def refill_reason(loop: DecodeLoop) -> str | None:
    """Why finished slots cannot be refilled with this loop; None when they can."""
    if loop.steps == "eager":
        return "steps='eager' decodes with HF's growing mask; refill needs the fixed-shape step"
    cfg = loop.state.config
    if cfg.token_group is not None:
        return f"token_group={cfg.token_group}: KIVI groups are not per-token rows"
    if cfg.is_identity:
        return None
    from ..attention.store_policies import PassThrough, RowScales, part_policy

    for part in ("nope", "rope"):
        policy = part_policy(cfg, part, 64, None)
        if not isinstance(policy, (PassThrough, RowScales)):
            return (f"{part} scales are {cfg.part_granularity(part)}: a scale shared across tokens (or frozen at "
                    f"the batch's prefill) cannot take one request's rows")
    return None


class _Slots:
    """Host view of what each slot holds: request, StopRule, tokens, and its length in the cache."""

    def __init__(self, B: int) -> None:
        self.req: list[int | None] = [None] * B
        self.rule: list[StopRule | None] = [None] * B
        self.tokens: list[list[int]] = [[] for _ in range(B)]
        self.start = [0] * B  # first global step column that belongs to the slot's request
        self.base = [0] * B  # stored tokens at step `base_step`
        self.base_step = [0] * B

    def lengths(self, steps: int) -> list[int]:
        return [b + steps - s for b, s in zip(self.base, self.base_step, strict=True)]

    def active(self) -> list[int]:
        return [s for s, r in enumerate(self.req) if r is not None]


def _pad_left(rows: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad, dtype=torch.long)
    am = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
        am[i, P - len(r):] = 1
    return ids.to(device), am.to(device)


@torch.no_grad()
def run_queue(loop: DecodeLoop, prompts: Sequence[Sequence[int]], *, slots: int, max_new_tokens: int,
              plan: DecodingPlan, stop: Sequence[str] = (), refill: bool | str = "auto",
              pad_token_id: int = 0) -> QueueResult:
    """Generate for every prompt (token ids, no padding) through `slots` fixed slots; see the module doc."""
    from ..cache import LatentCache
    from ..graphs import DecodeGraph

    if refill not in REFILL_MODES:
        raise ConfigError(f"refill must be True, False or 'auto', got {refill!r}")
    reason = refill_reason(loop)
    if refill is True and reason is not None:
        raise ConfigError(f"refill=True: {reason}")
    if loop.steps == "eager":
        raise ConfigError("run_queue needs the fixed-shape step (steps='static' or 'graph')")
    if max_new_tokens < 1 or slots < 1 or not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("run_queue needs slots >= 1, max_new_tokens >= 1 and non-empty prompts")
    refilling = refill is not False and reason is None
    k, dev, N = loop.check_every, loop.device, len(prompts)
    B = min(slots, N)
    need = max(len(p) for p in prompts) + max_new_tokens + 2 * k  # a stop is seen up to 2k - 1 steps late
    out: list[list[int] | None] = [None] * N
    queue = deque(range(N))
    st = _Slots(B)
    stats = {"requests": N, "slots": B, "decode_steps": 0, "refills": 0, "batches": 0, "prefill_s": 0.0,
             "refill_s": 0.0, "wall_s": 0.0}
    step_s, token_s = None, None  # measured: seconds per decode step, per prefilled token
    longest = 0  # the longest request that has stopped so far (tokens)
    steps = 0  # decode steps dispatched
    t_start = time.perf_counter()

    def select(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return loop.select(logits, plan, ids)

    def finish(s: int, n: int) -> None:
        nonlocal longest
        out[st.req[s]] = st.tokens[s][:n]
        longest = max(longest, n)
        st.req[s] = st.rule[s] = None

    def start(s: int, r: int, first: int) -> None:
        st.req[s], st.tokens[s], st.start[s] = r, [first], steps + 1
        st.rule[s] = StopRule(loop.tokenizer, stop, 1, max_new_tokens, plan.eos_token_ids)
        if st.rule[s].feed([[first]]) is not None:  # stopped at its first token
            finish(s, 1)

    with loop.step_modules():
        cache, graph = loop.acquire_cache(B, need)

        def prefill_batch() -> torch.Tensor:
            """The next `B` waiting requests (the last one repeated if fewer), prefilled together."""
            nonlocal token_s
            take = [queue.popleft() for _ in range(min(B, len(queue)))]
            rows = [prompts[r] for r in take] + [prompts[take[-1]]] * (B - len(take))
            ids, am = _pad_left(rows, pad_token_id, dev)
            for layer in cache.latent_layers:
                if layer.store is not None:
                    layer.crop(max_length=0)
            t0 = time.perf_counter()
            pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 0)
            logits = loop.model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True,
                                **loop.forward_kwargs(cache)).logits
            tok = select(logits, ids)
            firsts = tok.tolist()
            dt = time.perf_counter() - t0
            stats["prefill_s"] += dt
            stats["batches"] += 1
            token_s = dt / int(am.sum())
            for s in range(B):
                st.base[s], st.base_step[s] = len(rows[s]), steps
                st.req[s] = None
                if s < len(take):
                    start(s, take[s], firsts[s])
            return tok

        def refill_slot(s: int) -> int:
            """Prefill the next waiting request alone and load it into slot s; its first token."""
            nonlocal token_s
            r = queue.popleft()
            _sync(dev)  # the steps already queued are not this prefill's time
            t0 = time.perf_counter()
            ids = torch.tensor([list(prompts[r])], dtype=torch.long, device=dev)
            scratch = LatentCache(cache.kv_config, loop.model, joint_rows=cache.joint_rows)
            logits = loop.model(input_ids=ids, use_cache=True, **loop.forward_kwargs(scratch)).logits
            first = int(select(logits, ids))
            for dst, src in zip(cache.latent_layers, scratch.latent_layers, strict=True):
                dst.load_request(s, src, ids.shape[1])
            dt = time.perf_counter() - t0
            stats["refill_s"] += dt
            stats["refills"] += 1
            token_s = dt / ids.shape[1]
            st.base[s], st.base_step[s] = ids.shape[1], steps
            start(s, r, first)
            return first

        def pays(s: int) -> bool:
            live = st.active()
            if refill is True or not live:
                return True  # with no request running, waiting is pure idle time
            if step_s is None or token_s is None:
                return True  # nothing measured yet: the first chunk has not run
            done = min(len(st.tokens[a]) for a in live)  # the batch-mate furthest from its end
            horizon = longest or max_new_tokens
            idle = max(horizon - done, k)  # the slot idles at least until the next check
            return token_s * len(prompts[queue[0]]) < idle * step_s / B

        tok = prefill_batch()
        if graph is None:
            graph = DecodeGraph(loop.model, cache, capture=loop.steps == "graph")
            loop.captures += int(loop.steps == "graph")
        cols: list[torch.Tensor] = [tok]
        col0 = 0  # global column of cols[0]; column c holds the tokens of step c (0: the prefill's)
        pending = None  # (host [B, n], first column, event): copied, not yet read
        t_chunk = time.perf_counter()
        while True:
            if len(cols) >= k:
                host = torch.empty((B, len(cols)), dtype=torch.long, pin_memory=dev.type == "cuda")
                host.copy_(torch.stack(cols, 1), non_blocking=dev.type == "cuda")
                event = torch.cuda.Event() if dev.type == "cuda" else None
                if event is not None:
                    event.record()
                if pending is not None:
                    _read(pending, st, finish)
                pending, col0, cols = (host, col0, event), col0 + len(cols), []
                step_s = (time.perf_counter() - t_chunk) / k
                if not st.active() and not queue:
                    break  # every request has stopped (the pending chunk only holds garbage)
                changed = False
                if not refilling and not st.active():  # the batch is done: prefill the next one
                    _read(pending, st, finish)
                    pending = None
                    tok = prefill_batch()
                    cols, col0 = [tok], steps
                elif refilling and queue:
                    tok = tok.clone()  # the queued steps read the old one
                    for s in range(B):
                        while st.req[s] is None and queue and pays(s):
                            tok[s] = refill_slot(s)
                            changed = True
                for s in range(B):  # empty idle slots, so that their garbage never outgrows the cache
                    if st.req[s] is None and st.lengths(steps)[s] > 2 * k:
                        for layer in cache.latent_layers:
                            layer.load_request(s, None, 0)
                        st.base[s], st.base_step[s] = 0, steps
                        changed = True
                if changed:
                    lengths = st.lengths(steps)
                    for layer in cache.latent_layers:
                        layer.set_lengths(lengths)
                t_chunk = time.perf_counter()  # the next step time excludes this check's prefills
            tok = select(graph.step(tok.view(-1, 1)), tok)
            steps += 1
            cols.append(tok)
        _sync(dev)
    loop.keep_cache(B, cache, graph)
    stats["decode_steps"] = steps
    stats["slot_steps"] = steps * B
    stats["useful_slot_steps"] = sum(len(t) - 1 for t in out)
    stats["utilisation"] = stats["useful_slot_steps"] / max(stats["slot_steps"], 1)
    stats["wall_s"] = time.perf_counter() - t_start
    return QueueResult([list(t) for t in out], stats)


def _read(pending, st: _Slots, finish) -> None:
    """Feed each live slot's tokens of a copied chunk (columns from its request's start) to its rule."""
    host, col0, event = pending
    if event is not None:
        event.synchronize()
    rows = host.tolist()
    for s, r in enumerate(st.req):
        if r is None:
            continue
        skip = max(st.start[s] - col0, 0)
        new = rows[s][skip:]
        if not new:
            continue
        st.tokens[s].extend(new)
        n = st.rule[s].feed([new])
        if n is not None:
            finish(s, n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def simulate_steps(lengths: Sequence[int], slots: int, check_every: int, refill: bool) -> dict[str, Any]:
    """The decode steps `run_queue` runs for requests of these token counts (in queue order), with refill on
    or off, from its schedule alone (host checks every `check_every` steps, a stop seen one check late, a
    refill or the next batch at that check): what a workload's length distribution costs on any model."""
    B, k = min(slots, len(lengths)), check_every
    queue = deque(lengths)
    ends: list[int | None] = [None] * B  # the column of each slot's last token (None: idle)
    steps, since = 0, 1  # steps dispatched; columns since the last copy (the prefill's first)

    def begin(s: int) -> None:
        n = queue.popleft()
        ends[s] = None if n == 1 else steps + n - 1  # token 0 comes from the prefill, at column `steps`

    for s in range(B):
        begin(s)
    read_to = -1  # columns the host has read
    copied_to = -1
    while True:
        if since >= k:
            read_to, copied_to, since = copied_to, steps, 0
            ends = [None if e is not None and e <= read_to else e for e in ends]
            live = [e for e in ends if e is not None]
            if not live and not queue:
                break
            if not refill and not live:
                read_to = copied_to
                for s in range(B):
                    if queue:
                        begin(s)
                since = 1
            elif refill:
                for s in range(B):
                    while ends[s] is None and queue:
                        begin(s)
        steps += 1
        since += 1
    useful = sum(n - 1 for n in lengths)
    return {"decode_steps": steps, "slot_steps": steps * B, "useful_slot_steps": useful,
            "utilisation": useful / max(steps * B, 1)}
