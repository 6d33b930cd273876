"""Model-level fidelity of a quantized KV cache: how far the next-token distributions move.

Against the unpatched model's distributions on the same tokens (teacher forcing), per position:
- KL(p_ref || p_quant) in nats: mean, p99 and max over positions;
- top-1 agreement: share of positions whose argmax token is unchanged;
- perplexity of the true next tokens under both, and the delta (quant - ref, and relative).

Two modes, because they exercise different paths (docs/numerics.md, "Why per-token matters"):
- `prefill`: one forward over the whole sequence with `prefill: quantized`, so every position
  attends to the quantized latent. For causal-consistent configs (per-token scales) this equals
  step-by-step decode exactly; for per-tensor / per-channel dynamic scales it does not.
- `decode`: prefill the first `prompt_len` tokens as the config says (BF16 by default, as served),
  then feed the remaining tokens one at a time through the patched model with its quantized cache;
  only the decode-step positions are scored. This is what generation sees.
Both run the patched model through `snapquant.patched`.

Per mode the result also holds `summary` (every statistic of `analysis.uncertainty.cluster_summary`
with its cluster-bootstrap interval over sequences and n) and `per_sequence` (the per-sequence sums
of `sequence_aggregates`, which pair two configurations on the same positions); `keep_positions`
adds the per-position arrays themselves (`positions`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..analysis.uncertainty import (
    BOOTSTRAP_RESAMPLES,
    SUMMARY_METHOD,
    cluster_summary,
    position_metrics,
    sequence_aggregates,
)
from ..config import KVQuantConfig
from ..errors import ConfigError, ShapeError
from ..models.stepping import decode_steps

if TYPE_CHECKING:
    from ..analysis.text_sample import TextSample

MODES = ("prefill", "decode")


@dataclass
class FidelityReference:
    """The unpatched model's view of the fidelity tokens, computed once and reused for every cell."""

    input_ids: torch.Tensor
    """[N, T] token ids (no padding)."""
    logprobs: torch.Tensor
    """[N, T, V] float32 log-softmax of the reference logits at every position (on CPU)."""


def default_text_source() -> Path:
    """The held-out code the embedded model never saw (shipped with the offline tasks)."""
    from ..data.corpus import HELDOUT_FILE

    return HELDOUT_FILE


def fidelity_sample(tokenizer: Any, source: str | Path | None, seq_len: int, num_sequences: int, *,
                    seed: int = 0) -> TextSample:
    """A `snapquant.analysis.text_sample.TextSample` of `source` (.txt / .jsonl), default the held-out code.

    Rows spread over the documents, each entered past its header at a seeded offset, and record
    where they came from (see `sample_sequences`); ConfigError when the source is too short.
    """
    from ..analysis.text_sample import sample_sequences

    src = Path(source) if source else default_text_source()
    if not src.is_file():
        raise ConfigError(f"fidelity text {src} does not exist; set fidelity.source to a .txt or .jsonl file")
    sample = sample_sequences(tokenizer, src, seq_len, num_sequences, seed=seed)
    if not source:  # results name the shipped file by its place in the package, not this machine's path
        sample.source = src.relative_to(Path(__file__).resolve().parents[2]).as_posix()
    return sample


def fidelity_tokens(tokenizer: Any, source: str | Path | None, seq_len: int, num_sequences: int, *,
                    seed: int = 0) -> torch.Tensor:
    """[N, T] ids of `fidelity_sample` (the rows alone)."""
    return fidelity_sample(tokenizer, source, seq_len, num_sequences, seed=seed).input_ids


@torch.no_grad()
def fidelity_reference(model: Any, input_ids: torch.Tensor) -> FidelityReference:
    if input_ids.dim() != 2 or input_ids.shape[1] < 3:
        raise ShapeError(f"input_ids must be [N, T] with T >= 3, got {tuple(input_ids.shape)}")
    logits = model(input_ids=input_ids.to(_device(model))).logits
    return FidelityReference(input_ids.cpu(), torch.log_softmax(logits.float(), dim=-1).cpu())


