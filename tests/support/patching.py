"""Shared helpers for the patch tests (no tests here).

`install_reference(model, config)` turns a model into an *independent* implementation of what a patched
model must compute, built only from HF's documented seam and the foundation functions: a registered
attention function (with its mask function registered too), `expand_kv` passed through, and HF's own
DynamicCache holding the raw latent. Every step it re-quantizes the whole raw cache of each request with
`quantize_kv` (valid for causal-consistent formats), absorbs the query with `absorb_query`, runs
`mla_decode_reference` per request (or per query row for DSA top-k selections) and projects with W_UV.
Prefill (S > 1) with `prefill: bf16` runs plain eager attention on the expanded K/V.

Comparing a patched model with its reference: run the patched model under `recording_attention_inputs`,
then the reference under `replaying_attention_inputs`, so that every MLA attention of the reference reads
exactly the hidden states the patched one read. Without that, the two models differ upstream of each
attention by fp32 reassociation (~3e-7 relative: batched vs per-request decode, stock vs plain prefill;
the exact bits depend on the CPU kernels, i.e. on the ISA and thread count), and a rounding to fp8 / bf16
whose input lies that close to a rounding midpoint (the query's pre-scaled RoPE, a cache code, P) lands
on a different code in the two models: one bf16 ulp of one query element moves the logits by ~1e-4 of
their scale. With identical inputs both models quantize identical numbers, so they take every rounding
decision alike and differ only by fp32 reassociation of what follows.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from snapquant import (
    absorb_query,
    mla_decode_reference,
    project_output,
    quantize_kv,
    resolve_config,
    split_kv_b,
)

REF_IMPL = "snapquant_test_reference"
_STATE: dict = {}


def _ref_stock(module, query, key, value, mask, scaling, sinks=None, indices=None):
    k, v = type(module).expand_kv(module, key, value)
    w = (query @ k.transpose(-1, -2)) * scaling
    B, H, S, T = w.shape
    vis = mask.expand(B, 1, S, T) if mask is not None else torch.ones(S, T, dtype=torch.bool).tril(T - S)
    if indices is not None:
        vis = vis & torch.zeros(B, S, T, dtype=torch.bool).scatter_(-1, indices.long().clamp(0, T - 1), True)[:, None]
    w = w.masked_fill(~vis, torch.finfo(w.dtype).min)
    if sinks is not None:
        w = torch.cat([w, sinks.view(1, -1, 1, 1).expand(B, H, S, 1).to(w.dtype)], -1)
    p = torch.softmax(w.float(), -1).to(query.dtype)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ v).transpose(1, 2), None


def _ref_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    cfg = _STATE["config"]
    sinks, indices = kw.get("s_aux"), kw.get("indices")
    B, H, S, _ = query.shape
    if S > 1 and cfg.prefill == "bf16":
        return _ref_stock(module, query, key, value, attention_mask, scaling, sinks, indices)
    latent, rope = key[:, 0].float(), value[:, 0].float()  # HF's DynamicCache: the raw latent [B, T, r]
    T = latent.shape[1]
    vis = attention_mask[:, 0].expand(B, S, T) if attention_mask is not None else \
        torch.ones(S, T, dtype=torch.bool).tril(T - S).expand(B, S, T)
    valid = torch.diagonal(vis[:, :, T - S:], dim1=-2, dim2=-1)  # [B, S] real (non-padding) queries
    if indices is not None:
        vis = vis & torch.zeros(B, S, T, dtype=torch.bool).scatter_(-1, indices.long().clamp(0, T - 1), True)
    w_uk, w_uv = split_kv_b(module.kv_b_proj.weight, module.num_heads, module.qk_nope_head_dim, module.v_head_dim)
    dn = module.qk_nope_head_dim
    q = query.transpose(1, 2).float()
    q_abs = absorb_query(q[..., :dn], q[..., dn:], w_uk.float())
    round16 = query.dtype != torch.float32 if cfg.is_identity else True
    out = torch.zeros(B, S, H, w_uv.shape[1])
    for b in range(B):
        valid_rows = valid[b].nonzero().flatten()
        for s in valid_rows.tolist() if (indices is not None or S == 1) else [None]:
            if s is None:  # all valid rows at once: causal over this request's non-padding tokens
                keys = vis[b].any(0)
                rows = valid_rows
            else:
                keys, rows = vis[b, s], torch.tensor([s])
            if not bool(keys.any()):
                continue
            kv = quantize_kv(latent[b, keys][None], rope[b, keys][None], cfg)
            o, lse = mla_decode_reference(q_abs[b, rows][None], kv, None, scaling, cfg, causal=True,
                                          round_16bit=round16)
            if sinks is not None:
                o = o * torch.sigmoid(lse - sinks.float().view(1, 1, H))[..., None]
            out[b, rows] = project_output(o[0], w_uv.float())
    return out.to(query.dtype), None


AttentionInterface.register(REF_IMPL, _ref_attention)
AttentionMaskInterface.register(REF_IMPL, sdpa_mask)  # never leave a custom implementation without a mask


def reference_copy(model, config):
    """A deep copy of `model` computing, independently, what `snapquant.patch(model, config)` must compute."""
    ref = copy.deepcopy(model)
    _STATE["config"] = resolve_config(config)
    for m in ref.modules():
        if hasattr(m, "kv_a_proj_with_mqa"):
            m.expand_kv = lambda k, v: (k, v)
    ref.config._attn_implementation = REF_IMPL
    if hasattr(ref.config, "get_text_config"):
        ref.config.get_text_config()._attn_implementation = REF_IMPL
    return ref


def _mla_modules(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if hasattr(m, "kv_a_proj_with_mqa")}


def _hidden_states(args, kwargs) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


@contextmanager
def recording_attention_inputs(model) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Yields {module name: [hidden_states of each call]} filled while the block runs."""
    recorded: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in _mla_modules(model).items():
        calls = recorded.setdefault(name, [])
        handles.append(module.register_forward_pre_hook(
            lambda m, args, kwargs, calls=calls: calls.append(_hidden_states(args, kwargs).detach().clone()),
            with_kwargs=True))
    try:
        yield recorded
    finally:
        for h in handles:
            h.remove()


