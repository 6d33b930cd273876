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

Per cell: tokens/s = batch x new tokens / decode seconds (decode = after the first token: HF's per-step
times from a streamer callback, the loop's from its own timer; capture excluded, reported apart), the
median step time, the split of one step into attention / experts / the rest (GPU kernel time under
torch.profiler of the uncaptured fixed-shape step, each module's kernels attributed by a
record_function range; the rest is norms, projections, router, LM head), and peak memory. Before
timing, per model and preset: the first two selections' logits and the greedy tokens of the loop
against HF generate from the same cache (max |logit diff| / max |logit|; the fraction of rows whose
first token agrees; the mean length of the agreeing prefix over the new tokens).

Every section is bounded: cells whose cache would not fit are skipped (status `skip: memory`), and no
new cell starts after `--budget-s` seconds (status `skip: budget`); results are written after every
cell (CSV + Markdown + JSON, atomically) and merged with the rows already in `--out` by key, so a
sweep split over several calls accumulates in one table. `--smoke` runs the same plumbing on CPU with
a tiny model in seconds (the loop's fixed-shape steps uncaptured).
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write_json, atomic_write_text
from ..models.stepping import cache_kwarg

COLUMNS = ("model", "layers", "preset", "batch", "context", "path", "new_tokens", "tokens_per_s", "step_ms",
           "attention_ms", "experts_ms", "rest_ms", "kernel_ms", "split_clock", "prefill_s", "capture_s",
           "peak_gib", "cache_gib", "experts", "status")
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


def fill_cache(cache, model, batch: int, length: int, seed: int = 1):
    """`length` random latent tokens per request in every MLA layer (drawn on the model's device)."""
    from ..models.registry import find_mla_modules

    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    g = torch.Generator(device=dev).manual_seed(seed)
    for _, module, adapter in find_mla_modules(model):
        r, d = adapter.dims(module)
        latent = torch.randn(batch, length, r, generator=g, device=dev).to(dtype)
        rope = torch.randn(batch, length, d, generator=g, device=dev).to(dtype)
        cache.layer(module.layer_idx, r, d).append(latent, rope)
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
        res = DecodeLoop(model, None, steps=steps, check_every=16).generate(
            ids, am, max_length=context + 1 + new_tokens, plan=plan, cache=cache, keep_logits=keep_logits)
        _sync(dev)
        out.update(tokens=res.sequences[:, context + 1:], logits=res.logits, prefill_s=res.seconds["prefill"],
                   step_s=res.seconds["decode"] / max(res.steps, 1), decode_s=res.seconds["decode"])
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


def step_split(model, preset: str, batch: int, context: int, steps: int = 3) -> dict[str, float]:
    """ms per fixed-shape (uncaptured) decode step in attention / experts / the rest: GPU kernel time on
    CUDA, CPU time elsewhere, attributed by record_function ranges around each module."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..cache import LatentCache
    from ..graphs import DecodeGraph
    from ..models.experts import decode_experts, expert_modules
    from ..models.registry import find_mla_modules

    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    cache = fill_cache(LatentCache(preset, model, max_cache_len=context + steps + 8), model, batch, context)
    ranges: list = []
    hooks = []

    def wrap(mod, name):
        hooks.append(mod.register_forward_pre_hook(lambda *a: ranges.append(record_function(name).__enter__())))
        hooks.append(mod.register_forward_hook(lambda *a: ranges.pop().__exit__(None, None, None)))

    for _, m, _ in find_mla_modules(model):
        wrap(m, "sq_attention")
    for m in expert_modules(model):
        wrap(m, "sq_experts")
    ids = torch.full((batch, 1), 5, dtype=torch.long, device=dev)
    try:
        with decode_experts(model), torch.no_grad():
            graph = DecodeGraph(model, cache, capture=False)
            graph.step(ids)
            graph.rewind(1)
            _sync(dev)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    with record_function("sq_step"):
                        graph.step(ids)
                        _sync(dev)
                    graph.rewind(1)
    finally:
        for h in hooks:
            h.remove()

    def total(evt, self_time: bool) -> float:
        if cuda:
            name = "self_device_time_total" if self_time else "device_time_total"
            alt = "self_cuda_time_total" if self_time else "cuda_time_total"
            return float(getattr(evt, name, getattr(evt, alt, 0.0)))
        return float(evt.self_cpu_time_total if self_time else evt.cpu_time_total)

    avg = prof.key_averages()
    by_name = {e.key: total(e, False) for e in avg}
    # CUDA: every kernel's own time; CPU: the step range's time (ops nest, their self times would miss Python)
    kernels = sum(total(e, True) for e in avg) if cuda else by_name.get("sq_step", 0.0)
    att, exp = by_name.get("sq_attention", 0.0), by_name.get("sq_experts", 0.0)
    ms = 1e-3 / steps
    return {"attention_ms": att * ms, "experts_ms": exp * ms, "rest_ms": max(kernels - att - exp, 0.0) * ms,
            "kernel_ms": kernels * ms, "split_clock": "gpu kernels" if cuda else "cpu"}


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
def _merge(old: list[dict], new: list[dict]) -> list[dict]:
    keyed = {tuple(str(r.get(k)) for k in KEY): r for r in old}
    for r in new:
        keyed[tuple(str(r.get(k)) for k in KEY)] = r
    return list(keyed.values())


def write_outputs(out: Path, rows: list[dict], checks: list[dict], env: dict) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out.with_suffix(".csv"), buf.getvalue())
    atomic_write_json(out.with_suffix(".json"), {"env": env, "rows": rows, "checks": checks}, indent=2)

    def f(v, fmt):
        return "" if v is None or v == "" else format(v, fmt)

    lines = [f"# lm-eval generation throughput: HF generate vs the snapquant decode loop ({env.get('device')})", "",
             f"Random-weight models, {env.get('dtype')} weights, {env.get('new_tokens')} greedy tokens per request after a "
             f"cache filled with `context` random latent tokens; tokens/s = batch x (new tokens - 1) / decode "
             f"seconds. Step split from torch.profiler on the uncaptured fixed-shape step ({env.get('split_clock')}). "
             f"Commit {env.get('git_commit')}, torch {env.get('torch')}, transformers {env.get('transformers')}.", "",
             "| model | preset | batch | context | path | tokens/s | ms/step | attention ms | experts ms | rest ms | "
             "peak GiB | cache GiB | experts | status |", "|" + "---|" * 14]
    for r in sorted(rows, key=lambda r: (r["model"], r["preset"], r["batch"], r["context"], r["path"])):
        lines.append(f"| {r['model']} ({r.get('layers')}L) | {r['preset']} | {r['batch']} | {r['context']} | {r['path']} | "
                     f"{f(r.get('tokens_per_s'), '.0f')} | {f(r.get('step_ms'), '.2f')} | "
                     f"{f(r.get('attention_ms'), '.2f')} | {f(r.get('experts_ms'), '.2f')} | {f(r.get('rest_ms'), '.2f')} | "
                     f"{f(r.get('peak_gib'), '.1f')} | {f(r.get('cache_gib'), '.2f')} | {r.get('experts') or ''} | "
                     f"{r.get('status', '')} |")
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
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="v2lite,v3", help="comma-separated: v2lite, v3")
    p.add_argument("--v3-layers", default="auto", help="decoder layers of the V3 shape (auto: as many as fit)")
    p.add_argument("--presets", default="bf16,snapmla")
    p.add_argument("--batches", default="32,128")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--paths", default="hf,loop")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared loop vs HF (0: no check)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--budget-s", type=float, default=420.0, help="start no cell after this many seconds")
    p.add_argument("--mem-frac", type=float, default=0.85, help="skip cells whose weights + cache exceed this "
                                                                 "fraction of GPU memory")
    p.add_argument("--no-split", action="store_true", help="skip the profiler step split")
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
        batches, contexts = _ints(args.batches), _ints(args.contexts)
        if args.new_tokens < 2:
            raise ConfigError("--new-tokens must be at least 2 (the first token is the prefill's)")
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
    if args.smoke:
        torch.set_num_threads(1)
        models = ["tiny"]
        batches = [2, 3] if args.batches == p.get_default("batches") else batches
        contexts = [16, 40] if args.contexts == p.get_default("contexts") else contexts
        args.new_tokens, args.check_tokens = min(args.new_tokens, 6), min(args.check_tokens, 5)
    dtype = torch.bfloat16 if cuda else torch.float32
    steps = "graph" if cuda else "static"
    backend = args.backend if cuda else "reference"
    out = Path(args.out)
    recorded = environment()
    env = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "git_commit": recorded.get("git_commit"), "dtype": str(dtype).replace("torch.", ""),
           "new_tokens": args.new_tokens, "backend": backend, "steps": steps, "smoke": args.smoke,
           "split_clock": "gpu kernels" if cuda else "cpu", "vocab": args.vocab,
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "environment": recorded}
    old = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    rows: list[dict] = list(old.get("rows", [])) if not args.smoke else []
    checks: list[dict] = list(old.get("checks", [])) if not args.smoke else []
    total_mem = torch.cuda.get_device_properties(0).total_memory if cuda else None

    def over_budget() -> bool:
        return time.perf_counter() - start > args.budget_s

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
        for preset in presets:
            snapquant.patch(model, preset, backend=backend)
            experts = plan_decode_experts(model).implementation
            if args.check_tokens and not over_budget():
                try:
                    c = check_paths(model, preset, batches[0], contexts[0], args.check_tokens, steps)
                    c["model"] = shape
                    checks = [x for x in checks if (x.get("model"), x["preset"]) != (shape, preset)] + [c]
                    print(f"[{time.perf_counter() - start:6.0f}s] check {shape} {preset}: {json.dumps(c)}", flush=True)
                except Exception as e:  # keep going: the timings are still worth having
                    print(f"check {shape} {preset} failed: {type(e).__name__}: {e}", flush=True)
            bpt = _bytes_per_token(preset, model)
            for B in batches:
                for L in contexts:
                    for path in paths:
                        row = {"model": shape, "layers": n_layers, "preset": preset, "batch": B, "context": L,
                               "path": path, "new_tokens": args.new_tokens, "experts": experts if path == "loop"
                               else "batched_mm (HF decode)" if cuda else experts_implementation(model)}
                        need = weights + bpt * B * (L + args.new_tokens) * n_layers
                        if total_mem is not None and need > args.mem_frac * total_mem:
                            row["status"] = f"skip: memory ({need / 2**30:.0f} GiB)"
                        elif over_budget():
                            row["status"] = "skip: budget"
                        else:
                            row.update(_measure(model, preset, B, L, path, args, steps, cuda))
                        rows = _merge(rows, [row])
                        print(f"[{time.perf_counter() - start:6.0f}s] {json.dumps(row)}", flush=True)
                        write_outputs(out, rows, checks, env)
            snapquant.unpatch(model)
        del model
        if cuda:
            torch.cuda.empty_cache()
    write_outputs(out, rows, checks, env)
    print(f"wrote {out.with_suffix('.md')} in {time.perf_counter() - start:.0f}s", flush=True)
    return 0


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
               "status": "ok"}
        if path == "loop" and not args.no_split:
            row.update(step_split(model, preset, B, L))
        return row
    except torch.cuda.OutOfMemoryError as e:
        return {"status": f"oom: {str(e)[:80]}"}
    finally:
        if cuda:
            torch.cuda.empty_cache()
