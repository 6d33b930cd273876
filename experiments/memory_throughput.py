"""Memory and throughput: cache bytes per token of every preset, and decode speed of the patched model.

1. memory: bytes per token per layer at the model's dims and at DeepSeek-V3's (512 / 64), the ratio
   to BF16, and tokens per GiB of cache for the whole model (all MLA layers);
2. throughput: median decode-step latency (tokens/s) of the unpatched model and of the patched
   model per preset, at several context lengths. On a CPU this times the pure-PyTorch reference
   backend, which is a correctness oracle, not a fast path: read those numbers as relative costs of
   the simulation. With a GPU the `auto` backend runs the Triton kernels.
Writes memory.md/.csv, throughput.md/.csv and memory_throughput.png/.pdf to runs/memory_throughput/
(the committed copy: --out results/memory_throughput).

    python experiments/memory_throughput.py [--model embedded|PATH] [--contexts 256 1024 2048]
"""

from __future__ import annotations

import statistics
import time

import pandas as pd
import torch
from _common import parser, read_table, write

from snapquant import PRESETS, ConfigError, bytes_per_token
from snapquant.analysis.experiment_plots import plot_memory_throughput
from snapquant.eval.model import load_model, model_info
from snapquant.patching import patched

SPEED_PRESETS = ("bf16", "snapmla", "snapmla_kv_only", "per_tensor_fp8", "ds_v32")


def memory_table(info: dict) -> pd.DataFrame:
    r, d, layers = info["kv_lora_rank"], info["qk_rope_head_dim"], info["num_mla_layers"]
    rows = []
    for name, cfg in PRESETS.items():
        try:
            b = bytes_per_token(cfg, r, d)
        except ConfigError:
            b = float("nan")
        try:
            ds = bytes_per_token(cfg, 512, 64)
        except ConfigError:
            ds = float("nan")
        rows.append({"preset": name, "bytes_per_token_layer": b, "ratio_vs_bf16": b / bytes_per_token(PRESETS["bf16"], r, d),
                     "tokens_per_gib_model": 2**30 / (b * layers), "deepseek_bytes_per_token_layer": ds,
                     "deepseek_v3_tokens_per_gib": 2**30 / (ds * 61)})
    return pd.DataFrame(rows)


def step_latency(model, ids: torch.Tensor, steps: int) -> float:
    """Median seconds of one greedy decode step after prefilling `ids` (two warm-up steps first)."""
    from snapquant.models.stepping import decode_steps

    outputs = decode_steps(model, ids, greedy_steps=steps + 2)
    next(outputs)  # the prefill
    times = []
    for i in range(steps + 2):
        if ids.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        next(outputs)  # one decode step (the next token was chosen before the previous step returned)
        if ids.is_cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = parser(__doc__.splitlines()[0], "memory_throughput")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    if args.replot:
        md = (args.out / "throughput.md").read_text() if (args.out / "throughput.md").is_file() else ""
        dev = next((w.rsplit(" on ", 1)[1] for w in md.splitlines()[:1] if " on " in w), "?")
        print(plot_memory_throughput(read_table(args.out, "memory"), read_table(args.out, "throughput"), dev, args.out))
        return
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    info = model_info(model)
    mem = memory_table(info)
    write(args.out, "memory", mem, f"KV-cache memory per preset: {args.model}",
          f"Model dims: kv_lora_rank {info['kv_lora_rank']}, RoPE {info['qk_rope_head_dim']}, "
          f"{info['num_mla_layers']} MLA layers. DeepSeek columns: 512 / 64 dims, 61 layers (DeepSeek-V3).", info)
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in args.contexts:
        ids = torch.randint(10, model.config.vocab_size, (args.batch, T), generator=g).to(dev)
        base = step_latency(model, ids, args.steps)
        rows.append({"config": "unpatched", "context": T, "batch": args.batch, "step_s": base,
                     "tokens_per_s": args.batch / base})
        for name in SPEED_PRESETS:
            try:
                with patched(model, PRESETS[name]):
                    t = step_latency(model, ids, args.steps)
            except ConfigError as e:
                print(f"skip {name}: {e}")
                continue
            rows.append({"config": name, "context": T, "batch": args.batch, "step_s": t, "tokens_per_s": args.batch / t})
            print(rows[-1])
    thr = pd.DataFrame(rows)
    write(args.out, "throughput", thr, f"Decode throughput: {args.model} on {dev}",
          "Median latency of one decode step (batch x 1 new token) after prefilling `context` random tokens; "
          "2 warm-up steps. On CPU the patched model runs the pure-PyTorch reference backend (an exact simulation, "
          "not an optimized kernel): compare configs with each other, not with the unpatched model.",
          {"steps": args.steps, "device": str(dev)})
    plot_memory_throughput(mem, thr, str(dev), args.out)
    print((args.out / "memory.md").read_text())
    print((args.out / "throughput.md").read_text())


if __name__ == "__main__":
    main()
