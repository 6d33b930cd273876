"""End-to-end decode step time: stock transformers vs snapquant-patched (bf16 and snapmla presets).

Model: decoder layers with DeepSeek-V2-Lite attention dimensions (hidden 2048, 16 heads, kv_lora_rank
512, qk_nope 128, qk_rope 64, v_head 128, no q-LoRA), dense MLP, random weights, a small vocabulary (the
LM head is not what is measured). The cache is filled directly with random latents of the right
statistics (RMS-normed latent ~ N(0, 1), RoPE key ~ N(0, 1)) instead of running a prefill, so long
contexts are cheap to set up; every timed step decodes one token at position L and the cache is cropped
back to L, so every step sees exactly L cached tokens.

Stock transformers caches the latent too, but re-projects every cached token through kv_b_proj at each
step (O(L r H (dn + dv)) work and a [B, H, L, 320] transient per layer); the patched model runs absorbed
MLA over the cached latent (O(L H (r + d))) through the snapquant backend seam (`--backend auto`: the
Triton kernel on CUDA where snapquant.kernels supports the config, else the PyTorch reference).

    python scripts/bench_e2e.py --threads 1                 # CPU: 2 layers, batch 1, L = 1K, 4K, 16K
    python scripts/bench_e2e.py --device cuda --layers 8 --batch 32 --contexts 8192,32768 \\
        --backend triton --graphs --out results/bench/e2e_h200.json      # the H200 run in results/
    python scripts/bench_e2e.py --device cuda --layers 8 --batch 32 --contexts 32768 --no-stock --graphs \\
        --presets bf16@flashmla,snapmla --backend triton --kv-budget-gib 16   # against FlashMLA (installed)

A variant is a preset on --backend or `preset@backend`: `bf16@flashmla` is the bf16 preset decoded by FlashMLA
(the anchor: every other variant's `speedup_vs_flashmla`, tokens/s over the anchor's in the same scenario,
context and mode, with a 95 % bootstrap interval over the steps and n). Scenario "batch" runs every variant at
--batch; with --kv-budget-gib, scenario "kv_budget" runs each at the largest batch whose KV cache fits the budget
(the 644-byte format fits 1.79x the requests of the 1152-byte one).

(scripts/bench_e2e.py is the command line; this module is its implementation.)

Per context and variant (stock, then each preset patched) it records the median step time (eager:
synchronised wall time; CUDA: events), decode tokens/s (batch / step time), the cache bytes and the
peak GPU memory of a step. On CUDA with --graphs each patched step is also captured in a CUDA graph over
a preallocated cache (`snapquant.graphs.DecodeGraph`) and timed by replay, and the sum of the GPU kernel
times of a step (torch.profiler) is set beside the step time: step / kernels close to 1 means the
step is not launch-bound. The largest context that fits `--budget-gib` of GPU memory per variant comes
from a straight-line fit of the measured peaks against L (every term, weights aside, is linear in L).
Writes --out (JSON, atomic, after every context: partial results survive), a CSV beside it and, on
CUDA, a plot (PNG + PDF). On a shared CPU box use --threads 1: the absorbed path is many small ops,
and with 2 OpenMP threads a busy neighbour stalls every parallel region.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from snapquant.atomic import atomic_save_figure, atomic_write_json, atomic_write_text
from snapquant.models.stepping import decode_step

R, D = 512, 64  # kv_lora_rank, qk_rope_head_dim (DeepSeek-V2-Lite)


def build_model(layers: int, dtype: torch.dtype, device: str, vocab: int):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=vocab, hidden_size=2048, intermediate_size=10944, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=R,
        qk_nope_head_dim=128, qk_rope_head_dim=D, v_head_dim=128, first_k_dense_replace=layers,
        max_position_embeddings=131072, pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV2ForCausalLM(cfg)
    return model.to(dtype).eval(), cfg


def fill_cache(cache, model, batch: int, length: int, dtype, device, seed: int = 1):
    """Write `length` random tokens into every MLA layer of `cache` (stock DynamicCache or LatentCache).
    Random numbers are drawn on the cache's device (CPU generation of 32 x 32K x 512 per layer is slow)."""
    from snapquant.cache import LatentCache

    g = torch.Generator(device=device).manual_seed(seed)
    for i in range(model.config.num_hidden_layers):
        latent = torch.randn(batch, 1, length, R, generator=g, device=device).to(dtype)
        rope = torch.randn(batch, 1, length, D, generator=g, device=device).to(dtype)
        if isinstance(cache, LatentCache):
            cache.layer(i, R, D).append(latent[:, 0], rope[:, 0])
        else:
            cache.update(latent, rope, i)
        del latent, rope
    return cache


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_eager(model, cache, batch: int, length: int, steps: int, warmup: int, device: str) -> list[float]:
    """Seconds per eager decode step at exactly `length` cached tokens (the cache is cropped back)."""
    ids = torch.full((batch, 1), 5, dtype=torch.long, device=device)
    pos = torch.full((batch, 1), length, dtype=torch.long, device=device)
    out = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            decode_step(model, ids, pos, cache)
        _sync(device)
        dt = time.perf_counter() - t0
        cache.crop(-1)  # back to exactly `length` cached tokens
        if i >= warmup:
            out.append(dt)
    return out


