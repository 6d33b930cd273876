"""Fit the reference's native FP8 MMA model to the native FP8 kernels on a Hopper GPU.

    python scripts/check_mma_numerics_gpu.py [--out results/kernels] [--quick] [--ref-device cuda|cpu]

The opt-in native FP8 kernels (`fp8_mma=True`: gluon.narrow8, 32 rows per program past 16 query rows and
16 at <= 16, and gluon.wide8, 64; `fp8_mma="qk"`: gluon.narrow's QK at <= 16 rows) run their products on
wgmma's e4m3 path, whose accumulation keeps only some bits (docs/numerics.md, "MMA numerics"). On random
snapmla caches (H = 64 and 128, and 16 for the <= 16-row kernels, fresh seeds, one KV split so that the
kernel's page order is the reference's) this compares each kernel's output with the reference run

  * with exact products (`mma="exact"`, the default kernels' arithmetic), and
  * with `mma="hopper_fp8"` over a grid: retained bits 12..16 x k-group 16 / 32 / 64 / 128 (accumulator
    aligned, truncation toward zero), then, at each kernel's best, the accumulator kept out of the
    alignment and truncation downward, and the grid again with the best of those (a coordinate search);

and reports, per (case, kernel, model): the bit-agreement rate (the fraction of output elements whose
bf16 roundings are bitwise equal), the per-row relative error (rel-L2 over a row's 512 channels: max and
median) and the largest LSE difference. The default exact kernels (gluon.wide, gluon.narrow) are compared with
the exact reference as the controls: their agreement is what summation order alone leaves. The best model per kernel
is the one with the highest mean agreement over the cases.

The reference runs on `--ref-device` (default cuda: the model's float64 sums take seconds there, minutes on
the CPU); a control row compares the CUDA reference with the CPU one on the first case, bit for bit.
Writes mma_numerics.csv and mma_numerics.md to --out. Without CUDA (or on a GPU that is not Hopper) it
says so and exits 0: there is nothing to measure.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch

from snapquant.atomic import atomic_write_text

R, D = 512, 64
TAU = 1 / math.sqrt(192)  # DeepSeek: 1 / sqrt(qk_nope + qk_rope)
# (B, H, L, seed): H = 64 / 128 for the kernels past 16 query rows, H = 16 for the <= 16-row ones
CASES = [(2, 64, 512, 0), (2, 64, 1024, 1), (1, 128, 512, 2), (1, 128, 1024, 3), (4, 16, 512, 4), (4, 16, 1024, 5)]
QUICK_CASES = [(1, 64, 256, 0), (1, 128, 256, 1), (2, 16, 256, 2)]
# name -> (knobs, the query rows it runs: "narrow" <= 16, "wide" past that, which products are native)
KERNELS = {"gluon.narrow8": ({"tile": "gluon", "fp8_mma": True, "block_m": 32}, "wide", "both"),
           "gluon.wide8": ({"tile": "gluon", "fp8_mma": True, "block_m": 64}, "wide", "both"),
           "gluon.wide (exact, control)": ({"tile": "gluon"}, "wide", "both"),
           "gluon.narrow8 (16 rows)": ({"tile": "gluon", "fp8_mma": True}, "narrow", "both"),
           "gluon.narrow (fp8_mma=qk)": ({"tile": "gluon", "fp8_mma": "qk"}, "narrow", "qk"),
           "gluon.narrow (exact, control)": ({"tile": "gluon"}, "narrow", "both")}
BITS, K_GROUPS = (12, 13, 14, 15, 16), (16, 32, 64, 128)
KEYS = ["case", "kernel", "model", "bits", "k_group", "align_accumulator", "truncation", "n_elements",
        "bit_agree", "row_rel_max", "row_rel_median", "lse_abs_max"]


def stage1_models(bits: tuple[int, ...] = BITS, k_groups: tuple[int, ...] = K_GROUPS) -> list:
    """The exact mode, then hopper_fp8 over bits x k-groups (accumulator aligned, truncation toward zero)."""
    from snapquant.reference.mma import MMANumerics

    return [MMANumerics()] + [MMANumerics(mode="hopper_fp8", bits=b, k_group=k) for b, k in itertools.product(
        bits, k_groups)]


def stage2_models(best) -> list:
    return [best.replace(align_accumulator=False), best.replace(truncation="down"),
            best.replace(align_accumulator=False, truncation="down")]


def model_name(m) -> str:
    if m.mode == "exact":
        return "exact"
    return (f"hopper_fp8 bits={m.bits} k={m.k_group}" + ("" if m.align_accumulator else " acc-fp32")
            + ("" if m.truncation == "toward_zero" else " down"))


def make_case(B: int, H: int, L: int, seed: int) -> dict:
    """A snapmla cache (filled by the kernels' own append), a bf16 query, every kernel's output."""
    from check_kernels_gpu import build_cache, sub_cache

    from snapquant import PRESETS
    from snapquant.kernels import mla_decode

    config = PRESETS["snapmla"]
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    cache = build_cache(config, B, L, g)
    q = torch.randn(B, 1, H, R + D, device="cuda", generator=g).to(torch.bfloat16)
    outs = {}
    for name, (knobs, rows, _) in KERNELS.items():
        if (rows == "narrow") == (H <= 16):
            out, lse = mla_decode(q, cache, TAU, config, num_splits=1, **knobs)
            outs[name] = (out.cpu(), lse.cpu())
    lengths = cache.lengths.cpu()
    kvs = [sub_cache(cache, [i]).to_quantized_kv(max(int(lengths[i]), 1)) for i in range(B)]
    return {"label": f"B={B} H={H} L={L} seed={seed}", "q": q, "kvs": kvs, "lengths": lengths, "config": config,
            "outs": outs}


def reference(case: dict, mma, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    from snapquant import mla_decode_reference

    outs, lses = [], []
    for i, kv in enumerate(case["kvs"]):  # one request at a time: each over its own length
        o, ls = mla_decode_reference(case["q"][i:i + 1].to(dev), kv.to(dev), case["lengths"][i:i + 1].to(dev), TAU,
                                     case["config"], mma=mma)
        outs.append(o.cpu())
        lses.append(ls.cpu())
    return torch.cat(outs), torch.cat(lses)


def compare(kernel: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Bit agreement after bf16 rounding and per-row residuals, over the rows that see a token."""
    (o, ls), (r, rl) = kernel, ref
    live = torch.isfinite(rl)
    o, r = o[live], r[live]  # [rows, 512]
    agree = (o.to(torch.bfloat16).view(torch.int16) == r.to(torch.bfloat16).view(torch.int16)).double().mean()
    row_rel = (o.double() - r.double()).norm(dim=-1) / r.double().norm(dim=-1).clamp_min(1e-30)
    return {"n_elements": o.numel(), "bit_agree": float(agree), "row_rel_max": float(row_rel.max()),
            "row_rel_median": float(row_rel.median()), "lse_abs_max": float((ls[live] - rl[live]).abs().max())}


def measure(cases: list[dict], models: list, dev: str, rows: list[dict]) -> None:
    """Each case's kernels against the reference under each model, the model's native products set to the
    kernel's (gluon.narrow's fp8_mma="qk" has exact PV)."""
    for case in cases:
        for m in models:
            refs: dict[str, tuple] = {}
            for kname, kout in case["outs"].items():
                if "control" in kname and m.mode != "exact":
                    continue
                products = KERNELS[kname][2]
                if products not in refs:
                    refs[products] = reference(case, m if m.mode == "exact" else m.replace(products=products), dev)
                ref = refs[products]
                rows.append({"case": case["label"], "kernel": kname, "model": model_name(m),
                             "bits": m.bits if m.mode != "exact" else None,
                             "k_group": m.k_group if m.mode != "exact" else None,
                             "align_accumulator": m.align_accumulator if m.mode != "exact" else None,
                             "truncation": m.truncation if m.mode != "exact" else None, **compare(kout, ref)})


def best_fit(rows: list[dict], kernel: str) -> tuple[str, float, float]:
    """(model, mean bit agreement, mean median row error) of the model that agrees most with `kernel`."""
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        if r["kernel"] == kernel:
            by_model.setdefault(r["model"], []).append(r)
    scored = [(sum(x["bit_agree"] for x in v) / len(v), -sum(x["row_rel_median"] for x in v) / len(v), k)
              for k, v in by_model.items()]
    agree, neg_rel, name = max(scored)
    return name, agree, -neg_rel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels", help="output directory")
    ap.add_argument("--quick", action="store_true", help="two small cases, bits 13..15, k-group 32 only")
    ap.add_argument("--ref-device", default="cuda", choices=("cuda", "cpu"), help="where the reference runs")
    args = ap.parse_args()
    return run(Path(args.out), args.quick, args.ref_device)


def run(out: Path, quick: bool = False, ref_device: str = "cuda") -> int:
    """The measurement (see the module docstring); 0 also when there is nothing to measure."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("mma numerics: skipped (needs a Hopper GPU: the native FP8 kernels are Gluon wgmma kernels)")
        return 0
    from snapquant.environment import device_environment
    from snapquant.reference.mma import MMANumerics

    grid = stage1_models((13, 14, 15), (32,)) if quick else stage1_models()
    torch.set_num_threads(os.cpu_count() or 1)  # the CPU control (and --ref-device cpu) is float64 elementwise work
    t0 = time.perf_counter()
    env = device_environment()
    cases = [make_case(*c) for c in (QUICK_CASES if quick else CASES)]
    rows: list[dict] = []
    control = reference(cases[0], MMANumerics(), "cpu")
    ref_dev = reference(cases[0], MMANumerics(), ref_device)
    rows.append({"case": cases[0]["label"], "kernel": f"reference on {ref_device}", "model": "exact (vs cpu)",
                 **compare(ref_dev, control)})
    measure(cases, grid, ref_device, rows)
    tried = {model_name(m): m for m in grid}
    for _ in range(2):  # coordinate search: (alignment, truncation) at the best grid point, then the grid again
        best = [tried[best_fit(rows, k)[0]] for k in KERNELS if "control" not in k]
        new = {model_name(m): m for b in best if b.mode != "exact" for m in stage2_models(b)}
        new.update({model_name(m): m for b in best if b.mode != "exact" for m in grid[1:]
                    for m in [m.replace(align_accumulator=b.align_accumulator, truncation=b.truncation)]})
        new = {k: m for k, m in new.items() if k not in tried}
        if not new:
            break
        measure(cases, list(new.values()), ref_device, rows)
        tried.update(new)
    seconds = time.perf_counter() - t0

    lines = [f"# Native FP8 MMA numerics against the reference's model on {env['gpu']}", "",
             f"{env['date']}; torch {env['torch']}, triton {env['triton']}, commit {env['git_commit']}; "
             f"{len(cases)} cases, reference on {ref_device}, {seconds:.0f} s. Bit agreement: fraction of output "
             "elements whose bf16 roundings are equal; row error: rel-L2 per output row.", "",
             "| kernel | best model | bit agreement | vs exact reference | median row error |", "|---|---|---|---|---|"]
    summary = []
    for kernel in KERNELS:
        name, agree, rel = best_fit(rows, kernel)
        exact = [r["bit_agree"] for r in rows if r["kernel"] == kernel and r["model"] == "exact"]
        exact_agree = sum(exact) / len(exact)
        lines.append(f"| {kernel} | {name} | {agree:.4f} | {exact_agree:.4f} | {rel:.2e} |")
        summary.append(f"{kernel}: {name} agrees {agree:.4f} (exact {exact_agree:.4f})")
    lines += ["", f"Control: the reference on {ref_device} against the CPU reference, bit agreement "
              f"{rows[0]['bit_agree']:.6f}.", "", "| " + " | ".join(KEYS) + " |", "|" + "---|" * len(KEYS)]

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))

    lines += ["| " + " | ".join(fmt(r.get(k)) for k in KEYS) + " |" for r in rows]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=KEYS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out / "mma_numerics.csv", buf.getvalue())
    atomic_write_text(out / "mma_numerics.md", "\n".join(lines) + "\n")
    print("\n".join(lines[:6 + len(KERNELS)]))
    print("mma numerics fit: " + "; ".join(summary) + f" ({seconds:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