def compare_logprobs(ref: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor,
                     keep_positions: bool = False) -> dict[str, Any]:
    """Per-position metrics between two [M, V] log-prob sets, with the true next tokens `targets` [M].

    Computed in float64: KL of near-identical distributions is a difference of close numbers.
    `keep_positions` adds "kl_positions" and "top1_positions" ([M] float64 numpy), the per-position
    values behind the means. (`fidelity_metrics` scores whole sequences through
    `analysis.uncertainty.position_metrics`, whose intervals need to know the sequences.)
    """
    if ref.shape != quant.shape or ref.dim() != 2 or targets.shape != ref.shape[:1]:
        raise ShapeError(f"ref {tuple(ref.shape)}, quant {tuple(quant.shape)} must be [M, V] and targets [M], "
                         f"got targets {tuple(targets.shape)}")
    r, q = ref.double(), quant.double()
    q = torch.log_softmax(q, dim=-1)  # renormalise (no-op for true log-probs; guards fp error)
    r = torch.log_softmax(r, dim=-1)
    kl = (r.exp() * (r - q)).sum(-1).clamp_min(0.0)
    nll_r = -r.gather(-1, targets[:, None]).squeeze(-1)
    nll_q = -q.gather(-1, targets[:, None]).squeeze(-1)
    ppl_r, ppl_q = math.exp(float(nll_r.mean())), math.exp(float(nll_q.mean()))
    extra = {"kl_positions": kl.numpy(), "top1_positions": (r.argmax(-1) == q.argmax(-1)).double().numpy()
             } if keep_positions else {}
    return {**extra,
        "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)) if kl.numel() > 1 else float(kl.max()),
        "kl_max": float(kl.max()), "top1_agree": float((r.argmax(-1) == q.argmax(-1)).double().mean()),
        "ppl_ref": ppl_r, "ppl_quant": ppl_q, "ppl_delta": ppl_q - ppl_r, "ppl_rel_delta": ppl_q / ppl_r - 1.0,
        "n_positions": int(kl.numel()),
    }


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def prefill_logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=ids.to(_device(model))).logits.float(), -1).cpu()


@torch.no_grad()
def decode_logprobs(model: Any, ids: torch.Tensor, prompt_len: int, cache: Any = None,
                    on_step: Any = None) -> torch.Tensor:
    """Prefill `prompt_len` tokens, then step through the rest one token at a time (teacher forcing).

    Returns [N, T - prompt_len - 1, V] log-probs: the predictions made by the decode steps that
    consumed tokens prompt_len .. T-2 (each step attends to the cache of all earlier tokens).
    """
    T = ids.shape[1]
    if not 0 < prompt_len < T - 1:
        raise ConfigError(f"fidelity.prompt_len={prompt_len} must be in [1, {T - 2}] for sequences of {T} tokens")
    steps = []
    for i, out in enumerate(decode_steps(model, ids.to(_device(model)), prompt_len, cache=cache)):
        if i:  # the first output is the prefill's; its predictions are not decode steps
            steps.append(torch.log_softmax(out.logits[:, -1].float(), -1).cpu())
        if on_step:
            on_step(1)
    return torch.stack(steps, dim=1)