def eager_logits(model, cache, batch: int, length: int, device: str) -> torch.Tensor:
    ids = torch.full((batch, 1), 5, dtype=torch.long, device=device)
    with torch.no_grad():
        out = decode_step(model, ids, length, cache)
    cache.crop(-1)
    return out.logits.float()


def time_graph(graph, batch: int, steps: int, device: str) -> tuple[list[float], torch.Tensor]:
    """Seconds per replayed step (CUDA events around each step; wall time on CPU, where DecodeGraph
    runs the same fixed-shape step eagerly) and the last step's logits."""
    ids = torch.full((batch, 1), 5, dtype=torch.long, device=device)
    times = []
    logits = None
    for _ in range(steps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = graph.step(ids).clone()
            end.record()
            graph.rewind(1)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            logits = graph.step(ids).clone()
            times.append(time.perf_counter() - t0)
            graph.rewind(1)
    return times, logits.float()


def graph_timing(model, cache, batch: int, length: int, steps: int, device: str) -> tuple:
    """("graph", ms per replayed step, kernel ms per step, max |logit diff| / max |logit| vs eager, the replayed
    steps' seconds)."""
    from snapquant.graphs import DecodeGraph

    ref = eager_logits(model, cache, batch, length, device)
    graph = DecodeGraph(model, cache)
    times, logits = time_graph(graph, batch, 4 * steps, device)
    rel = float((logits - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    ids = torch.full((batch, 1), 5, dtype=torch.long, device=device)

    def graph_step() -> None:
        graph.step(ids)
        graph.rewind(1)

    kern = kernel_seconds_per_step(graph_step) * 1e3 if device.startswith("cuda") else None
    return "graph", statistics.median(times) * 1e3, kern, rel, times


def kernel_seconds_per_step(run_step, steps: int = 5) -> float:
    """Sum of the GPU activity (kernels, copies, memsets) of one step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    total_us = 0.0
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0.0)
        total_us += float(t)
    return total_us * 1e-6 / steps


def stock_cache_bytes(cache) -> int:
    n = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
    return n


def fit_max_context(points: list[tuple[int, float]], budget_bytes: float) -> int | None:
    """Largest L (a multiple of 64) with a + b L <= budget, from (L, peak bytes) points; None if < 2 points."""
    pts = sorted(set(points))
    if len(pts) < 2:
        return None
    (l0, p0), (l1, p1) = pts[0], pts[-1]
    slope = (p1 - p0) / (l1 - l0)
    if slope <= 0:
        return None
    return max(0, int((budget_bytes - (p0 - slope * l0)) / slope) // 64 * 64)


CSV_COLUMNS = ("scenario", "context", "batch", "variant", "backend", "mode", "ms_per_step", "tokens_per_s", "steps",
               "kernel_ms_per_step", "step_over_kernels", "speedup_vs_stock", "speedup_vs_patched_bf16",
               "speedup_vs_flashmla", "speedup_vs_flashmla_lo", "speedup_vs_flashmla_hi", "logits_rel_vs_eager",
               "cache_bytes", "bytes_per_token_layer", "peak_gib", "max_context_in_budget")
ANCHOR = "bf16@flashmla"  # the bf16 preset decoded by FlashMLA: what a vLLM / SGLang user runs on Hopper


def parse_variants(text: str, default_backend: str) -> list[tuple[str, str, str]]:
    """--presets as (name, preset, backend): "snapmla" runs on --backend, "bf16@flashmla" on FlashMLA.
    ConfigError (one line, naming the entry) for an unknown preset or backend."""
    from snapquant.attention.backends import check_backend_name
    from snapquant.errors import ConfigError
    from snapquant.presets import resolve_config

    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        preset, _, backend = item.partition("@")
        try:
            resolve_config(preset)
            check_backend_name(backend or default_backend)
        except ConfigError as e:
            raise ConfigError(f"--presets entry {item!r}: {e}") from None
        out.append((item, preset, backend or default_backend))
    if not out:
        raise ConfigError("--presets is empty; e.g. bf16@flashmla,snapmla")
    return out


def budget_batch(budget_gib: float, preset: str, layers: int, context: int, max_batch: int) -> int:
    """The largest batch whose KV cache (`context` + 1 tokens per request, every layer, the format's own
    bytes per token) fits `budget_gib`; at most `max_batch`."""
    from snapquant.presets import resolve_config
    from snapquant.quant import bytes_per_token

    per_request = layers * (context + 1) * bytes_per_token(resolve_config(preset), R, D)
    return max(0, min(max_batch, int(budget_gib * 2**30 // per_request)))


def compare_to_anchor(rows: list[dict], anchor_samples: dict, samples: dict) -> list[dict]:
    """speedup_vs_flashmla = tokens/s of the row / tokens/s of the `ANCHOR` row of the same scenario, context and
    mode (ratio of the medians over steps; batches may differ: the memory-budget scenario), and its 95 %
    percentile-bootstrap interval over the two sets of step samples (timing noise of this process only);
    returns one summary entry per comparison. anchor_samples: (scenario, context, mode) -> (step seconds,
    batch); samples: ((scenario, context, mode), variant) -> step seconds."""
    from .results import ratio_interval

    out = []
    for r in rows:
        key = (r.get("scenario"), r["context"], r["mode"])
        a = anchor_samples.get(key)
        mine = samples.get((key, r["variant"]))
        if a is None or mine is None or r["variant"] == ANCHOR:
            continue
        a_s, batch_a = a
        num, den = [r["batch"] / x for x in mine], [batch_a / x for x in a_s]  # tokens/s per step
        r["speedup_vs_flashmla"] = statistics.median(num) / statistics.median(den)
        ci = ratio_interval(num, den)
        if ci is not None:
            r["speedup_vs_flashmla_lo"], r["speedup_vs_flashmla_hi"] = ci
        out.append({"scenario": r.get("scenario"), "context": r["context"], "mode": r["mode"], "variant": r["variant"],
                    "batch": r["batch"], "anchor_batch": batch_a, "tokens_per_s": statistics.median(num),
                    "anchor_tokens_per_s": statistics.median(den), "speedup_vs_flashmla": r["speedup_vs_flashmla"],
                    "ci95": list(ci) if ci else None, "n": [len(num), len(den)]})
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def plot(path: Path, rows: list[dict], env: dict) -> None:
    """Decode tokens/s per context and variant (the faster of eager / graph, linear axis from 0, so bar heights
    compare as ratios) for each scenario present ('batch'; 'kv_budget' at each variant's own batch), and the
    largest context in --budget-gib when peaks at two or more contexts gave a fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r.get("scenario", "batch") for r in rows))
    caps_known = any(r.get("max_context_in_budget") for r in rows)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, len(scenarios) + caps_known, figsize=(5.5 * (len(scenarios) + caps_known), 4),
                             squeeze=False)
    w = 0.8 / len(variants)
    for ax, sc in zip(axes[0], scenarios, strict=False):
        mine = [r for r in rows if r.get("scenario", "batch") == sc]
        contexts = sorted({r["context"] for r in mine})
        best = {}  # (context, variant) -> the faster of eager / graph
        for r in mine:
            k = (r["context"], r["variant"])
            if k not in best or r["tokens_per_s"] > best[k]["tokens_per_s"]:
                best[k] = r
        for i, v in enumerate(variants):
            ys = [best.get((c, v), {}).get("tokens_per_s", 0) for c in contexts]
            xs = [j + i * w for j in range(len(contexts))]
            bars = ax.bar(xs, ys, w, label=v, color=f"C{i}")
            for b, c in zip(bars, contexts, strict=True):
                r = best.get((c, v), {})
                ax.annotate(f"{r.get('mode', '')}, batch {r.get('batch', '')}",
                            (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(contexts))], [f"L={c // 1024}K" for c in contexts])
        ax.set_ylabel("decode tokens/s (batch / step time)")
        ax.set_ylim(0, None)
        what = (f"batch {env['batch']}" if sc == "batch" else
                f"equal KV-cache memory ({env.get('kv_budget_gib')} GiB)")
        ax.set_title(f"{what}, {env['layers']} layers, {env['device']}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    if caps_known:
        ax2 = axes[0][-1]
        caps = [(v, max((r.get("max_context_in_budget") or 0) for r in rows if r["variant"] == v)) for v in variants]
        ax2.bar([v for v, _ in caps], [c / 1024 for _, c in caps], color=[f"C{i}" for i in range(len(caps))])
        ax2.set_ylabel("largest context (K tokens)")
        ax2.set_title(f"fits {env['budget_gib']} GiB at batch {env['batch']} (linear fit of peaks)", fontsize=10)
    fig.tight_layout()
    for suffix in (".png", ".pdf"):
        atomic_save_figure(fig, path.with_suffix(suffix), dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,16384", help="comma-separated cached lengths L")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed eager steps (graph replays: 4x as many)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16")
    p.add_argument("--presets", default="bf16,snapmla",
                   help="variants: a preset, run on --backend, or preset@backend (bf16@flashmla: the bf16 preset on "
                        "FlashMLA, the anchor every other variant's speedup_vs_flashmla is measured against; list it "
                        "first)")
    p.add_argument("--backend", default="auto", help="snapquant decode backend: auto, reference, triton or another "
                                                    "registered one")
    p.add_argument("--kernel-options", default=None,
                   help="the decode kernels' knobs passed to snapquant.patch: key=value,... (e.g. num_splits=8)")
    p.add_argument("--graphs", action="store_true",
                   help="also time DecodeGraph steps: captured CUDA graphs on CUDA, the same fixed-shape step on CPU")
    p.add_argument("--no-stock", action="store_true", help="skip stock transformers")
    p.add_argument("--budget-gib", type=float, default=64.0, help="memory budget for the largest-context column")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="also run each variant at the largest batch whose KV cache (context + 1 tokens, every layer) "
                        "fits this many GiB (scenario 'kv_budget'; the default scenario is 'batch', at --batch)")
    p.add_argument("--max-batch", type=int, default=256, help="cap of the kv-budget batch")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--out", default="results/bench_e2e.json")
    args = p.parse_args(argv)

    from snapquant.attention import flashmla
    from snapquant.attention.backends import check_kernel_options, kernel_options_from_text
    from snapquant.errors import ConfigError

    try:  # bad options are one line before any model is built
        kernel_options = kernel_options_from_text(args.kernel_options) if args.kernel_options else None
        check_kernel_options(args.backend, kernel_options)
        variants = parse_variants(args.presets, args.backend)
        if args.kv_budget_gib is not None and not args.kv_budget_gib > 0:
            raise ConfigError(f"--kv-budget-gib={args.kv_budget_gib} is not valid; expected a positive number of GiB")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from transformers import DynamicCache

    import snapquant
    from snapquant.cache import LatentCache
    from snapquant.environment import environment

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cuda = device.startswith("cuda")
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",") if x]
    presets = [name for name, _, _ in variants]
    model, _ = build_model(args.layers, dtype, device, args.vocab)
    env = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", ""),
        "layers": args.layers, "batch": args.batch, "steps": args.steps, "backend": args.backend,
        "kernel_options": kernel_options or {},
        "graphs": args.graphs, "budget_gib": args.budget_gib, "kv_budget_gib": args.kv_budget_gib,
        "model": "DeepSeek-V2-Lite attention dims (H=16, r=512, d=64, dn=128, dv=128), dense MLP, random weights",
        "seeds": {"weights": 0, "cache": 1}, "contexts": contexts, "presets": presets,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    print(json.dumps(env), flush=True)
    recorded = environment()  # python, package versions, hardware, commit
    env["git_commit"] = recorded["git_commit"]
    env["environment"] = recorded  # into the JSON only
    out_path = Path(args.out)
    rows: list[dict] = []
    peaks: dict[str, list[tuple[int, float]]] = {}

    def record(row: dict, peak: float | None) -> None:
        if peak is not None:
            row["peak_gib"] = peak / 2**30
            peaks.setdefault(row["variant"], []).append((row["context"], peak))
        rows.append(row)
        print(json.dumps(row), flush=True)

    def measure_peak(run_once) -> float | None:
        if not cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run_once()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated())

    samples: dict = {}  # ((scenario, context, mode), variant) -> step seconds
    anchor_samples: dict = {}  # (scenario, context, mode) -> (step seconds, batch) of the ANCHOR variant
    comparisons: list[dict] = []
    for L in contexts:
        stock_ms = None
        if not args.no_stock:
            snapquant.unpatch(model)
            cache = fill_cache(DynamicCache(config=model.config), model, args.batch, L, dtype, device)
            t = time_eager(model, cache, args.batch, L, args.steps, args.warmup, device)
            peak = measure_peak(lambda c=cache, n=L: time_eager(model, c, args.batch, n, 1, 0, device))
            stock_ms = statistics.median(t) * 1e3
            row = {"scenario": "batch", "context": L, "batch": args.batch, "variant": "stock", "mode": "eager",
                   "ms_per_step": stock_ms, "ms_per_token": stock_ms / args.batch,
                   "tokens_per_s": args.batch / (stock_ms * 1e-3), "steps": len(t),
                   "cache_bytes": stock_cache_bytes(cache),
                   "bytes_per_token_layer": stock_cache_bytes(cache) / (L * args.batch * args.layers)}
            if cuda:
                row["kernel_ms_per_step"] = kernel_seconds_per_step(
                    lambda c=cache, n=L: time_eager(model, c, args.batch, n, 1, 0, device), steps=2) * 1e3
                row["step_over_kernels"] = stock_ms / row["kernel_ms_per_step"]
            record(row, peak)
            del cache
        scenarios = [("batch", {name: args.batch for name, _, _ in variants})]
        if args.kv_budget_gib is not None:
            scenarios.append(("kv_budget", {name: budget_batch(args.kv_budget_gib, preset, args.layers, L, args.max_batch)
                                            for name, preset, _ in variants}))
        for scenario, batches in scenarios:
            bf16_ms: dict[str, float] = {}
            for name, preset, backend in variants:
                batch = batches[name]
                if batch < 1:
                    print(f"[{scenario} L={L}] {name}: no request fits {args.kv_budget_gib} GiB of KV cache", flush=True)
                    continue
                if backend == "flashmla" and not flashmla.available():
                    print(f"[{scenario} L={L}] {name}: {flashmla.NOT_INSTALLED}", flush=True)
                    env.setdefault("skipped", []).append(f"{name}: {flashmla.NOT_INSTALLED}")
                    continue
                snapquant.patch(model, preset, backend=backend,
                                kernel_options=kernel_options if backend == args.backend else None)
                cache_kw = {"max_cache_len": L + 64} if args.graphs else {}
                # FlashMLA reads latent and RoPE from one row: the joint layout lets it read the cache in place
                cache = LatentCache(preset, model, joint_rows=backend == "flashmla", **cache_kw)
                cache = fill_cache(cache, model, batch, L, dtype, device)
                t = time_eager(model, cache, batch, L, args.steps, args.warmup, device)
                eager_ms = statistics.median(t) * 1e3
                peak = measure_peak(lambda c=cache, n=L, b=batch: time_eager(model, c, b, n, 1, 0, device))
                base = {"scenario": scenario, "context": L, "batch": batch, "variant": name, "backend": backend,
                        "cache_bytes": cache.nbytes(), "bytes_per_token_layer": cache.bytes_per_token()}
                timed = [("eager", eager_ms, None, None, t)]
                if args.graphs:
                    try:
                        timed.append(graph_timing(model, cache, batch, L, args.steps, device))
                    except Exception as e:  # keep the eager numbers and the other variants
                        import traceback

                        traceback.print_exc()
                        base["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                for mode, ms, kern, rel, secs in timed:
                    row = dict(base, mode=mode, ms_per_step=ms, ms_per_token=ms / batch,
                               tokens_per_s=batch / (ms * 1e-3), steps=len(secs))
                    if kern is not None:
                        row.update(kernel_ms_per_step=kern, step_over_kernels=ms / kern)
                    if rel is not None:
                        row["logits_rel_vs_eager"] = rel
                    if stock_ms is not None and batch == args.batch:
                        row["speedup_vs_stock"] = stock_ms / ms
                        row["stock_over_patched"] = stock_ms / ms  # name kept from the CPU results
                    if name == "bf16":
                        bf16_ms[mode] = ms
                    elif mode in bf16_ms and batch == batches.get("bf16"):  # same mode and batch
                        row["speedup_vs_patched_bf16"] = bf16_ms[mode] / ms
                    key = (scenario, L, mode)
                    samples[(key, name)] = list(secs)
                    if name == ANCHOR:
                        anchor_samples[key] = (list(secs), batch)
                    record(row, peak if mode == "eager" and scenario == "batch" else None)
                del cache
                snapquant.unpatch(model)
        snapquant.unpatch(model)
        comparisons = compare_to_anchor(rows, anchor_samples, samples)
        env["comparisons"] = comparisons
        budget = args.budget_gib * 2**30
        for r in rows:
            r["max_context_in_budget"] = fit_max_context(peaks.get(r["variant"], []), budget)
        atomic_write_json(out_path, {"env": env, "rows": rows}, indent=2)  # after every context: partial results survive
        write_csv(out_path.with_suffix(".csv"), rows)

    if cuda:
        plot(out_path.with_suffix(".png"), rows, env)
    for c in comparisons:
        ci = f" [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]" if c["ci95"] else ""
        print(f"{c['scenario']} L={c['context']} {c['mode']}: {c['variant']} (batch {c['batch']}) "
              f"{c['tokens_per_s']:.0f} tok/s vs {ANCHOR} (batch {c['anchor_batch']}) {c['anchor_tokens_per_s']:.0f} "
              f"tok/s: x{c['speedup_vs_flashmla']:.3f}{ci} (95 % bootstrap, n = {c['n'][0]} / {c['n'][1]} steps)")
    print()
    print(f"{'scenario':>9} {'B':>4} {'L':>6} {'variant':>13} {'mode':>6} {'ms/step':>9} {'tok/s':>9} {'kern ms':>8} "
          f"{'step/kern':>9} {'vs stock':>8} {'vs bf16':>8} {'vs FlashMLA':>11} {'B/tok/layer':>11} {'max L':>8}")
    for r in rows:
        def f(k, fmt, r=r):
            return format(r[k], fmt) if r.get(k) is not None else ""
        print(f"{r.get('scenario', ''):>9} {r.get('batch', ''):>4} {r['context']:>6} {r['variant']:>13} {r['mode']:>6} "
              f"{f('ms_per_step', '.2f'):>9} {f('tokens_per_s', '.0f'):>9} {f('kernel_ms_per_step', '.2f'):>8} "
              f"{f('step_over_kernels', '.2f'):>9} {f('speedup_vs_stock', '.2f'):>8} "
              f"{f('speedup_vs_patched_bf16', '.2f'):>8} {f('speedup_vs_flashmla', '.3f'):>11} "
              f"{f('bytes_per_token_layer', '.1f'):>11} {f('max_context_in_budget', 'd'):>8}")
    return 0

