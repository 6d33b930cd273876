"""Time the parts a MoE decode step and a batched prefill are made of, in isolation, on one GPU.

Two questions the end-to-end generation benchmark (`scripts/bench_eval.py`) cannot answer by itself:

1. Experts: does `torch.nn.functional.grouped_mm` read the expert weights at the read bandwidth when its
   B operand is HF's layout seen transposed (`[E, N, K]` contiguous, passed as a `[E, K, N]` view, what
   `snapquant.models.experts` does), or only when B is contiguous in `[E, K, N]`? Rows: V2-Lite's and V3's
   expert shapes at 32 and 128 tokens x top-k pairs, uniform routing, GB/s of the weights of the experts hit.
2. Prefill attention: which SDPA backend runs a DeepSeek prefill (q/k head dim 192, v 128) with HF's 4D
   boolean mask (left padding) and with `is_causal`, and at what TFLOP/s.

Usage (CUDA):  python scripts/probe_step_parts.py --out results/h100/probe_step_h100.json   (name the GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapquant.environment import environment

DEV = "cuda"
EXPERT_SHAPES = {"v2lite": (64, 6, 2048, 1408), "v3": (256, 8, 7168, 2048)}  # E, k, hidden, intermediate


def time_ms(fn, reps: int = 30) -> float:
    """Median of `reps` CUDA-event timings after 3 warm-up calls (wall clock in --smoke on CPU)."""
    for _ in range(3):
        fn()
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    out: list[float] = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    out.sort()
    return out[len(out) // 2]


def read_bandwidth() -> float:
    x = torch.empty(1 << (20 if DEV == "cpu" else 31), dtype=torch.bfloat16, device=DEV).normal_()
    ms = time_ms(lambda: x.sum(), reps=10)
    return x.numel() * 2 / ms / 1e6  # GB/s


def expert_rows(name: str, tokens: int, gen: torch.Generator) -> list[dict]:
    E, k, Hd, inter = EXPERT_SHAPES[name]
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).to(DEV)
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E).to(torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    hit = int((counts > 0).sum())
    x = torch.randn(tokens * k, Hd, device=DEV, dtype=torch.bfloat16)[order // k]
    rows = []
    # HF's storage: gate_up [E, 2I, H] and down [E, H, I], contiguous.
    up_hf = torch.randn(E, 2 * inter, Hd, device=DEV, dtype=torch.bfloat16) * 0.02
    down_hf = torch.randn(E, Hd, inter, device=DEV, dtype=torch.bfloat16) * 0.02
    layouts = {"hf_view": (up_hf.transpose(1, 2), down_hf.transpose(1, 2)),
               "kn_contiguous": (up_hf.transpose(1, 2).contiguous(), down_hf.transpose(1, 2).contiguous())}
    ref = None
    for layout, (w_up, w_down) in layouts.items():
        def step(w_up=w_up, w_down=w_down):
            h = F.grouped_mm(x, w_up, offs=offs)
            g, u = h.chunk(2, dim=-1)
            return F.grouped_mm(F.silu(g) * u, w_down, offs=offs)
        out = step()
        ref = out if ref is None else ref
        same = bool(torch.equal(out, ref))
        ms = time_ms(step)
        ms_up = time_ms(lambda w_up=w_up: F.grouped_mm(x, w_up, offs=offs))
        wbytes = hit * 3 * inter * Hd * 2
        rows.append({"part": "experts", "model": name, "tokens": tokens, "pairs": tokens * k, "experts_hit": hit,
                     "b_layout": layout, "ms": round(ms, 4), "gate_up_ms": round(ms_up, 4),
                     "weights_gb": round(wbytes / 1e9, 3), "gb_per_s": round(wbytes / ms / 1e6, 1),
                     "equal_to_hf_view": same})
    del layouts, up_hf, down_hf
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def sdpa_rows(batch: int, seq: int, heads: int = 16, pad: int = 64) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, heads, seq, 192, device=DEV, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(batch, heads, seq, 128, device=DEV, dtype=torch.bfloat16)
    # HF's left-padding mask: the first `pad` positions of every other request are padding.
    causal = torch.ones(seq, seq, dtype=torch.bool, device=DEV).tril()
    keep = torch.ones(batch, seq, dtype=torch.bool, device=DEV)
    keep[::2, :pad] = False
    mask = (causal[None] & keep[:, None, :])[:, None]
    mask = mask | torch.eye(seq, dtype=torch.bool, device=DEV)[None, None]  # no all-masked rows
    flops = 4 * batch * heads * seq * seq * (192 + 128) / 2 / 2  # causal half of QK and PV
    rows = []
    # "default": torch's own choice, what HF's sdpa attention gets.
    for name, allowed in (("default", None), *((b.name, [b]) for b in (
            SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION))):
        for kind, kw in (("is_causal", {"is_causal": True}), ("bool_mask", {"attn_mask": mask})):
            row = {"part": "prefill_sdpa", "batch": batch, "seq": seq, "heads": heads, "backend": name,
                   "mask": kind}
            try:
                with contextlib.nullcontext() if allowed is None else sdpa_kernel(allowed):
                    ms = time_ms(lambda kw=kw: F.scaled_dot_product_attention(q, k, v, **kw), reps=10)
                row.update(ms=round(ms, 3), tflop_per_s=round(flops / ms / 1e9, 1),
                           ms_x_layers27=round(ms * 27, 1))
            except RuntimeError as err:
                row["error"] = str(err).splitlines()[0][:160]
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON to write (name the GPU it runs on)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    args = ap.parse_args()
    global DEV
    if args.smoke:
        DEV = "cpu"
        EXPERT_SHAPES.clear()
        EXPERT_SHAPES["tiny"] = (8, 2, 64, 32)
    elif not torch.cuda.is_available():
        raise SystemExit("probe_step_parts.py: needs a CUDA device (or --smoke)")
    gen = torch.Generator().manual_seed(args.seed)
    rows = [{"part": "read_bandwidth", "gb_per_s": round(read_bandwidth(), 1)}]
    for name in EXPERT_SHAPES:
        for tokens in (32, 128):
            rows += expert_rows(name, tokens, gen)
    rows += sdpa_rows(4, 64, pad=8) if args.smoke else sdpa_rows(128, 1024)
    for r in rows:
        print(json.dumps(r))
    meta = environment()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "seed": args.seed, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