@contextmanager
def replaying_attention_inputs(model, recorded: dict[str, list[torch.Tensor]],
                               select: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> Iterator[None]:
    """Every MLA attention of `model` reads `select(recorded input)` of the same module and call instead of
    its own hidden_states (same shape required); every recorded call must be replayed."""
    handles, pending = [], {}
    for name, module in _mla_modules(model).items():
        pending[name] = iter(recorded[name])

        def hook(m, args, kwargs, name=name):
            own = _hidden_states(args, kwargs)
            forced = next(pending[name], None)
            assert forced is not None, f"{name}: more attention calls than were recorded"
            forced = select(forced)
            assert forced.shape == own.shape, f"{name}: recorded {tuple(forced.shape)}, now {tuple(own.shape)}"
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": forced}
            return (forced, *args[1:]), kwargs

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    left = {name: sum(1 for _ in it) for name, it in pending.items()}
    assert not any(left.values()), f"recorded attention calls never replayed: {left}"


# ---------------------------------------------------------------------------------------------- runs
def batch_inputs(batch: int = 3, length: int = 10, pads=(0, 3, 6), seed: int = 0, vocab: int = 256):
    """Left-padded token ids (ids >= 3) and attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    am = torch.ones_like(ids)
    for b, p in enumerate(pads[:batch]):
        am[b, :p] = 0
        ids[b, :p] = 0
    return ids, am


def cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def scores_of(model, out) -> torch.Tensor:
    """Logits of a causal LM, or a fixed random projection of the last hidden state for text-only models."""
    if hasattr(out, "logits"):
        return out.logits
    hidden = out.last_hidden_state
    g = torch.Generator().manual_seed(1234)
    head = torch.randn(hidden.shape[-1], 256, generator=g).to(hidden.dtype)
    return hidden @ head


def greedy(model, ids, am, steps: int):
    """Prefill + `steps` greedy decode steps through forward calls.

    Returns (prefill scores [B, L, V], per-step scores [steps, B, V], tokens [B, steps], final cache).
    """
    ck = cache_kwarg(model)
    pos = (am.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True)
        prefill = scores_of(model, out)
        cache = output_cache(out)
        tok = prefill[:, -1].argmax(-1, keepdim=True)
        steps_out, toks = [], [tok]
        for _ in range(steps):
            am = torch.cat([am, torch.ones_like(tok)], 1)
            pos = am.long().sum(-1, keepdim=True) - 1
            out = model(input_ids=tok, attention_mask=am, position_ids=pos, use_cache=True, **{ck: cache})
            x = scores_of(model, out)[:, -1]
            steps_out.append(x)
            cache = output_cache(out)
            tok = x.argmax(-1, keepdim=True)
            toks.append(tok)
    stacked = torch.stack(steps_out) if steps_out else prefill.new_zeros(0, *prefill[:, -1].shape)
    return prefill, stacked, torch.cat(toks[:-1], 1) if steps else toks[0][:, :0], cache


def generate(model, ids, am, steps: int, **kw):
    """HF generate (greedy): (per-step raw logits [steps, B, V], new tokens [B, steps], final cache)."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return torch.stack(out.logits), out.sequences[:, ids.shape[1]:], output_cache(out)


def rel_diff(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |a - b| / max |scale| (the logit scale)."""
    s = (scale if scale is not None else a).abs().max().clamp_min(1e-12)
    return float((a.float() - b.float()).abs().max() / s)