def fidelity_metrics(
    model: Any,
    reference: FidelityReference,
    config: KVQuantConfig,
    *,
    modes: tuple[str, ...] = MODES,
    prompt_len: int = 32,
    backend: str | None = None,
    patcher: Any = None,
    make_cache: Any = None,
    on_step: Any = None,
    keep_positions: bool = False,
    n_resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict[str, Any]:
    """Fidelity of `config` on `model` vs the cached unpatched reference; one dict per mode.

    `patcher(model, config[, backend=])` is a context manager (default `snapquant.patched`);
    `make_cache(model, config)` optionally builds the cache object decode should use;
    `on_step(n)` is called after each forward pass (progress bars); `n_resamples` / `seed` are the
    cluster bootstrap's; `keep_positions` adds each mode's per-position metrics as [N, positions]
    arrays under "positions" (`analysis.uncertainty.position_metrics`: kl, flip, nll_ref,
    nll_quant, ref_top1, quant_top1). Position j of a mode predicts token `first_position + j + 1`
    of its sequence.
    """
    for m in modes:
        if m not in MODES:
            raise ConfigError(f"fidelity mode {m!r} is not valid; allowed values: {', '.join(MODES)}")
    if patcher is None:
        from .harness import default_patcher

        patcher = default_patcher()

    def patch(cfg: KVQuantConfig):
        return patcher(model, cfg) if backend is None else patcher(model, cfg, backend=backend)

    ids, ref = reference.input_ids, reference.logprobs
    N, T = ids.shape
    out: dict[str, Any] = {"num_sequences": N, "seq_len": T, "causal_consistent": config.causal_consistent,
                           "tokens_sha256": tokens_fingerprint(ids)}
    stats = {"n_resamples": n_resamples, "seed": seed}
    if "prefill" in modes:
        with patch(config.replace(prefill="quantized")):
            lp = prefill_logprobs(model, ids)
        if on_step:
            on_step(1)
        out["prefill"] = mode_metrics(ref[:, :-1], lp[:, :-1], ids[:, 1:], 0, keep_positions, **stats)
    if "decode" in modes:
        with patch(config):
            cache = make_cache(model, config) if make_cache is not None else None
            lp = decode_logprobs(model, ids, prompt_len, cache, on_step)
        # step t consumed token t and predicts token t + 1, for t in [prompt_len, T - 2]
        out["decode"] = mode_metrics(ref[:, prompt_len:T - 1], lp, ids[:, prompt_len + 1:], prompt_len,
                                     keep_positions, **stats)
        out["decode"]["prompt_len"] = prompt_len
    return out


def tokens_fingerprint(ids: torch.Tensor) -> str:
    """A short hash of the scored token ids: two results pair position by position only when it agrees."""
    return hashlib.sha256(ids.to(torch.int64).cpu().numpy().tobytes() + str(tuple(ids.shape)).encode()).hexdigest()[:16]


def mode_metrics(ref: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor, first_position: int,
                 keep_positions: bool = False, *, n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
                 ) -> dict[str, Any]:
    """[N, P, V] reference and quantized log-probs, [N, P] true next tokens -> one mode's result.

    The point values of `compare_logprobs` (kl_mean, kl_p99, kl_max, top1_agree, ppl_*,
    n_positions), plus n_sequences, `summary` ({statistic: {value, ci_low, ci_high}}), `interval`
    (how), `per_sequence` ({aggregate: [N] list}) and `first_position`.
    """
    return summarize_positions(position_metrics(ref, quant, targets), first_position, keep_positions,
                               n_resamples=n_resamples, seed=seed)


def summarize_positions(met: dict[str, np.ndarray], first_position: int, keep_positions: bool = False, *,
                        n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """One mode's result from `position_metrics` output ([N, P] arrays): see `mode_metrics`."""
    kl, nll_r, nll_q = met["kl"], met["nll_ref"], met["nll_quant"]
    ppl_r, ppl_q = math.exp(float(nll_r.mean())), math.exp(float(nll_q.mean()))
    est = cluster_summary(met, n_resamples=n_resamples, seed=seed)
    res: dict[str, Any] = {
        "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max()),
        "top1_agree": float(1.0 - met["flip"].mean()), "ppl_ref": ppl_r, "ppl_quant": ppl_q,
        "ppl_delta": ppl_q - ppl_r, "ppl_rel_delta": ppl_q / ppl_r - 1.0,
        "n_positions": int(kl.size), "n_sequences": int(kl.shape[0]), "first_position": int(first_position),
        "summary": {e.statistic: {"value": e.value, "ci_low": e.ci_low, "ci_high": e.ci_high} for e in est},
        "interval": {"method": f"cluster bootstrap over sequences, {SUMMARY_METHOD}", "confidence": 0.95,
                     "n_resamples": n_resamples, "seed": seed},
        "per_sequence": {k: v.tolist() for k, v in sequence_aggregates(met).items()},
    }
    if keep_positions:
        res["positions"] = met
    return res


def fidelity_table(results: dict[str, dict[str, Any]]) -> Any:
    """{label: fidelity_metrics(...)} -> a pandas DataFrame, one row per (label, mode).

    The point values, n, and each statistic of the summary as `<stat>`, `<stat>_ci_low`,
    `<stat>_ci_high` (top-1 agreement's interval is the flip rate's, mirrored).
    """
    import pandas as pd

    rows = []
    for label, res in results.items():
        for mode in MODES:
            if mode not in res:
                continue
            m = res[mode]
            row = {"config": label, "mode": mode,
                   **{k: v for k, v in m.items() if not isinstance(v, dict) and k != "positions"}}
            for stat, e in (m.get("summary") or {}).items():
                row.update({stat: e["value"], f"{stat}_ci_low": e["ci_low"], f"{stat}_ci_high": e["ci_high"]})
            if "flip_rate" in (m.get("summary") or {}):
                row.update(top1_agree_ci_low=1.0 - m["summary"]["flip_rate"]["ci_high"],
                           top1_agree_ci_high=1.0 - m["summary"]["flip_rate"]["ci_low"])
            rows.append(row)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ decode windows at depth
DEPTH_WINDOW_STEPS = 32


def default_depths(context: int, steps: int = DEPTH_WINDOW_STEPS) -> list[int]:
    """Cache depths for `depth_window_metrics` up to a model's `context`: powers of two from about
    1/16 of the deepest window, 3/4 of the context, and the deepest window that fits,
    `context - steps - 1` (its last step predicts the context's last token). 4096 and 32 steps:
    256, 512, 1024, 2048, 3072, 4063."""
    last = context - steps - 1
    if last < 1:
        raise ConfigError(f"no decode window of {steps} steps fits a context of {context} tokens")
    out, p = [], 16
    while p < last:
        if p * 16 >= last:
            out.append(p)
        p *= 2
    if out and out[-1] < context * 3 // 4 < last:
        out.append(context * 3 // 4)
    return [*out, last]


def _identity_config() -> KVQuantConfig:
    """Nothing quantized, BF16 prefill: a patched model reproduces the unpatched one and its cache holds the
    exact latent and RoPE key of every token (in the model's dtype)."""
    return KVQuantConfig(nope_dtype="bf16", rope_dtype="bf16", rope_prescale=False, query="bf16", pv="bf16",
                         name="identity")


@torch.no_grad()
def depth_window_metrics(model: Any, ids: torch.Tensor, configs: dict[str, KVQuantConfig], depths: Any,
                         steps: int = DEPTH_WINDOW_STEPS, *, patcher: Any = None, backend: str | None = None,
                         shared_prefill: bool = True, on_window: Any = None) -> dict[str, dict[str, np.ndarray]]:
    """Decode fidelity of windows at depth: for each depth d, `steps` teacher-forced decode steps after a
    prefill of d tokens, scored against the unpatched model at the same positions.

    The reference is one unpatched-equivalent forward per row over the longest window (`ids[:, :T]`,
    T = max(depths) + steps + 1): the row's log-probs at every window position, and, through an identity
    config (nothing quantized, BF16 prefill: bit-identical to the unpatched model), the exact latent and
    RoPE key of every token. The prefill of d tokens is as served (`prefill: bf16`: the model's own
    attention on fresh activations; the tokens stored in the config's format): with `shared_prefill`, the
    first d exact latent rows are appended into a fresh `LatentCache` of the config in one append, as that
    prefill would append them (its per-tensor / per-channel scales and KIVI groups formed from those d
    tokens); the latents equal a d-token prefill's up to fp32 summation order (causal attention; tested in
    tests/test_fidelity.py). Without it (or when the model has cache layers other than MLA latent layers),
    every depth runs its own prefill through the patched model. Then step j consumes token d + j and
    predicts token d + j + 1. `ids` is decoded as one batch: a scale frozen at the prefill over the whole
    tensor (per_tensor_dynamic, per_channel without token groups) is computed over the batch's tokens, as a
    served batch would; per-token scales and KIVI groups are per sequence.

    Returns {label: `analysis.uncertainty.position_metrics` arrays [N, len(depths) * steps] (kl, flip,
    nll_ref, nll_quant, ref_top1, quant_top1) plus "positions" and "depth" ([len(depths) * steps]: the
    position t of each column, the prediction of token t + 1, and its window's depth)}.
    `on_window(label, depth, seconds)` is called after each window (progress).
    """
    import time

    from ..cache import LatentCache, LatentLayer
    from ..models.stepping import decode_step, output_cache

    depths = sorted({int(d) for d in depths})
    T = depths[-1] + steps + 1
    if steps < 1 or not depths or depths[0] < 1 or ids.dim() != 2 or ids.shape[1] < T:
        raise ConfigError(f"decode windows of {steps} steps at depths {depths} need [N, >= {T}] token ids "
                          f"(steps >= 1, depths >= 1), got {tuple(ids.shape)}")
    if patcher is None:
        from .harness import default_patcher

        patcher = default_patcher()

    def patch(cfg: KVQuantConfig):
        return patcher(model, cfg) if backend is None else patcher(model, cfg, backend=backend)

    dev = _device(model)
    ids = ids[:, :T].cpu()
    cols = torch.tensor([d + j for d in depths for j in range(steps)])
    targets = ids[:, cols + 1]
    ref_rows, latent_rows = [], []
    with patch(_identity_config()):
        for row in ids.split(1):
            out = model(input_ids=row[:, :T - 1].to(dev), use_cache=True)
            ref_rows.append(torch.log_softmax(out.logits[0, cols.to(dev)].float(), -1).cpu())
            cache = output_cache(out)
            layers = list(getattr(cache, "layers", ()))
            if shared_prefill and layers and all(isinstance(layer, LatentLayer) for layer in layers):
                latent_rows.append([layer.dense(layer.dtype) for layer in layers])
            else:
                shared_prefill = False
            del out, cache
    ref = torch.stack(ref_rows)  # [N, D * steps, V]
    if shared_prefill:
        latents = [(torch.cat([r[i][0] for r in latent_rows]), torch.cat([r[i][1] for r in latent_rows]))
                   for i in range(len(latent_rows[0]))]
        del latent_rows
    results = {}
    for label, cfg in configs.items():
        lps = []
        with patch(cfg):
            for d in depths:
                t0 = time.perf_counter()
                steps_lp = []
                if shared_prefill:
                    cache = LatentCache(cfg, model)
                    for i, (lat, rope) in enumerate(latents):
                        cache.layer(i, lat.shape[-1], rope.shape[-1]).append(lat[:, :d].to(dev), rope[:, :d].to(dev))
                    window = ids[:, d:d + steps].to(dev)
                    for j in range(steps):
                        out = decode_step(model, window[:, j:j + 1], d + j, cache)
                        cache = output_cache(out)
                        steps_lp.append(torch.log_softmax(out.logits[:, -1].float(), -1).cpu())
                else:
                    for k, out in enumerate(decode_steps(model, ids[:, :d + steps + 1].to(dev), d)):
                        if k:  # the first output is the prefill's: its prediction is not a decode step
                            steps_lp.append(torch.log_softmax(out.logits[:, -1].float(), -1).cpu())
                lps.append(torch.stack(steps_lp, dim=1))
                cache = out = None
                if on_window:
                    on_window(label, d, time.perf_counter() - t0)
        met = position_metrics(ref, torch.cat(lps, dim=1), targets)
        met["positions"] = cols.numpy()
        met["depth"] = np.repeat(np.asarray(depths), steps)
        results[label] = met
    return results
