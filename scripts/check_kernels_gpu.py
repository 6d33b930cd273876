"""Check the Triton MLA kernels on a CUDA GPU at DeepSeek shapes against the PyTorch reference.

    python scripts/check_kernels_gpu.py [--out results/kernels] [--quick] [--no-bench]

What it checks (each case isolated: one failure never stops the others):
1. quantize-and-append, bit-exact against `snapquant.quantize_kv` run on CPU (snapmla, ds_v32, bf16
   layouts; r = 512, d = 64; bf16 and fp32 inputs; zero, tiny and huge rows).
2. decode: every supported combination (query bf16/fp8 x PV bf16/fp8-fused x snapmla/ds_v32 layouts,
   and the bf16 baseline) at H = 16 with s_q 1 and 2, plus H = 64 / 128, L up to 32K, B up to 128 for
   the main presets. Requests of variable length (1, 63, 64, 65, ..., L). The kernel runs on the whole
   batch; the reference (and the float64 oracle) on CPU, on requests of length 1, 64, 65 and L
   gathered from the pages (on CUDA torch's scalar division is not correctly rounded; see
   check_decode).
   Tolerances: output rel-L2 <= 1e-3, LSE abs <= 1e-3, and error against float64 within 5% of the
   reference's own (+1e-6).
3. a patched tiny model decoding with backend=triton agrees with backend=reference: logits within
   2e-3 of the largest reference logit at every step of a 32-step teacher-forced decode.
4. on Hopper, the native FP8 MMA kernels (fp8_mma=True) against the reference's MMA models
   (`check_mma_numerics_gpu.py`: bit agreement and residual per model, the best-fitting retained bits and
   k-group; mma_numerics.csv / .md in --out). A measurement: it fails only if it cannot run.
5. a do_bench (CUDA graph) timing of fp8 vs bf16 decode at (B=128, H=16, L=4096) and
   (B=32, H=64, L=8192), with GB/s and TFLOP/s (bytes of each format's cache; FLOPs
   2 H L (r + d + r)); "+fp8mma" is the opt-in native FP8 MMA variant. A sanity number only.

Writes kernels_check.json, kernels_check.csv and kernels_check.md (GPU, versions, date) to --out.
Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

from snapquant.atomic import atomic_write_text
from snapquant.environment import device_environment

R, D = 512, 64  # DeepSeek kv_lora_rank, qk_rope_head_dim
OUT_TOL, LSE_TOL, ORACLE_RATIO = 1e-3, 1e-3, 1.05


# ------------------------------------------------------------------------------------------ inputs
def rand_latent(n_tok: int, g: torch.Generator, dev: str, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent [n, R] with per-token magnitudes in [0.1, 3.2], RoPE [n, D] with a wider range.

    With a unit-variance query this keeps logit ranges within ~50 nat over 32K tokens: wider ranges
    overflow the reference's fp8 scale-fused P (see snapquant.kernels.triton.decode)."""
    mag = torch.exp(torch.empty(n_tok, 1, device=dev).uniform_(math.log(0.1), math.log(3.2), generator=g))
    latent = (torch.randn(n_tok, R, device=dev, generator=g) * mag).to(dtype)
    rope = (torch.randn(n_tok, D, device=dev, generator=g) * 4).to(dtype)
    return latent, rope


