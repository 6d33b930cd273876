"""The task suite scored directly with transformers (no lm-eval): same documents, same metrics.

The trainer uses this on the GPU machine, which has no lm-eval; `tests/test_tasks_lmeval.py`
checks that it agrees with the lm-eval tasks on the same model. Greedy decoding, left padding;
multiple choice by summed choice loglikelihoods (`choice_loglikelihoods`), as lm-eval's HFLM
(`through="forward"`), or read through the cache one decode step at a time as serving reads it
(`through="decode"`, `decode_loglikelihoods`: on a patched model the only path on which a
`prefill: bf16` preset's quantized cache can change a loglikelihood).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

import torch

from ...data.tokenizer import encode_text
from ...errors import ConfigError
from ...models.stepping import cache_kwarg, decode_step, output_cache
from . import sq_utils

# How a loglikelihood is computed: "forward" (lm-eval's HFLM: one forward pass over context + continuation,
# no cache) or "decode" (prefill the context into the cache, then one teacher-forced decode step per
# continuation token, each reading the cache in the patched preset's format).
LOGLIKELIHOOD_PATHS = ("forward", "decode")


def check_loglikelihood_path(name: str, value) -> str:
    if value not in LOGLIKELIHOOD_PATHS:
        raise ConfigError(f"{name} must be one of {', '.join(LOGLIKELIHOOD_PATHS)}, got {value!r}")
    return value


def _stop(text: str, stops: Sequence[str]) -> str:
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, stops: Sequence[str],
                    batch_size: int = 16) -> list[str]:
    """Greedy continuations of `prompts`, cut at the first stop string (as lm-eval's `until`)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Keep the last tokens that fit with the continuation, as lm-eval's HFLM does.
    keep = model.config.max_position_embeddings - max_new_tokens
    encoded = [encode_text(tokenizer, p)[-keep:] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))  # similar lengths per batch
    out: list[str] = [""] * len(prompts)
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            n = len(encoded[i])
            ids[r, width - n:] = torch.tensor(encoded[i])
            mask[r, width - n:] = 1
        # Stop strings end a row's generation early (as lm-eval's `until` does); the text up to the
        # first stop is the same, the batch just stops once every row has one.
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False, use_cache=True,
                             max_new_tokens=max_new_tokens, pad_token_id=pad,
                             eos_token_id=tokenizer.eos_token_id, stop_strings=list(stops) or None,
                             tokenizer=tokenizer)
        for r, i in enumerate(idx):
            text = tokenizer.decode(gen[r, width:].tolist(), skip_special_tokens=True)
            out[i] = _stop(text, stops)
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair` for causal models: trailing whitespace of the context moves to the
    continuation; the continuation's tokens are those of context + continuation after the context's."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode_text(tokenizer, context + continuation)
    ctx = encode_text(tokenizer, context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def choice_loglikelihoods(model, tokenizer, contexts: Sequence[str], choices: Sequence[Sequence[str]],
                          batch_size: int = 16, share_context: bool | None = None,
                          through: str = "forward") -> list[list[float]]:
    """Sum of the log-probabilities of each choice's tokens given its context (lm-eval's loglikelihood
    requests of a multiple_choice task, target_delimiter ""): one list per context, one value per choice.

    `through="decode"` reads the cache as serving does (`decode_loglikelihoods`: the context prefilled
    once, its choices teacher-forced one decode step at a time in batches of `batch_size`); on a patched
    model the decode steps read the quantized cache. `share_context` is the forward path's option
    (ConfigError with "decode"). The rest of this docstring is the forward path (the default).

    `share_context=False` is lm-eval's HFLM computation: one forward pass per (context, choice) over the
    context and the choice's tokens but the last, right-padded batches of `batch_size`, no cache, the
    sequence left-truncated to the model's positions. `share_context=True` runs each context once
    (a DynamicCache) and its choices as one batch on copies of that cache: the same numbers (up to
    float rounding) in about 1/len(choices) of the time where no truncation is needed (a context that
    would be truncated takes lm-eval's path). Unpatched models only: on a model patched with
    `snapquant.patch` the choices would read a quantized cache, which lm-eval's path never does (with
    `prefill: bf16` it scores what the unpatched model scores). None (default): shared on unpatched
    models, lm-eval's path on patched ones.
    """
    from ...patching import is_patched

    if len(contexts) != len(choices):
        raise ValueError(f"{len(contexts)} contexts but {len(choices)} choice lists")
    check_loglikelihood_path("through", through)
    if through == "decode":
        if share_context is not None:
            raise ConfigError("share_context applies to through='forward' only (decode always prefills each "
                              "context once)")
        pairs = [encode_pair(tokenizer, c, x) for c, xs in zip(contexts, choices, strict=True) for x in xs]
        flat = iter(decode_loglikelihoods(model, pairs, batch_size))
        return [[next(flat)[0] for _ in xs] for xs in choices]
    if share_context is None:
        share_context = not is_patched(model)
    elif share_context and is_patched(model):
        raise ConfigError("share_context=True: a patched model is scored on lm-eval's path only "
                          "(share_context=False or None)")
    device = next(model.parameters()).device
    max_len = model.config.max_position_embeddings
    pairs = [[encode_pair(tokenizer, c, x) for x in xs] for c, xs in zip(contexts, choices, strict=True)]
    out: list[list[float]] = [[math.nan] * len(xs) for xs in choices]
    full = []  # (doc, choice) scored by lm-eval's path
    for d, doc_pairs in enumerate(pairs):
        ctx = doc_pairs[0][0] if doc_pairs else []
        fits = all(len(c) + len(x) <= max_len + 1 and c == ctx for c, x in doc_pairs)
        if share_context and ctx and fits:
            out[d] = _shared_context_lls(model, ctx, [x for _, x in doc_pairs], device)
        else:
            full += [(d, j) for j in range(len(doc_pairs))]
    rows = [(d, j, (pairs[d][j][0] + pairs[d][j][1])[-(max_len + 1):][:-1], pairs[d][j][1]) for d, j in full]
    rows.sort(key=lambda r: -len(r[2]))  # lm-eval's order: longest first
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        width = len(chunk[0][2])
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, (_, _, inp, _) in enumerate(chunk):
            ids[r, :len(inp)] = torch.tensor(inp)
        logp = torch.log_softmax(model(ids.to(device)).logits.float(), dim=-1)
        for r, (d, j, inp, cont) in enumerate(chunk):
            pos = torch.arange(len(inp) - len(cont), len(inp), device=logp.device)
            out[d][j] = logp[r, pos, torch.tensor(cont, device=logp.device)].sum().item()
    return out


@torch.no_grad()
def decode_loglikelihoods(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 16,
                          max_length: int | None = None) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) of each (context tokens, continuation tokens) pair, read as serving reads
    it: prefill the context (which writes the cache, in the patched preset's format on a patched model),
    then feed the continuation one token per decode step (teacher forcing; each step's attention reads
    the cache of everything before it). The first continuation token's log-prob comes from the prefill's
    last logits, token j's from the step that consumed token j - 1. `is_greedy`: every continuation token
    is its position's argmax (lm-eval's second value).

    Pairs with the same context tokens share one prefill: their continuations run as one right-padded
    batch of up to `batch_size` rows on copies of the prefilled cache (a row only ever attends to its own
    earlier tokens, so the padding after a short continuation is never read; every row steps at the same
    position). A longer group is prefilled again per batch. As lm-eval, context + continuation is
    left-truncated to `max_length` + 1 tokens (default the model's max_position_embeddings). On an
    unpatched model this equals lm-eval's forward path up to float rounding.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size!r}")
    device = next(model.parameters()).device
    max_len = max_length or model.config.max_position_embeddings
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, cont) in enumerate(pairs):
        if not cont or len(cont) > max_len:
            raise ValueError(f"pair {i}: a continuation of {len(cont)} tokens (must be 1..{max_len})")
        ctx = tuple(ctx)[-(max_len + 1 - len(cont)):]  # lm-eval's left truncation of context + continuation
        if not ctx:
            raise ValueError(f"pair {i}: empty context (lm-eval conditions an empty context on a prefix token)")
        groups.setdefault(ctx, []).append(i)
    out: list[tuple[float, bool]] = [(math.nan, False)] * len(pairs)
    for ctx, idx in groups.items():
        idx = sorted(idx, key=lambda i: -len(pairs[i][1]))  # longest first: tight padding per batch
        for b in range(0, len(idx), batch_size):
            chunk = idx[b:b + batch_size]
            for i, res in zip(chunk, _decode_chunk(model, list(ctx), [list(pairs[i][1]) for i in chunk], device),
                              strict=True):
                out[i] = res
    return out


def _fresh_cache(model):
    """The cache a serving call starts from: the patch's LatentCache on a patched model (as `generate`
    builds it), HF's DynamicCache otherwise."""
    from transformers.cache_utils import DynamicCache

    from ...cache import LatentCache
    from ...patching import patch_state

    state = patch_state(model)
    if state is None:
        return DynamicCache(config=model.config)
    return LatentCache(state.config, model, joint_rows=state.backend == "flashmla")


def _decode_chunk(model, ctx: list[int], conts: list[list[int]], device) -> list[tuple[float, bool]]:
    cache = _fresh_cache(model)
    out = model(input_ids=torch.tensor([ctx], device=device), use_cache=True, **{cache_kwarg(model): cache})
    cache = _returned(out, cache)
    first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    lls = [first[x[0]].item() for x in conts]
    greedy = [int(first.argmax()) == x[0] for x in conts]
    width = max(len(x) for x in conts) - 1
    if width == 0:
        return list(zip(lls, greedy, strict=True))
    ids = torch.zeros((len(conts), width + 1), dtype=torch.long)  # right-padded continuations
    for r, x in enumerate(conts):
        ids[r, :len(x)] = torch.tensor(x)
    ids = ids.to(device)
    lens = torch.tensor([len(x) for x in conts], device=device)
    total = torch.zeros(len(conts), dtype=torch.float64, device=device)
    hits = torch.ones(len(conts), dtype=torch.bool, device=device)
    cache.batch_repeat_interleave(len(conts))
    for t in range(width):  # the step consuming continuation token t predicts token t + 1
        step = decode_step(model, ids[:, t:t + 1], len(ctx) + t, cache)
        cache = _returned(step, cache)
        logp = torch.log_softmax(step.logits[:, -1].float(), dim=-1)
        live = lens > t + 1
        target = ids[:, t + 1]
        total += torch.where(live, logp.gather(1, target[:, None])[:, 0].double(), 0.0)
        hits &= ~live | (logp.argmax(-1) == target)
    return [(lls[r] + float(total[r]), greedy[r] and bool(hits[r])) for r in range(len(conts))]


def _returned(out, cache):
    new = output_cache(out)
    return cache if new is None else new


def _shared_context_lls(model, ctx: list[int], conts: list[list[int]], device) -> list[float]:
    from transformers.cache_utils import DynamicCache

    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    first = model(torch.tensor([ctx], device=device), use_cache=True, **{kw: cache})
    last = torch.log_softmax(first.logits[0, -1].float(), dim=-1)
    lls = [last[x[0]].item() for x in conts]
    width = max(len(x) for x in conts) - 1
    if width == 0:
        return lls
    ids = torch.zeros((len(conts), width), dtype=torch.long)
    for r, x in enumerate(conts):
        ids[r, :len(x) - 1] = torch.tensor(x[:-1])
    cache.batch_repeat_interleave(len(conts))
    # Right padding: a choice's tokens never attend to the padding after them (causal), so no mask.
    logp = torch.log_softmax(model(ids.to(device), use_cache=True, **{kw: cache}).logits.float(), dim=-1)
    for r, x in enumerate(conts):
        if len(x) > 1:
            idx = torch.arange(len(x) - 1, device=logp.device)
            lls[r] += logp[r, idx, torch.tensor(x[1:], device=logp.device)].sum().item()
    return lls


def score_completion_mc(model, tokenizer, num_samples: int = 200, seed: int = sq_utils.DEFAULT_SEED,
                        batch_size: int = 16, through: str = "forward", **knobs) -> dict:
    """sq_code_completion_mc's acc and acc_norm (`knobs`: task metadata names, as in its YAML; `through`:
    see `choice_loglikelihoods`)."""
    rows = sq_utils.completion_mc_rows(seed, num_samples, **sq_utils.completion_mc_knobs(knobs))
    lls = choice_loglikelihoods(model, tokenizer, [r["context"] for r in rows], [r["choices"] for r in rows],
                                batch_size, through=through)
    acc = [float(mc_pick(ll) == r["gold"]) for r, ll in zip(rows, lls, strict=True)]
    norm = [float(mc_pick(ll, r["choices"]) == r["gold"]) for r, ll in zip(rows, lls, strict=True)]
    return {"sq_code_completion_mc": sum(acc) / len(acc), "sq_code_completion_mc_norm": sum(norm) / len(norm)}


def mc_pick(lls: Sequence[float], choices: Sequence[str] | None = None) -> int:
    """lm-eval's prediction: argmax of the loglikelihoods (first on ties); with `choices`, of the
    loglikelihoods per character (acc_norm)."""
    vals = [ll / len(c) for ll, c in zip(lls, choices, strict=True)] if choices is not None else list(lls)
    return max(range(len(vals)), key=lambda i: (vals[i], -i))


def score_kv(model, tokenizer, lengths: Sequence[int] = (1024, 2048, 4096), num_samples: int = 100,
             seed: int = sq_utils.DEFAULT_SEED, tokenizer_path: str | None = None, batch_size: int = 16,
             digits: int = sq_utils.KV_DIGITS, distractors: int = sq_utils.KV_DISTRACTORS) -> dict:
    scores = {}
    for n in lengths:
        rows = sq_utils.kv_rows(n, seed, num_samples, tokenizer_path, digits=digits, distractors=distractors)
        preds = greedy_generate(model, tokenizer, [r["prompt"] for r in rows], sq_utils.ANSWER_RESERVE,
                                ['"', "\n"], batch_size)
        scores[kv_task_name(n)] = sum(
            sq_utils.process_exact_match(r, [p])["exact_match"] for r, p in zip(rows, preds, strict=True)) / len(rows)
    return scores


def kv_task_name(length: int) -> str:
    return f"sq_kv_retrieval_{length // 1024}k" if length % 1024 == 0 else f"sq_kv_retrieval_{length}"


def score_passkey(model, tokenizer, lengths: Sequence[int] = (1024, 2048, 4096), num_samples: int = 4,
                  seed: int = sq_utils.DEFAULT_SEED, tokenizer_path: str | None = None, haystack: str = "repeat",
                  batch_size: int = 16, digits: int = sq_utils.PASSKEY_DIGITS,
                  distractors: int = sq_utils.PASSKEY_DISTRACTORS) -> dict:
    rows = sq_utils.passkey_rows(list(lengths), seed, num_samples, tokenizer_path, haystack,
                                 **sq_utils.passkey_knobs({"passkey_digits": digits, "passkey_distractors": distractors}))
    preds = greedy_generate(model, tokenizer, [r["prompt"] for r in rows], sq_utils.ANSWER_RESERVE,
                            ["\n", "."], batch_size)
    name = "sq_passkey" if haystack == "repeat" else "sq_passkey_code"
    hits = [sq_utils.process_passkey(r, [p])["exact_match"] for r, p in zip(rows, preds, strict=True)]
    out = {name: sum(hits) / len(hits)}
    for n in lengths:
        sel = [h for h, r in zip(hits, rows, strict=True) if r["length"] == n]
        out[f"{name}_{n}"] = sum(sel) / len(sel)
    return out


def score_completion(model, tokenizer, num_samples: int = 200, seed: int = sq_utils.DEFAULT_SEED,
                     batch_size: int = 16, prefix: float = sq_utils.COMPLETION_PREFIX,
                     words: int = sq_utils.COMPLETION_WORDS, copyable: bool = sq_utils.COMPLETION_COPYABLE) -> dict:
    rows = sq_utils.completion_rows(seed, num_samples, prefix=prefix, words=words, copyable=copyable)
    preds = greedy_generate(model, tokenizer, [r["context"] for r in rows], 64, ["\n"], batch_size)
    hits = [sq_utils.process_code_completion(r, [p])["exact_match"] for r, p in zip(rows, preds, strict=True)]
    return {"sq_code_completion": sum(hits) / len(hits)}


@torch.no_grad()
def score_code_ppl(model, tokenizer, max_length: int = 4096, texts: Sequence[str] | None = None,
                   max_files: int = 0) -> dict:
    """lm-eval's loglikelihood_rolling metrics: disjoint windows, the first conditioned on EOS."""
    device = next(model.parameters()).device
    if texts is None:  # smallest first, as the lm-eval task orders them, so max_files matches --limit
        texts = [r["text"] for r in sorted(sq_utils.load_heldout(), key=lambda r: (r["bytes"], r["path"]))]
    texts = list(texts)[:max_files] if max_files else list(texts)
    total_ll, words, nbytes, ntok = 0.0, 0, 0, 0
    for text in texts:
        ids = encode_text(tokenizer, text)  # the whole file, scored below in windows of max_length
        seq = [tokenizer.eos_token_id, *ids]
        # Window k predicts tokens [start, end) given the previous token(s) of the same window.
        for start in range(1, len(seq), max_length):
            end = min(start + max_length, len(seq))
            inp = torch.tensor([seq[start - 1:end - 1]], device=device)
            tgt = torch.tensor(seq[start:end], device=device)
            logits = model(inp).logits[0].float()
            total_ll += -torch.nn.functional.cross_entropy(logits, tgt, reduction="sum").item()
        words += len(re.split(r"\s+", text))
        nbytes += len(text.encode("utf-8"))
        ntok += len(ids)
    return {"word_perplexity": math.exp(-total_ll / words), "byte_perplexity": math.exp(-total_ll / nbytes),
            "bits_per_byte": -total_ll / nbytes / math.log(2), "token_perplexity": math.exp(-total_ll / ntok)}


def quick_suite(model, tokenizer, kv_samples: int = 100, passkey_samples: int = 4, completion_samples: int = 200,
                lengths: Sequence[int] = (1024, 2048, 4096), tokenizer_path: str | None = None,
                batch_size: int = 16, ppl_files: int = 0, log=print, kv_knobs: dict | None = None) -> dict:
    """All direct scores; `tokenizer_path` must name the tokenizer `tokenizer` was loaded from;
    `kv_knobs` (e.g. `sq_utils.KV_TRAINING_FORMAT`) go to `score_kv`."""
    was_training = model.training
    model.eval()
    scores: dict = {}
    t0 = time.time()
    scores.update(score_code_ppl(model, tokenizer, max_length=max(lengths), max_files=ppl_files))
    log(f"eval code ppl {time.time() - t0:.0f}s")
    scores.update(score_kv(model, tokenizer, lengths, kv_samples, tokenizer_path=tokenizer_path,
                           batch_size=batch_size, **(kv_knobs or {})))
    log(f"eval kv {time.time() - t0:.0f}s")
    for hay in ("repeat", "code") if passkey_samples else ():
        scores.update(score_passkey(model, tokenizer, lengths, passkey_samples, tokenizer_path=tokenizer_path,
                                    haystack=hay, batch_size=batch_size))
        log(f"eval passkey ({hay}) {time.time() - t0:.0f}s")
    if completion_samples:
        scores.update(score_completion(model, tokenizer, completion_samples, batch_size=batch_size))
        log(f"eval completion {time.time() - t0:.0f}s")
    model.train(was_training)
    return scores
