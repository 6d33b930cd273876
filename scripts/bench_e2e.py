#!/usr/bin/env python
"""End-to-end decode step time: stock transformers vs snapquant-patched (bf16 and snapmla presets).

Model: a few decoder layers with DeepSeek-V2-Lite attention dimensions (hidden 2048, 16 heads,
kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, no q-LoRA), dense MLP, random weights, a small
vocabulary (the LM head is not what is measured). The cache is filled directly with random latents of
the right statistics (RMS-normed latent ~ N(0, 1), RoPE key ~ N(0, 1)) instead of running a prefill,
so long contexts are cheap to set up; each timed step decodes one token at position L and the cache is
cropped back to L, so every step sees exactly L cached tokens.

Stock transformers re-projects every cached token through kv_b_proj at each step (O(L * r * H * (dn + dv)));
the patched model runs absorbed MLA over the cached latent (O(L * H * (r + d))), so the ratio grows
with L. Times are medians of `--steps` steps after `--warmup` (CUDA: synchronised wall time).

    python scripts/bench_e2e.py --threads 1            # CPU: 2 layers, batch 1, L = 1K, 4K, 16K
    python scripts/bench_e2e.py --device cuda --layers 4 --batch 8 --dtype bfloat16
Writes the rows to --out (JSON, atomic, after every context) and prints a table with ms/token, cache
bytes and the ratios. On a shared CPU box use --threads 1: the absorbed path is many small ops, and
with 2 OpenMP threads a busy neighbour stalls every parallel region (10 ms for a 16x512x64 bmm).
The patched decode runs through the snapquant backend seam (`--backend auto`: the Triton kernel on
CUDA when snapquant.kernels supports the config, else the PyTorch reference, which loops over
64-token blocks in Python and is launch-bound on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_model(layers: int, dtype: torch.dtype, device: str, vocab: int):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=vocab, hidden_size=2048, intermediate_size=10944, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=layers,
        max_position_embeddings=32768, pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV2ForCausalLM(cfg)
    return model.to(dtype).eval(), cfg


def fill_cache(cache, model, batch: int, length: int, dtype, device, seed: int = 1):
    """Write `length` random tokens into every MLA layer of `cache` (stock DynamicCache or LatentCache)."""
    from snapquant.cache import LatentCache

    g = torch.Generator(device="cpu").manual_seed(seed)
    for i in range(model.config.num_hidden_layers):
        latent = torch.randn(batch, 1, length, 512, generator=g).to(device=device, dtype=dtype)
        rope = torch.randn(batch, 1, length, 64, generator=g).to(device=device, dtype=dtype)
        if isinstance(cache, LatentCache):
            cache.layer(i, 512, 64).append(latent[:, 0], rope[:, 0])
        else:
            cache.update(latent, rope, i)
    return cache


def time_steps(model, cache, batch: int, length: int, steps: int, warmup: int, device: str) -> list[float]:
    ids = torch.full((batch, 1), 5, dtype=torch.long, device=device)
    pos = torch.full((batch, 1), length, dtype=torch.long, device=device)
    mask = torch.ones(batch, length + 1, dtype=torch.long, device=device)
    import inspect

    ck = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    for i in range(warmup + steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{ck: cache})
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        cache.crop(-1)  # back to exactly `length` cached tokens
        if i >= warmup:
            out.append(dt)
    return out


def stock_cache_bytes(cache) -> int:
    n = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
    return n


def write_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,16384", help="comma-separated cached lengths L")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16")
    p.add_argument("--presets", default="bf16,snapmla")
    p.add_argument("--backend", default="auto", help="snapquant decode backend: auto | reference | triton")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--out", default="results/bench_e2e.json")
    args = p.parse_args(argv)

    from transformers import DynamicCache

    import snapquant
    from snapquant.cache import LatentCache
    from snapquant.sweep.env import environment

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",") if x]
    presets = [x for x in args.presets.split(",") if x]
    model, _ = build_model(args.layers, dtype, device, args.vocab)
    env = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", ""),
        "layers": args.layers, "batch": args.batch, "steps": args.steps, "backend": args.backend,
        "model": "DeepSeek-V2-Lite attention dims (H=16, r=512, d=64, dn=128, dv=128), dense MLP, random weights",
        "seeds": {"weights": 0, "cache": 1}, "contexts": contexts, "presets": presets,
    }
    print(json.dumps(env), flush=True)
    env["environment"] = environment()  # python, package versions, hardware (into the JSON only)
    rows = []
    for L in contexts:
        snapquant.unpatch(model)
        cache = fill_cache(DynamicCache(config=model.config), model, args.batch, L, dtype, device)
        t = time_steps(model, cache, args.batch, L, args.steps, args.warmup, device)
        stock = {"context": L, "variant": "stock", "ms_per_token": statistics.median(t) * 1e3 / args.batch,
                 "ms_per_step": statistics.median(t) * 1e3, "cache_bytes": stock_cache_bytes(cache),
                 "bytes_per_token_layer": stock_cache_bytes(cache) / (L * args.batch * args.layers)}
        rows.append(stock)
        print(json.dumps(stock), flush=True)
        del cache
        for preset in presets:
            snapquant.patch(model, preset, backend=args.backend)
            cache = fill_cache(LatentCache(preset, model), model, args.batch, L, dtype, device)
            t = time_steps(model, cache, args.batch, L, args.steps, args.warmup, device)
            row = {"context": L, "variant": preset, "ms_per_token": statistics.median(t) * 1e3 / args.batch,
                   "ms_per_step": statistics.median(t) * 1e3, "cache_bytes": cache.nbytes(),
                   "bytes_per_token_layer": cache.bytes_per_token(),
                   "stock_over_patched": stock["ms_per_step"] / (statistics.median(t) * 1e3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del cache
        snapquant.unpatch(model)
        write_atomic(Path(args.out), {"env": env, "rows": rows})  # after every context: partial results survive

    print()
    print(f"{'L':>6} {'variant':>9} {'ms/token':>10} {'cache MB':>9} {'B/tok/layer':>11} {'stock/patched':>13}")
    for r in rows:
        ratio = f"{r['stock_over_patched']:.2f}x" if "stock_over_patched" in r else ""
        print(f"{r['context']:>6} {r['variant']:>9} {r['ms_per_token']:>10.2f} {r['cache_bytes'] / 2**20:>9.2f} "
              f"{r['bytes_per_token_layer']:>11.1f} {ratio:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