def make_lengths(B: int, L: int, seed: int) -> torch.Tensor:
    lengths = torch.randint(max(1, L // 2), L + 1, (B,), generator=torch.Generator().manual_seed(seed))
    special = [1, 63, 64, 65]
    lengths[: min(B, len(special))] = torch.tensor(special[: min(B, len(special))])
    lengths[-1] = L
    return lengths.to(torch.int32)


def build_cache(config, B: int, L: int, g: torch.Generator, dev: str = "cuda"):
    """A cache filled by the kernel's own quantize-append (checked bit-exact in part 1)."""
    from snapquant.kernels import PagedMLACache

    cache = PagedMLACache.empty(B, L, R, D, config, device=dev)
    step = max(1, min(L, (1 << 22) // (B * R)))  # ~4M elements of latent per append
    for start in range(0, L, step):
        n = min(step, L - start)
        lat, rope = rand_latent(B * n, g, dev)
        cache.append(lat.view(B, n, R), rope.view(B, n, D), check_bounds=False)
    cache.lengths.copy_(make_lengths(B, L, B + L).to(dev))
    return cache


def sub_cache(cache, idx: list[int]):
    from snapquant.kernels import PagedMLACache

    sel = torch.tensor(idx, device=cache.device)
    return PagedMLACache(cache.latent, cache.scale, cache.rope, cache.block_table[sel].contiguous(),
                         cache.lengths[sel].contiguous(), cache.config)


# ------------------------------------------------------------------------------------------ part 1
def check_append(name: str, config, in_dtype: torch.dtype, n_tok: int = 4096) -> dict:
    from snapquant import quantize_kv
    from snapquant.kernels import PagedMLACache

    g = torch.Generator(device="cuda").manual_seed(1)
    lat, rope = rand_latent(n_tok, g, "cuda", in_dtype)
    lat[0] = 0  # scale 1
    lat[1] = 1e-30  # scale floor
    rope[1] = 1e13  # rope / floored scale saturates bf16 (snapmla)
    lat[2] = 3e4
    kv = quantize_kv(lat.cpu().view(1, n_tok, R), rope.cpu().view(1, n_tok, D), config)
    cache = PagedMLACache.empty(1, n_tok + 100, R, D, config, device="cuda")
    # Scatter tokens over the pages in a random order, with padding slots (-1) in between.
    perm = torch.randperm(cache.num_pages * 64, generator=torch.Generator().manual_seed(2))[:n_tok]
    slots = perm.cuda()
    from snapquant.kernels import quantize_append

    quantize_append(lat, rope, cache, slots)
    quantize_append(lat[:8], rope[:8], cache, torch.full((8,), -1, device="cuda"))  # skipped
    p, row = (slots // 64).long(), (slots % 64).long()

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        a, b = a.cpu(), b.cpu()
        if a.element_size() == 1 and a.is_floating_point():
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        elif a.dtype == torch.bfloat16:
            a, b = a.view(torch.int16), b.view(torch.int16)
        return torch.equal(a, b)

    ok = same(cache.latent[p, row], kv.latent.data[0]) and same(cache.rope[p, row], kv.rope.data[0])
    if cache.scale is not None:
        s = cache.scale[p, row]
        ok = ok and same(s.reshape(n_tok, -1), kv.latent.scale[0].reshape(n_tok, -1))
    return {"part": "append", "case": f"{name} in={str(in_dtype).split('.')[-1]} N={n_tok}",
            "ok": bool(ok), "detail": "bit-exact" if ok else "bits differ"}


# ------------------------------------------------------------------------------------------ part 2
def decode_configs() -> dict:
    from snapquant import PRESETS

    snap, ds = PRESETS["snapmla"], PRESETS["ds_v32"]
    return {
        "snapmla": snap, "snapmla_kv_only": PRESETS["snapmla_kv_only"], "snapmla_q_fp8": PRESETS["snapmla_q_fp8"],
        "snapmla_qbf16_pvfp8": snap.replace(query="bf16"),
        "ds_v32": ds, "ds_v32_q_fp8": ds.replace(query="fp8_e4m3"), "ds_v32_pv_fp8": ds.replace(pv="fp8_scale_fused"),
        "ds_v32_fp8": ds.replace(query="fp8_e4m3", pv="fp8_scale_fused"), "bf16": PRESETS["bf16"],
    }


KNOBBED = {  # kernel variants checked like the defaults: name -> (config name, mla_decode knobs)
    "snapmla+rows+exact": ("snapmla", {"tile": "rows", "p_div": "exact"}),
    "snapmla+rcp+balanced": ("snapmla", {"p_div": "rcp", "schedule": "balanced"}),
}
GLUON = {"snapmla+gluon": ("snapmla", {"tile": "gluon"}),  # Hopper only, S * H <= 16
         "snapmla+gluon+exact+s3": ("snapmla", {"tile": "gluon", "p_div": "exact", "num_stages": 3}),
         "snapmla+gluon+s2": ("snapmla", {"tile": "gluon", "num_stages": 2}),
         "snapmla+gluon+s1": ("snapmla", {"tile": "gluon", "num_stages": 1}),  # gluon.narrow, one slot, 3 per SM
         # gluon.narrow_halves: two warpgroups split each page's channels (exact products, fp32 order only)
         "snapmla+gluon+halves": ("snapmla", {"tile": "gluon", "num_warps": 8}),
         "bf16+gluon": ("bf16", {"tile": "gluon"}),  # gluon.narrow_bf16 (opt-in): two slots, one program per SM
         "bf16+gluon+s1": ("bf16", {"tile": "gluon", "num_stages": 1}),  # ... one slot, two programs per SM
         # native FP8 QK: 2e-4..1.2e-3 from the reference measured (H200); judged by its own tolerances
         "snapmla+gluon+fp8qk": ("snapmla", {"tile": "gluon", "fp8_mma": "qk", "num_stages": 2,
                                             "_tol": (3e-3, 5e-3)}),
         "snapmla+gluon+fp8qk+s1": ("snapmla", {"tile": "gluon", "fp8_mma": "qk", "num_stages": 1,
                                                "_tol": (3e-3, 5e-3)}),
         # both products native at 16 rows (gluon.narrow8): two slots, or one with three programs per SM
         "snapmla+gluon+fp8mma16": ("snapmla", {"tile": "gluon", "fp8_mma": True, "_tol": (1e-2, 1e-2)}),
         "snapmla+gluon+fp8mma16+s1": ("snapmla", {"tile": "gluon", "fp8_mma": True, "num_stages": 1,
                                                   "_tol": (1e-2, 1e-2)})}
GLUON_WIDE = {"snapmla+gluon-wide": ("snapmla", {"tile": "gluon"}),  # Hopper only, S * H > 16: 64-row tiles
              "bf16+gluon-wide": ("bf16", {"tile": "gluon"}),
              # native FP8 QK and PV (gluon.narrow8, 32-row programs; gluon.wide8, 64): the FP8 MMA's
              # accumulation rounding, their own tolerances
              "snapmla+gluon-wide+fp8mma": ("snapmla", {"tile": "gluon", "fp8_mma": True, "_tol": (1e-2, 1e-2)}),
              "snapmla+gluon-wide8+fp8mma": ("snapmla", {"tile": "gluon", "fp8_mma": True, "block_m": 64,
                                                         "_tol": (1e-2, 1e-2)})}


def check_decode(name: str, config, B: int, H: int, L: int, S: int, num_splits: int | None,
                 knobs: dict | None = None) -> dict:
    """Kernel on the whole batch; CPU reference and float64 oracle on requests of length 1, 64, 65, L.

    The reference runs on CPU, the definitive semantics: on CUDA, torch divides a tensor by a Python
    scalar through the reciprocal, so its scales (amax / 448) can differ by an ulp and values on
    e4m3 rounding ties round the other way (the kernel divides correctly rounded, as the CPU does)."""
    from snapquant import mla_decode_oracle, mla_decode_reference
    from snapquant.kernels import mla_decode

    knobs = dict(knobs or {})
    out_tol, lse_tol = knobs.pop("_tol", (OUT_TOL, LSE_TOL))
    g = torch.Generator(device="cuda").manual_seed(B * 7 + H * 3 + L + S)
    cache = build_cache(config, B, L, g)
    q = torch.randn(B, S, H, R + D, device="cuda", generator=g).to(torch.bfloat16)
    tau = 1 / math.sqrt(192)  # DeepSeek: 1 / sqrt(qk_nope + qk_rope)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, lse = mla_decode(q, cache, tau, config, num_splits=num_splits, **knobs)
    torch.cuda.synchronize()
    t_kernel = time.perf_counter() - t0
    # Query row s of request b sees lengths[b] - (S - 1 - s) tokens; none -> out 0, lse -inf (the contract).
    visible = cache.lengths.long()[:, None] - (S - 1 - torch.arange(S, device="cuda"))[None, :]  # [B, S]
    empty = (visible <= 0)[:, :, None].expand(B, S, H)
    finite = bool(torch.isfinite(out).all() and torch.isfinite(lse[~empty]).all()
                  and (lse[empty] == -math.inf).all() and (out[empty] == 0).all())
    refs, oracles = [], []
    idx = sorted({0, min(2, B - 1), min(3, B - 1), B - 1})  # lengths 1, 64, 65, L
    for i in idx:  # one request at a time: each reference runs over its own length only
        sub = sub_cache(cache, [i])
        kv = sub.to_quantized_kv(int(sub.lengths.max())).to("cpu")
        qi, lens = q[i:i + 1].cpu(), sub.lengths.cpu()
        refs.append(mla_decode_reference(qi, kv, lens, tau, config))
        oracles.append(mla_decode_oracle(qi, kv, lens, tau, config))
    ref, ref_lse = torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs])
    oracle, oracle_lse = torch.cat([o[0] for o in oracles]), torch.cat([o[1] for o in oracles])
    o, ls = out[idx].cpu(), lse[idx].cpu()
    live = ~empty[idx].cpu()
    ok_ref = torch.isfinite(ref).all(-1) & torch.isfinite(ref_lse) & live  # rows the reference computes
    n_bad_ref = int((live & ~ok_ref).sum())
    rel = ((o - ref)[ok_ref].norm() / ref[ok_ref].norm()).item()
    lse_err = (ls - ref_lse)[ok_ref].abs().max().item()
    cos = 1 - torch.nn.functional.cosine_similarity(o[ok_ref].flatten().double(), ref[ok_ref].flatten().double(),
                                                    dim=0).item()
    err_k = ((o[live].double() - oracle[live]).norm() / oracle[live].norm()).item()
    err_r = ((ref[ok_ref].double() - oracle[ok_ref]).norm() / oracle[ok_ref].norm()).item()
    err_k_live = ((o[ok_ref].double() - oracle[ok_ref]).norm() / oracle[ok_ref].norm()).item()
    lse_vs_oracle = (ls[live].double() - oracle_lse[live]).abs().max().item()
    ok = (finite and rel <= out_tol and lse_err <= lse_tol and err_k_live <= ORACLE_RATIO * err_r + 1e-6
          and (n_bad_ref == 0 or (err_k <= 5e-2 and lse_vs_oracle <= 2e-2)))
    detail = "" if finite else "non-finite output"
    if n_bad_ref:
        detail += f" reference non-finite on {n_bad_ref} rows (fp8-P overflow); those judged against float64"
    return {"part": "decode", "case": f"{name} B={B} H={H} L={L} s_q={S} splits={num_splits or 'auto'}",
            "ok": ok, "rel_l2": rel, "lse_abs": lse_err, "cos_dist": cos, "err_vs_fp64": err_k,
            "ref_err_vs_fp64": err_r, "first_call_s": round(t_kernel, 2), "detail": detail.strip()}


def check_subnormal_codes() -> dict:
    """tile='pairs' widens e4m3 codes with cvt.rn.f16x2.e4m3x2: a latent whose codes are all
    subnormal (|code| < 8, values m * 2^-9) must give the default path's output (nothing flushed)."""
    from snapquant import PRESETS
    from snapquant.kernels import mla_decode

    config = PRESETS["snapmla"]
    g = torch.Generator(device="cuda").manual_seed(11)
    cache = build_cache(config, 4, 512, g)
    codes = torch.randint(-7, 8, cache.latent.shape, device="cuda", generator=g)
    raw = (codes.abs() | ((codes < 0).to(codes.dtype) << 7)).to(torch.uint8)
    cache.latent.view(torch.uint8).copy_(raw)
    q = torch.randn(4, 1, 16, R + D, device="cuda", generator=g).to(torch.bfloat16)
    b, lb = mla_decode(q, cache, 0.07, config, num_splits=1, tile="pairs")
    a, la = mla_decode(q, cache, 0.07, config, num_splits=1, tile="rows")
    rel = ((a - b).norm() / a.norm()).item()
    ok = bool(torch.isfinite(b).all()) and rel <= 1e-3 and (la - lb).abs().max().item() <= 1e-3
    return {"part": "decode", "case": "pairs vs rows tile on subnormal codes", "ok": ok, "rel_l2": rel}


def check_fma_division_bitwise(B: int, H: int, L: int, tile: str) -> dict:
    """p_div='fma' claims the correctly rounded f / pi: with one split it must give exactly the bits
    of p_div='exact' (div_rn per element) on the GPU, where fma and div_rn are the hardware's."""
    from snapquant import PRESETS
    from snapquant.kernels import mla_decode

    config = PRESETS["snapmla"]
    g = torch.Generator(device="cuda").manual_seed(B + H + L)
    cache = build_cache(config, B, L, g)
    q = (torch.randn(B, 1, H, R + D, device="cuda", generator=g) * 4).to(torch.bfloat16)
    a = mla_decode(q, cache, 0.07, config, num_splits=1, tile=tile, p_div="exact")
    b = mla_decode(q, cache, 0.07, config, num_splits=1, tile=tile, p_div="fma")
    c = mla_decode(q, cache, 0.07, config, num_splits=1, tile=tile, p_div="rcp")
    n_diff = int((a[0] != b[0]).sum()) + int((a[1] != b[1]).sum())
    n_rcp = int((a[0] != c[0]).sum())
    return {"part": "decode", "case": f"p_div fma == exact bitwise, tile={tile} B={B} H={H} L={L}",
            "ok": n_diff == 0, "detail": f"{n_diff} differing values (rcp: {n_rcp})"}


# ------------------------------------------------------------------------------------------ part 3
MODEL_TOL = 2e-3  # max |logit difference| / max |reference logit|, at every decode step


def teacher_forced_logits(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """Prefill `prefix` tokens, then feed the rest one token per step; logits [B, steps, vocab] fp32."""
    import warnings

    steps = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values -> cache rename in newer transformers
        warnings.filterwarnings("error", message="snapquant triton backend")  # a silent fallback is a failure
        out = model(ids[:, :prefix], use_cache=True)
        past = out.past_key_values
        for t in range(prefix, ids.shape[1]):
            out = model(ids[:, t:t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits[:, -1].float())
    return torch.stack(steps, 1)


def check_patched_model(name: str, config, dtype: torch.dtype, steps: int = 32) -> dict:
    """A patched tiny DeepSeek-V3 model (kv_lora_rank 64, RoPE 16: kernel widths) decoding with
    backend=triton agrees with backend=reference at every step of a teacher-forced decode."""
    from snapquant.models.tiny import tiny_model
    from snapquant.patching import patch, unpatch

    model = tiny_model("deepseek_v3", kv_lora_rank=64, qk_rope_head_dim=16, dtype=dtype).cuda()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (4, 16 + steps), generator=g).cuda()
    logits = {}
    for backend in ("reference", "triton"):
        patch(model, config, backend=backend)
        try:
            logits[backend] = teacher_forced_logits(model, ids, 16)
        finally:
            unpatch(model)
    diff = (logits["triton"] - logits["reference"]).abs().amax(dim=(0, 2))  # per step
    scale = logits["reference"].abs().amax(dim=(0, 2))
    worst = (diff / scale).max().item()
    ok = bool(torch.isfinite(logits["triton"]).all()) and worst <= MODEL_TOL
    return {"part": "model", "case": f"tiny deepseek_v3 {name} {str(dtype).split('.')[-1]} {steps} steps",
            "ok": ok, "rel_l2": worst, "detail": f"worst step max|dlogit|/max|logit| = {worst:.2e}"}


def model_cases() -> list[tuple]:
    from snapquant import PRESETS

    ds = PRESETS["ds_v32"].replace(block_size=32)  # kv_lora_rank 64: two blocks of 32
    return [("snapmla", PRESETS["snapmla"], torch.float32), ("snapmla_kv_only", PRESETS["snapmla_kv_only"], torch.float32),
            ("snapmla_q_fp8", PRESETS["snapmla_q_fp8"], torch.float32), ("ds_v32(block 32)", ds, torch.float32),
            # bf16 with prefill: quantized is the absorbed BF16 pipeline the kernel implements (plain bf16 on the
            # reference backend decodes through the stock attention, bit-exact to the unpatched model)
            ("bf16 (absorbed)", PRESETS["bf16"].replace(prefill="quantized"), torch.bfloat16)]


# ------------------------------------------------------------------------------------------ part 4
def check_mma_numerics(out: Path, quick: bool) -> dict:
    """The native FP8 kernels against the reference's `mma` models (scripts/check_mma_numerics_gpu.py)."""
    import check_mma_numerics_gpu

    t0 = time.perf_counter()
    rc = check_mma_numerics_gpu.run(out, quick=quick)
    return {"part": "mma", "case": "native FP8 MMA numerics fit", "ok": rc == 0,
            "detail": f"{out / 'mma_numerics.md'} ({time.perf_counter() - t0:.0f} s)"}


# ------------------------------------------------------------------------------------------ part 5
def bench(names: list[str], B: int, H: int, L: int) -> list[dict]:
    import triton

    from snapquant import bytes_per_token
    from snapquant.kernels import mla_decode

    rows = []
    configs = decode_configs()
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in names:
        config = configs[name.removesuffix("+fp8mma")]
        try:
            cache = build_cache(config, B, L, g)
            cache.lengths.fill_(L)
            q = torch.randn(B, H, R + D, device="cuda", generator=g).to(torch.bfloat16)

            def fn(cache=cache, q=q, config=config, fp8_mma=name.endswith("+fp8mma")):
                return mla_decode(q, cache, 0.07, config, check_bounds=False, fp8_mma=fp8_mma)

            fn()
            try:
                ms = triton.testing.do_bench_cudagraph(fn, rep=200)
                how = "cudagraph"
            except Exception:
                ms = triton.testing.do_bench(fn, warmup=50, rep=200)
                how = "do_bench"
            tokens = B * L
            gbs = tokens * bytes_per_token(config, R, D) / (ms * 1e-3) / 1e9
            tflops = 2 * H * tokens * (R + D + R) / (ms * 1e-3) / 1e12
            rows.append({"part": "bench", "case": f"{name} B={B} H={H} L={L}", "ok": True, "us": ms * 1e3,
                         "GB/s": gbs, "TFLOP/s": tflops, "detail": how})
        except Exception as e:
            rows.append({"part": "bench", "case": f"{name} B={B} H={H} L={L}", "ok": False,
                         "detail": f"{type(e).__name__}: {e}"[:300]})
        finally:
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------ driver
def run_case(fn, *args, label: str) -> dict:
    t0 = time.perf_counter()
    try:
        row = fn(*args)
    except Exception as e:
        traceback.print_exc()
        row = {"case": label, "ok": False, "detail": f"{type(e).__name__}: {e}"[:300]}
    row["seconds"] = round(time.perf_counter() - t0, 2)
    torch.cuda.empty_cache()
    status = "PASS" if row["ok"] else "FAIL"
    nums = " ".join(f"{k}={row[k]:.2e}" for k in ("rel_l2", "lse_abs", "err_vs_fp64") if k in row)
    print(f"[{status}] {row.get('part', '')} {row['case']} {nums} {row.get('detail', '')} ({row['seconds']} s)",
          flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels", help="output directory")
    ap.add_argument("--quick", action="store_true", help="a few cases only (smoke test)")
    ap.add_argument("--no-bench", action="store_true", help="skip the timing")
    ap.add_argument("--only", default=None, help="run only the cases whose label contains this text")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the compiled kernels on a GPU", file=sys.stderr)
        return 2
    from snapquant import PRESETS

    env = device_environment()  # date, GPU, versions (torch, triton, CUDA, transformers), commit
    print(json.dumps(env, indent=1), flush=True)
    t_start = time.perf_counter()
    rows: list[dict] = []

    append_cases = [("snapmla", PRESETS["snapmla"]), ("ds_v32", PRESETS["ds_v32"]), ("bf16", PRESETS["bf16"])]
    for name, cfg in append_cases:
        if args.only and args.only not in f"append {name}":
            continue
        for dtype in (torch.bfloat16, torch.float32):
            rows.append(run_case(check_append, name, cfg, dtype, label=f"append {name}"))
            if args.quick:
                break

    configs = decode_configs()
    main_four = ["snapmla", "snapmla_kv_only", "ds_v32", "bf16"]
    shapes = [  # (configs, B, H, L, s_q, num_splits)
        (list(configs), 128, 16, 4096, 1, None),
        (list(configs), 64, 16, 4096, 2, None),
        (["snapmla", "snapmla_kv_only"], 128, 16, 4096, 1, 1),
        (main_four, 32, 64, 8192, 1, None),
        (main_four, 8, 128, 32768, 1, None),
        (main_four, 128, 128, 2048, 2, None),
        (main_four, 4, 16, 32768, 2, None),
    ]
    if args.quick:
        shapes = [(["snapmla", "snapmla_kv_only", "ds_v32", "bf16"], 16, 16, 1024, 1, None),
                  (["snapmla"], 4, 128, 4096, 2, None)]
    knobbed = [(list(KNOBBED), B, H, L, S, ns) for B, H, L, S, ns in
               ((128, 16, 4096, 1, None), (64, 16, 4096, 2, None), (32, 64, 8192, 1, None), (4, 128, 32768, 1, None))]
    gluon = [(list(GLUON), B, H, L, S, ns) for B, H, L, S, ns in
             ((128, 16, 4096, 1, None), (128, 16, 4096, 1, 1), (4, 16, 32768, 1, None), (64, 8, 4096, 2, None),
              (8, 16, 1000, 1, 3))]
    # wide: full and partial 64-row tiles (20 x 2 = 40 rows), several tiles per request, one split, empty splits
    gluon += [(list(GLUON_WIDE), B, H, L, S, ns) for B, H, L, S, ns in
              ((32, 64, 8192, 1, None), (4, 128, 32768, 1, None), (128, 128, 2048, 2, None), (8, 20, 1000, 2, 3),
               (16, 32, 4096, 1, 1))]
    if torch.cuda.get_device_capability()[0] != 9:
        gluon = []
    for names, B, H, L, S, ns in shapes + ([] if args.quick else knobbed + gluon):
        for name in names:
            cfg_name, knobs = {**KNOBBED, **GLUON, **GLUON_WIDE}.get(name, (name, None))
            if args.only and args.only not in f"{name} B={B} H={H} L={L} s_q={S}":
                continue
            rows.append(run_case(check_decode, name, configs[cfg_name], B, H, L, S, ns, knobs,
                                 label=f"{name} B={B} H={H} L={L} s_q={S}"))
    if torch.cuda.get_device_capability()[0] == 9 and (not args.only or args.only in "mma numerics"):
        rows.append(run_case(check_mma_numerics, Path(args.out), args.quick, label="mma numerics"))
    if args.only:
        return finish(args, env, rows, t_start)
    rows.append(run_case(check_subnormal_codes, label="pairs: subnormal e4m3 codes"))
    for B, H, L in ((128, 16, 4096), (32, 64, 8192), (4, 128, 32768)):
        for tile in ("pairs", "rows"):
            rows.append(run_case(check_fma_division_bitwise, B, H, L, tile, label=f"fma bitwise {tile} {B}x{H}x{L}"))

    for name, cfg, dtype in model_cases()[: 2 if args.quick else None]:
        rows.append(run_case(check_patched_model, name, cfg, dtype, label=f"model {name}"))
    if not args.no_bench:
        for B, H, L in ((128, 16, 4096), (32, 64, 8192)):
            for row in bench(["snapmla", "snapmla+fp8mma", "snapmla_kv_only", "bf16"], B, H, L):
                rows.append(row)
                print(f"[BENCH] {row['case']}: " + (f"{row['us']:.1f} us  {row['GB/s']:.0f} GB/s  "
                      f"{row['TFLOP/s']:.1f} TFLOP/s" if row["ok"] else row["detail"]), flush=True)
    return finish(args, env, rows, t_start)


def finish(args, env: dict, rows: list[dict], t_start: float) -> int:
    n_fail = sum(not r["ok"] for r in rows)
    summary = {"passed": len(rows) - n_fail, "failed": n_fail, "seconds": round(time.perf_counter() - t_start, 1)}
    print(f"\nSUMMARY: {summary['passed']} passed, {summary['failed']} failed in {summary['seconds']} s")
    for r in rows:
        if not r["ok"]:
            print(f"  FAILED: {r.get('part', '')} {r['case']}: {r.get('detail', '')}")
    write_outputs(Path(args.out), env, rows, summary)
    return 1 if n_fail else 0


def write_outputs(out: Path, env: dict, rows: list[dict], summary: dict) -> None:
    """JSON / CSV / markdown, each written to a temporary name and renamed (atomic)."""
    keys = ["part", "case", "ok", "rel_l2", "lse_abs", "cos_dist", "err_vs_fp64", "ref_err_vs_fp64", "us",
            "GB/s", "TFLOP/s", "seconds", "detail"]

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))

    def write(name: str, text: str) -> None:
        atomic_write_text(out / name, text)

    write("kernels_check.json", json.dumps({"environment": env, "summary": summary, "rows": rows}, indent=1))
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    write("kernels_check.csv", buf.getvalue())
    md = [f"# Triton MLA kernels on {env['gpu']}", "",
          f"{env['date']}; torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, "
          f"transformers {env['transformers']}, commit {env['git_commit']}", "",
          f"**{summary['passed']} passed, {summary['failed']} failed** in {summary['seconds']} s. Decode "
          f"tolerances: rel-L2 <= {OUT_TOL}, LSE abs <= {LSE_TOL}, error vs float64 <= {ORACLE_RATIO} x the "
          "reference's + 1e-6.", "",
          "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    write("kernels_check.md", "\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
