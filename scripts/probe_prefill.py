"""Where a batch's prefill goes on one GPU, operator by operator, and the fused MoE combine at its real shape.

The end-to-end generation target at batch 128 (lm-eval `generate_until`, 1K prompts) is missed by the
prefill: ~2 s of a ~7.4 s batch, of which the GEMMs are well under half. Two questions, one device call:

1. The MoE combine (`kernels.triton.expert_combine`): at the DeepSeek-V2-Lite prefill shape (T = 131072
   tokens, k = 6, H = 2048) and at decode shapes, does its fp32 sum give the bits of the torch expression
   transformers uses, in which summation order, and how long do the two take (GB/s of the bytes each must move)?
2. The whole prefill (V2-Lite shape, 27 layers, random bf16 weights, `--batch` x `--prompt` tokens, snapmla
   and bf16 presets): wall seconds with the fused combine on and off (same logits bits expected), and the
   CUDA time per aten operator (with input shapes) of one prefill under torch.profiler.

Usage (CUDA):  python scripts/probe_prefill.py --out results/h100/probe_prefill_h100.json   (name the GPU)
               python scripts/probe_prefill.py --smoke --out /tmp/probe_prefill.json           (CPU, tiny)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapquant.atomic import atomic_write_json
from snapquant.environment import environment


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, dev: str, reps: int = 10) -> float:
    """Median wall ms of `reps` calls after one warm-up (CUDA events on the GPU)."""
    fn()
    out = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append((time.perf_counter() - t0) * 1e3)
    out.sort()
    return out[len(out) // 2]


def combine_rows(dev: str, shapes: list[tuple[int, int, int]]) -> list[dict]:
    from snapquant.kernels.triton.expert_combine import combine_slots, combine_slots_reference

    rows = []
    for T, k, H in shapes:
        rows.append(_combine_row(dev, T, k, H, combine_slots, combine_slots_reference))
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def _combine_row(dev: str, T: int, k: int, H: int, combine_slots, combine_slots_reference) -> dict:
    g = torch.Generator(device=dev).manual_seed(T)
    y = torch.randn(T * k, H, device=dev, generator=g).to(torch.bfloat16)
    pos = torch.randperm(T * k, device=dev, generator=g)
    w = torch.rand(T, k, device=dev, generator=g)

    def stock():
        return (y.index_select(0, pos).view(T, k, H) * w.unsqueeze(-1)).sum(dim=1)

    ref32 = stock()
    ref = ref32.to(torch.bfloat16)
    row: dict = {"T": T, "k": k, "H": H}
    for order in ("sequential", "lanes4"):
        r32 = combine_slots_reference(y, pos, w, torch.float32, order)
        row[f"fp32_equal_{order}"] = float((r32.view(torch.int32) == ref32.view(torch.int32)).float().mean())
        fused = combine_slots(y, pos, w, torch.bfloat16, order)
        row[f"kernel_bf16_equal_{order}"] = float((fused.view(torch.int16) == ref.view(torch.int16)).float().mean())
        row[f"kernel_vs_reference_{order}"] = bool(torch.equal(fused, r32.to(torch.bfloat16)))
        del r32, fused
    del ref32, ref
    moved_stock = T * k * H * (2 + 2 + 2 + 4 + 4) + T * H * (4 + 4 + 2)  # gather, promote+mul, sum, cast
    moved_fused = T * k * H * 2 + T * H * 2
    row["stock_ms"] = time_ms(lambda: stock().to(torch.bfloat16), dev)
    row["fused_ms"] = time_ms(lambda: combine_slots(y, pos, w, torch.bfloat16), dev)
    row["stock_gbs"] = moved_stock / row["stock_ms"] / 1e6
    row["fused_gbs"] = moved_fused / row["fused_ms"] / 1e6
    print(json.dumps(row), flush=True)
    return row


VARIANTS = (("stock", False, False), ("combine", True, False), ("combine_gate", True, True))  # fused kernels on


def gate_rows(dev: str, shapes: list[tuple[int, int]]) -> list[dict]:
    """The fused gate against transformers' default gate: bits and time, bf16, at decode and prefill sizes."""
    from transformers.integrations.moe import _default_apply_gate

    from snapquant.kernels.triton.expert_gate import silu_mul

    class _Experts(torch.nn.Module):
        act_fn = torch.nn.SiLU()

    mod = _Experts()
    rows = []
    for R, N in shapes:
        g = torch.Generator(device=dev).manual_seed(R)
        gu = (torch.randn(R, 2 * N, device=dev, generator=g) * 4).to(torch.bfloat16)
        row = {"R": R, "N": N, "bits_equal": bool(torch.equal(silu_mul(gu), _default_apply_gate(mod, gu)))}
        row["stock_ms"] = time_ms(lambda gu=gu: _default_apply_gate(mod, gu), dev)
        row["fused_ms"] = time_ms(lambda gu=gu: silu_mul(gu), dev)
        row["fused_gbs"] = R * N * 6 / row["fused_ms"] / 1e6
        print(json.dumps(row), flush=True)
        rows.append(row)
        del gu
    return rows


def prefill_rows(dev: str, shape: str, layers: int | None, batch: int, prompt: int, presets: list[str],
                 profile: bool) -> list[dict]:
    import snapquant
    from snapquant.bench.eval_gen import build_model
    from snapquant.cache import LatentCache
    from snapquant.models import experts
    from snapquant.models.stepping import cache_kwarg

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    vocab = 102400 if shape == "v2lite" else 512
    model = build_model(shape, layers, dtype, dev, vocab)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(dev)
    rows = []
    for preset in presets:
        snapquant.patch(model, preset)

        def prefill(preset=preset):
            with torch.no_grad(), experts.decode_experts(model):
                return model(input_ids=ids, use_cache=True, logits_to_keep=1,
                             **{cache_kwarg(model): LatentCache(preset, model)}).logits

        row: dict = {"preset": preset, "batch": batch, "prompt": prompt, "model": shape}
        logits = {}
        for name, combine, gate in VARIANTS:
            experts.FUSED_COMBINE, experts.FUSED_GATE = combine, gate
            logits[name] = prefill().float()
            row[f"prefill_ms_{name}"] = time_ms(prefill, dev, reps=3)
        experts.FUSED_COMBINE = experts.FUSED_GATE = True
        for name, _, _ in VARIANTS[1:]:
            row[f"logits_equal_{name}_vs_stock"] = bool(torch.equal(logits["stock"], logits[name]))
            row[f"logits_max_abs_diff_{name}"] = float((logits["stock"] - logits[name]).abs().max())
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            with torch_profile(activities=acts, record_shapes=True) as prof:
                prefill()
                sync(dev)
            attr = "self_device_time_total" if dev == "cuda" else "self_cpu_time_total"
            ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
            ops.sort(key=lambda e: getattr(e, attr), reverse=True)
            total = sum(getattr(e, attr) for e in ops)
            row["op_total_ms"] = total / 1e3
            row["ops"] = [{"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count,
                           "ms": getattr(e, attr) / 1e3} for e in ops[:40]]
            kern = [e for e in prof.key_averages() if dev == "cuda" and e.device_type.name == "CUDA"]
            kern.sort(key=lambda e: e.self_device_time_total, reverse=True)
            row["kernels"] = [{"kernel": e.key[:90], "calls": e.count, "ms": e.self_device_time_total / 1e3}
                              for e in kern[:25]]
        print(json.dumps({k: v for k, v in row.items() if k not in ("ops", "kernels")}), flush=True)
        for o in row.get("ops", [])[:25]:
            print(f"  {o['ms']:9.2f} ms {o['calls']:5d}  {o['op']:34s} {o['shapes']}", flush=True)
        rows.append(row)
        snapquant.unpatch(model)
        del logits
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny model, small shapes")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--presets", default="snapmla,bf16")
    p.add_argument("--no-profile", action="store_true")
    a = p.parse_args(argv)
    dev = "cpu" if a.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("probe_prefill: no CUDA device (use --smoke on CPU)")
        return 2
    torch.manual_seed(0)
    out: dict = {"env": environment(), "command": " ".join(sys.argv)}
    shapes = [(5, 6, 64), (37, 6, 256)] if a.smoke else [(1, 6, 2048), (32, 6, 2048), (128, 6, 2048),
                                                          (4096, 6, 2048), (131072, 6, 2048)]
    out["combine"] = combine_rows(dev, shapes)
    out["gate"] = gate_rows(dev, [(5, 64), (300, 256)] if a.smoke else [(768, 1408), (786432, 1408)])
    atomic_write_json(Path(a.out), out)
    if a.smoke:
        out["prefill"] = prefill_rows(dev, "tiny", None, 2, 16, a.presets.split(","), not a.no_profile)
    else:
        out["prefill"] = prefill_rows(dev, "v2lite", None, a.batch, a.prompt, a.presets.split(","),
                                      not a.no_profile)
    atomic_write_json(Path(a.out), out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
