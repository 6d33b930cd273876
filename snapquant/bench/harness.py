"""The decode benchmark harness: every variant on every shape, side by side, in one process.

For each shape the harness builds one random cache (bf16 pages; the FP8 layouts are filled from the
same values by the quantize-and-append kernel), enough copies of it to rotate beyond L2, and the
queries; then times each selected variant (`variants.py`) with the chosen timer (`timing.py`):

    first call    compiles, and its output is checked against the variant's `check_vs`
                  (relative L2 <= tol; a mismatch is reported as status "mismatch", not hidden)
    estimate      a few eager calls size the CUDA graph
    timing        median of many graph replays (CUDA) or wall-clock samples (CPU)

Measurements run in priority passes (core, variants, sweeps), each pass over all shapes with the
headline shapes first, so that a time budget cuts the least important measurements. Every failure
is caught and recorded as a row (status "error" with the message); results are written (atomically)
after every shape, so a run killed at its time limit still leaves its CSV behind.
"""

from __future__ import annotations

import gc
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..constants import PAGE_SIZE
from ..presets import PRESETS
from . import accounting as acc
from .shapes import DecodeShape
from .timing import CudaGraphTimer, EventTimer, Timing, WallTimer, estimate_us, l2_bytes, rotation_sets
from .variants import Variant

LAYOUT_CONFIG = {"bf16": PRESETS["bf16"], "snapmla": PRESETS["snapmla"], "ds_v32": PRESETS["ds_v32"]}
PAGE = PAGE_SIZE  # tokens per page of the benchmark's paged caches
APPEND_CHUNK = 1 << 20  # tokens per quantize-append launch when filling a cache
# The interpreter's cost is per program: filling a CPU cache 16 tokens per program is ~20x faster than
# the small-append default of one (same bits either way).
CPU_FILL_TOKENS_PER_PROGRAM = 16


# ------------------------------------------------------------------------------------------ budget
class Budget:
    """Wall-clock budget of a run; `ok(reserve)` is False once less than `reserve` seconds are left."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds, self.clock, self.start = float(seconds), clock, clock()

    def spent(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.spent()

    def ok(self, reserve: float = 0.0) -> bool:
        return self.left() > reserve


# ------------------------------------------------------------------------------------------ inputs
@dataclass
class ShapeData:
    """Inputs of one shape: per layout, `n_sets` caches over the same block table; queries; the
    dense [c | r] rows for the PyTorch baselines; outputs kept for the numerical checks."""

    shape: DecodeShape
    r: int
    d: int
    tau: float
    n_sets: int
    caches: dict[str, list[Any]] = field(default_factory=dict)
    queries: list[torch.Tensor] = field(default_factory=list)
    dense: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    build_s: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.queries[0].device


def _block_table(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """Request b owns consecutive pages; unused entries repeat its last page (valid, never read)."""
    n_pages = [max(1, math.ceil(n / PAGE)) for n in lengths]
    width = max(n_pages)
    start = [0]
    for n in n_pages[:-1]:
        start.append(start[-1] + n)
    col = torch.arange(width)
    bt = torch.stack([s + torch.clamp(col, max=n - 1) for s, n in zip(start, n_pages, strict=True)])
    return bt.to(device=device, dtype=torch.int32), sum(n_pages)


def build_shape_data(shape: DecodeShape, layouts: set[str], device: torch.device, *, r: int = acc.R,
                     d: int = acc.D, seed: int = 0, rotate_factor: float = 4.0, max_sets: int = 32,
                     need_dense: bool = False) -> ShapeData:
    """Random inputs for `shape` in the requested cache layouts (bf16 always), rotated beyond L2."""
    from ..kernels import PagedMLACache, quantize_append

    t0 = time.perf_counter()
    g = torch.Generator(device=device).manual_seed(seed)
    lengths = torch.tensor(shape.lengths, dtype=torch.int32, device=device)
    bt, n_pages = _block_table(list(shape.lengths), device)
    n_tok = n_pages * PAGE
    # Latent ~ N(0, 1) per channel times a per-token magnitude in [0.1, 3.2] (log-uniform): a spread
    # of token scales, as after kv_a_layernorm on real text; RoPE with a wider range (docs/numerics.md,
    # "Test and benchmark inputs").
    mag = torch.exp(torch.empty(n_tok, 1, device=device).uniform_(math.log(0.1), math.log(3.2), generator=g))
    latent = (torch.randn(n_tok, r, device=device, generator=g) * mag).to(torch.bfloat16)
    rope = (torch.randn(n_tok, d, device=device, generator=g) * 4).to(torch.bfloat16)
    del mag
    base = {"bf16": PagedMLACache(latent.view(n_pages, PAGE, r), None, rope.view(n_pages, PAGE, d), bt, lengths,
                                  LAYOUT_CONFIG["bf16"])}
    slots = torch.arange(n_tok, device=device)
    for layout in sorted(layouts - {"bf16"}):
        cfg = LAYOUT_CONFIG[layout]
        c = PagedMLACache.empty(1, PAGE, r, d, cfg, device=device, num_pages=n_pages)
        cache = PagedMLACache(c.latent, c.scale, c.rope, bt, lengths, cfg)
        for lo in range(0, n_tok, APPEND_CHUNK):
            hi = min(n_tok, lo + APPEND_CHUNK)
            quantize_append(latent[lo:hi], rope[lo:hi], cache, slots[lo:hi], check_bounds=False,
                            tokens_per_program=None if device.type == "cuda" else CPU_FILL_TOKENS_PER_PROGRAM)
        base[layout] = cache
    q_shape = (shape.batch, shape.q_tokens, shape.heads, r + d)
    q_bytes = math.prod(q_shape) * 2
    footprint = min(c.nbytes for c in base.values()) + q_bytes
    # Rotation only matters for a GPU's L2; on CPU (interpreter smoke runs) one set is enough.
    rotate = rotate_factor > 0 and device.type == "cuda"
    n_sets = rotation_sets(footprint, l2_bytes(device), rotate_factor, max_sets) if rotate else 1
    data = ShapeData(shape, r, d, 1.0 / math.sqrt(192.0), n_sets)  # DeepSeek tau: 1 / sqrt(dn + dr)
    for layout, cache in base.items():
        data.caches[layout] = [cache] + [
            PagedMLACache(cache.latent.clone(), None if cache.scale is None else cache.scale.clone(),
                          cache.rope.clone(), bt, lengths, cache.config) for _ in range(n_sets - 1)]
    data.queries = [torch.randn(q_shape, device=device, generator=g).to(torch.bfloat16) for _ in range(n_sets)]
    if need_dense:
        data.dense = [_dense_rows(c, shape, r) for c in data.caches["bf16"]]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    data.build_s = time.perf_counter() - t0
    return data


def _dense_rows(cache: Any, shape: DecodeShape, r: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, L_max, r + d] bf16 rows [c | r] (what a plain PyTorch cache holds) and, for mixed lengths,
    an additive fp32 mask [B, 1, L_max] (0 visible, -inf padding)."""
    L = shape.max_len
    n = math.ceil(L / PAGE)
    pages = cache.block_table[:, :n].long()
    kv = torch.cat([cache.latent[pages], cache.rope[pages]], dim=-1).reshape(shape.batch, n * PAGE, -1)[:, :L]
    kv = kv.contiguous()
    if shape.uniform:
        return kv, None
    pos = torch.arange(L, device=kv.device)
    mask = torch.where(pos[None, :] < cache.lengths[:, None].long(), 0.0, float("-inf"))
    return kv, mask[:, None, :].contiguous()


# ------------------------------------------------------------------------------------------ callables
def torch_matmul_decode(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, tau: float, r: int) -> torch.Tensor:
    """Plain PyTorch absorbed MLA decode: scores = q [c | r]^T (bf16 bmm, fp32 accumulate), fp32
    softmax, P in bf16, out = P c. q [B, S, H, r + d] (S = 1) -> out [B, S, H, r] fp32."""
    B, S, H, _ = q.shape
    s = torch.bmm(q.reshape(B, S * H, -1), kv.transpose(1, 2)).float() * tau
    if mask is not None:
        s = s + mask
    p = torch.softmax(s, dim=-1).to(kv.dtype)
    return torch.bmm(p, kv[..., :r]).float().view(B, S, H, r)


class VariantSkipped(Exception):
    """A variant that cannot run at this shape on this device, for a reason known before running it."""


def sdpa_expansion_bytes(B: int, S: int, H: int, L: int, r: int, d: int) -> int:
    """Bytes PyTorch's SDPA allocates for `torch_sdpa_decode`: with head dim r + d = 576 no fused kernel
    applies, and its math path repeats the one latent KV head for every query head, upcast to fp32
    (K [B, H, L, r + d] and V [B, H, L, r]); the H200 run's OOM messages asked for K alone 144 GiB at
    B=128 H=128 L=4K, V alone 64 GiB at B=64 H=16 L=32K."""
    return B * S * H * L * (2 * r + d) * 4


def torch_sdpa_decode(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, tau: float, r: int) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with the latent as one KV head shared by all query heads."""
    import torch.nn.functional as F

    B, S, H, _ = q.shape
    attn_mask = None if mask is None else mask[:, None]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q.view(B, S * H, 1, -1), kv[:, None], kv[:, None, :, :r],
                                         attn_mask=attn_mask, scale=tau, enable_gqa=True)
    return out.float().view(B, S, H, r)


@dataclass
class Prepared:
    fns: list[Callable[[], Any]]
    meta: dict[str, Any]  # knobs resolved, compiled-kernel facts after the first call
    plans: list[Any] = field(default_factory=list)


def prepare_variant(v: Variant, data: ShapeData, num_sms: int) -> Prepared:
    """One zero-argument callable per input set (kernel plans are built once: no checks per call)."""
    from ..kernels import mla_decode_plan

    if v.impl == "kernel":
        kw = v.kernel_kwargs(data.shape, num_sms)
        cfg = v.config()
        plans = [mla_decode_plan(q, cache, data.tau, cfg, check_bounds=i == 0, **kw)
                 for i, (q, cache) in enumerate(zip(data.queries, data.caches[v.layout], strict=True))]
        return Prepared([p.run for p in plans], {"knobs": plans[0].knobs}, plans)
    if v.impl == "flashmla":
        return _prepare_flashmla(data)
    fn = torch_matmul_decode if v.impl == "torch_matmul" else torch_sdpa_decode
    if v.impl == "torch_sdpa" and data.device.type == "cuda":
        sh = data.shape
        need = sdpa_expansion_bytes(sh.batch, sh.q_tokens, sh.heads, sh.max_len, data.r, data.d)
        free = torch.cuda.mem_get_info(data.device)[0]
        if need > 0.9 * free:
            raise VariantSkipped(f"SDPA's math path would expand the latent per head: {need / 2**30:.0f} GiB "
                                 f"needed, {free / 2**30:.0f} GiB free")
    fns = [(lambda q=q, kv=kv, m=m: fn(q, kv, m, data.tau, data.r))
           for q, (kv, m) in zip(data.queries, data.dense, strict=True)]
    return Prepared(fns, {"knobs": {}})


def _prepare_flashmla(data: ShapeData) -> Prepared:
    """FlashMLA BF16 over the bf16 cache's values: each set's pages repacked into FlashMLA's
    [pages, 64, 1, r + d] rows (same page ids, so the same block table and lengths), its schedule metadata
    filled by one call here, outside every timed region (the timed calls reuse it: same shapes and lengths)."""
    from ..attention import flashmla

    mod = flashmla.load()
    if mod is None:
        raise VariantSkipped(flashmla.NOT_INSTALLED)
    calls = []
    for q, cache in zip(data.queries, data.caches["bf16"], strict=True):
        k_cache = flashmla.pages_from_paged(cache.latent, cache.rope)
        call = flashmla.AnchorDecode(mod, q, k_cache, cache.block_table, cache.lengths, data.tau, data.r)
        call.prime()
        calls.append(call)
    return Prepared(list(calls), {"knobs": {}})


def compiled_facts(plan: Any) -> dict[str, Any]:
    """Registers, spills and shared memory of the plan's main kernel (GPU runs; None otherwise)."""
    facts: dict[str, Any] = {"regs": None, "spills": None, "smem": None}
    for ln, k in zip(plan.launches, plan.compiled, strict=False):
        if ln.name.startswith("decode") and k is not None:
            facts["regs"] = getattr(k, "n_regs", None)
            facts["spills"] = getattr(k, "n_spills", None)
            md = getattr(k, "metadata", None)
            facts["smem"] = getattr(md, "shared", None)
    return facts


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ one row
def decode_row(shape: DecodeShape, v: Variant, r: int = acc.R, d: int = acc.D) -> dict[str, Any]:
    """The row of `v` on `shape` before timing: identity, FLOPs and bytes."""
    cfg = v.config()
    return {
        "op": "decode", "shape": shape.name, "label": shape.label, "B": shape.batch, "H": shape.heads,
        "S": shape.q_tokens, "L_max": shape.max_len, "tokens": shape.tokens, "variant": v.name,
        "family": v.family, "layout": v.layout, "mode": v.mode, "impl": v.impl, "priority": v.priority,
        "knobs": v.knob_label, "bytes": acc.cache_bytes(cfg, shape.tokens, r, d),
        "io_bytes": acc.io_bytes(shape.batch, shape.heads, shape.q_tokens, r, d),
        "flops": acc.decode_flops(shape.heads, shape.tokens, shape.q_tokens, r, d), "status": "ok", "error": "",
    }


def finish_row(row: dict[str, Any], t: Timing) -> dict[str, Any]:
    row.update(us=t.us, us_p20=t.us_p20, us_p80=t.us_p80, runs=t.runs, calls_per_run=t.calls_per_run, timer=t.timer)
    if t.samples:
        row["samples_us"] = list(t.samples)  # in memory only (intervals on ratios); not a CSV column
    row["gbps"] = acc.rate(row["bytes"], t.us)
    row["gbps_with_io"] = acc.rate(row["bytes"] + row.get("io_bytes", 0.0), t.us)
    if "flops" in row:
        row["tflops"] = acc.rate(row["flops"], t.us) / 1e3
    return row


def time_fns(timer: Any, fns: list[Callable[[], Any]], device: torch.device, log: Callable[[str], None],
             time_left: Callable[[], float] | None = None) -> Timing:
    """Time with `timer`; a failed CUDA-graph capture falls back to eager event timing. `time_left()`
    (seconds left in the budget, asked once the per-call estimate is known) bounds a wall-clock
    timer's samples."""
    est = estimate_us(fns, device)
    if time_left is not None and isinstance(timer, WallTimer):
        timer = timer.within(time_left(), est, len(fns))
    try:
        return timer(fns, est)
    except Exception as e:  # capture can fail for a library call that syncs; time eagerly instead
        if not isinstance(timer, CudaGraphTimer):
            raise
        log(f"    cuda graph failed ({type(e).__name__}: {str(e)[:120]}); timing eagerly")
        torch.cuda.synchronize()
        return EventTimer(runs=timer.runs, target_ms=timer.target_ms)(fns, est)


def measure_decode(v: Variant, data: ShapeData, timer: Any, num_sms: int,
                   log: Callable[[str], None] = print, keep_output: bool = True,
                   time_left: Callable[[], float] | None = None) -> dict[str, Any]:
    """Time `v` on `data`; every failure becomes the row's status and error. `keep_output` keeps the
    first call's output for the variants that check against this one; `time_left` bounds the timing."""
    dev = data.device
    t0 = time.perf_counter()
    row = {"op": "decode", "shape": data.shape.name, "label": data.shape.label, "variant": v.name}
    try:
        row = decode_row(data.shape, v, data.r, data.d)
        row["l2_sets"] = data.n_sets
        prep = prepare_variant(v, data, num_sms)
        out = prep.fns[0]()
        out = out[0] if isinstance(out, tuple) else out
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        knobs = prep.meta.get("knobs") or {}
        row["resolved"] = " ".join(f"{k}={val}" for k, val in sorted(knobs.items()))
        if prep.plans:
            row.update(compiled_facts(prep.plans[0]))
        finite = bool(torch.isfinite(out).all())
        ref = data.outputs.get(v.check_vs) if v.check_vs else None
        if ref is not None:
            row["check_vs"] = v.check_vs
            row["check_rel_l2"] = rel_l2(out, ref)
        if not finite or row.get("check_rel_l2", 0.0) > v.tol:
            row["status"] = "mismatch"
            row["error"] = "non-finite output" if not finite else f"rel-L2 vs {v.check_vs} above tol {v.tol:g}"
        if keep_output and row["status"] == "ok":
            data.outputs[v.name] = out.detach().clone()
        finish_row(row, time_fns(timer, prep.fns, dev, log, time_left))
    except VariantSkipped as e:
        row["status"] = "skipped"
        row["error"] = str(e)[:400]
    except Exception as e:
        row["status"] = "error"
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        log(traceback.format_exc(limit=3))
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


# ------------------------------------------------------------------------------------------ append
# (name, layout, tokens_per_program); None = quantize_append's default (8 for a 64K-token append)
APPEND_VARIANTS: tuple[tuple[str, str, int | None], ...] = (
    ("append_snapmla", "snapmla", None), ("append_snapmla+t1", "snapmla", 1), ("append_snapmla+t4", "snapmla", 4),
    ("append_snapmla+t16", "snapmla", 16), ("append_ds_v32", "ds_v32", None), ("append_ds_v32+t1", "ds_v32", 1),
    ("append_bf16", "bf16", None), ("append_bf16+t1", "bf16", 1),
)


def measure_append(name: str, layout: str, tpp: int | None, tokens: int, timer: Any, device: torch.device, *,
                   r: int = acc.R, d: int = acc.D, seed: int = 1, rotate_factor: float = 4.0,
                   log: Callable[[str], None] = print, time_left: Callable[[], float] | None = None,
                   ) -> dict[str, Any]:
    """Quantize-and-append of `tokens` bf16 tokens into a fresh cache; bits checked against the
    validated one-token-per-program kernel."""
    from ..kernels import PagedMLACache, quantize_append

    cfg = LAYOUT_CONFIG[layout]
    row: dict[str, Any] = {"op": "append", "shape": f"append{tokens}", "label": f"append {tokens} tokens",
                           "tokens": tokens, "variant": name, "family": "bf16" if layout == "bf16" else "fp8",
                           "layout": layout, "impl": "kernel", "knobs": f"tokens_per_program={tpp or 'default'}",
                           "status": "ok", "error": ""}
    t0 = time.perf_counter()
    try:
        row["bytes"] = acc.append_bytes(cfg, tokens, 2, r, d)
        g = torch.Generator(device=device).manual_seed(seed)
        per_set = acc.append_bytes(cfg, tokens, 2, r, d)
        rotate = rotate_factor > 0 and device.type == "cuda"
        n_sets = rotation_sets(per_set, l2_bytes(device), rotate_factor, 8) if rotate else 1
        row["l2_sets"] = n_sets
        slots = torch.arange(tokens, device=device)
        sets = []
        for _ in range(n_sets):
            mag = torch.exp(torch.empty(tokens, 1, device=device).uniform_(-2.3, 1.2, generator=g))
            lat = (torch.randn(tokens, r, device=device, generator=g) * mag).to(torch.bfloat16)
            rope = (torch.randn(tokens, d, device=device, generator=g) * 4).to(torch.bfloat16)
            sets.append((lat, rope, PagedMLACache.empty(1, tokens, r, d, cfg, device=device)))
        fns = [(lambda s=s: quantize_append(s[0], s[1], s[2], slots, check_bounds=False, tokens_per_program=tpp))
               for s in sets]
        fns[0]()
        if tpp != 1:  # same bits as the validated kernel
            ref = PagedMLACache.empty(1, tokens, r, d, cfg, device=device)
            quantize_append(sets[0][0], sets[0][1], ref, slots, check_bounds=False, tokens_per_program=1)
            got = sets[0][2]
            same = all(torch.equal(_bits(a), _bits(b)) for a, b in
                       ((ref.latent, got.latent), (ref.rope, got.rope)) + (((ref.scale, got.scale),) if ref.scale is not None else ()))
            row["check_vs"] = "append tokens_per_program=1"
            row["check_rel_l2"] = 0.0 if same else float("nan")
            if not same:
                row.update(status="mismatch", error="stored bits differ from the one-token kernel")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        finish_row(row, time_fns(timer, fns, device, log, time_left))
    except Exception as e:
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:400])
        log(traceback.format_exc(limit=3))
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


READ_PROBE_BYTES = 4 << 30  # >> any L2: the probe streams from HBM
CPU_READ_PROBE_BYTES = 64 << 20


def measure_read(device: torch.device, nbytes: int | None = None) -> dict[str, Any]:
    """Read bandwidth: `torch.sum` over `nbytes` of fp32 (4 GiB on CUDA), the ceiling of a decode kernel,
    which reads its cache and writes almost nothing (a device copy also writes, and reaches less)."""
    nbytes = nbytes or (READ_PROBE_BYTES if device.type == "cuda" else CPU_READ_PROBE_BYTES)
    row: dict[str, Any] = {"op": "read", "shape": f"read{nbytes >> 20}MiB", "label": "read bandwidth (torch.sum)",
                           "variant": "torch_sum", "family": "torch", "impl": "torch", "bytes": float(nbytes),
                           "status": "ok", "error": ""}
    try:
        x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
        timer = CudaGraphTimer(runs=10, target_ms=5.0) if device.type == "cuda" else WallTimer(runs=3)
        finish_row(row, time_fns(timer, [lambda x=x: torch.sum(x)], device, print))
        del x
    except Exception as e:
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:400])
    return row


def measure_copy(device: torch.device, nbytes: int = 1 << 30) -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written), the practical ceiling for GB/s."""
    row: dict[str, Any] = {"op": "copy", "shape": f"copy{nbytes >> 20}MiB", "label": "device copy",
                           "variant": "torch_copy", "family": "torch", "impl": "torch", "bytes": 2.0 * nbytes,
                           "status": "ok", "error": ""}
    try:
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        a.random_()
        timer = CudaGraphTimer(runs=10, target_ms=5.0) if device.type == "cuda" else WallTimer(runs=3)
        finish_row(row, time_fns(timer, [lambda a=a, b=b: b.copy_(a)], device, print))
    except Exception as e:
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:400])
    return row


# ------------------------------------------------------------------------------------------ the run
@dataclass
class RunSpec:
    shapes: list[DecodeShape]
    variants: list[Variant]
    device: torch.device
    budget_s: float = 420.0
    reserve_s: float = 25.0  # kept for writing results and the plot
    append: bool = True
    append_tokens: int = 65536
    append_variants: tuple[tuple[str, str, int], ...] = APPEND_VARIANTS
    copy: bool = True
    read: bool = True  # the read-bandwidth probe (the ceiling of the efficiency columns)
    read_bytes: int | None = None  # None: 4 GiB on CUDA, 64 MiB on CPU
    r: int = acc.R
    d: int = acc.D
    seed: int = 0
    rotate_factor: float = 4.0
    num_sms: int | None = None


def skipped_row(shape: DecodeShape, v: Variant, why: str, spec: RunSpec) -> dict[str, Any]:
    try:
        row = decode_row(shape, v, spec.r, spec.d)
    except Exception:  # e.g. a format whose block size does not divide these dims
        row = {"op": "decode", "shape": shape.name, "label": shape.label, "variant": v.name}
    row.update(status="skipped", error=why)
    return row


def run(spec: RunSpec, timer: Any, *, log: Callable[[str], None] = print,
        on_progress: Callable[[list[dict[str, Any]]], None] | None = None,
        budget: Budget | None = None) -> list[dict[str, Any]]:
    """All measurements of `spec`; `on_progress(rows)` after each shape (write partial results)."""
    budget = budget or Budget(spec.budget_s)
    dev = spec.device
    num_sms = spec.num_sms or (torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1)
    rows: list[dict[str, Any]] = []
    if spec.copy and dev.type == "cuda":
        rows.append(measure_copy(dev))
        log(f"device copy: {rows[-1].get('gbps', float('nan')):.0f} GB/s (read + write)")
    if spec.read:
        rows.append(measure_read(dev, spec.read_bytes))
        log(f"read bandwidth: {rows[-1].get('gbps', float('nan')):.0f} GB/s (torch.sum over "
            f"{rows[-1]['bytes'] / 2**30:.2f} GiB; the ceiling of the efficiency columns)")
    datas: dict[str, ShapeData] = {}
    layouts_of = {s.name: {v.layout for v in spec.variants if v.applies(s)} | {"bf16"} for s in spec.shapes}
    dense_of = {s.name: any(v.impl in ("torch_matmul", "torch_sdpa") and v.applies(s) for v in spec.variants)
                for s in spec.shapes}
    priorities = sorted({v.priority for v in spec.variants})
    referenced = {v.check_vs for v in spec.variants if v.check_vs}
    last_s: dict[str, float] = {}  # seconds of the latest measurement per shape name, "any" and "append"

    def time_left() -> float:
        return budget.left() - spec.reserve_s
    for prio in priorities:
        for shape in spec.shapes:
            vs = [v for v in spec.variants if v.priority == prio and v.applies(shape)
                  and (v.impl in ("kernel", "flashmla") or shape.q_tokens == 1)]
            if not vs:
                continue
            if not budget.ok(spec.reserve_s):
                rows += [skipped_row(shape, v, "time budget", spec) for v in vs]
                continue
            data = datas.get(shape.name)
            if data is None:
                try:
                    data = _build_with_retry(shape, layouts_of[shape.name], dense_of[shape.name], spec, datas)
                    datas[shape.name] = data
                    log(f"[{shape.label}] inputs built in {data.build_s:.1f} s, {data.n_sets} rotating set(s)")
                except Exception as e:
                    log(traceback.format_exc(limit=3))
                    rows += [dict(skipped_row(shape, v, "", spec), status="error",
                                  error=f"building inputs: {type(e).__name__}: {e}"[:400]) for v in vs]
                    continue
            for v in vs:
                # the shape's previous measurement (else the run's) predicts this one: start none that cannot fit
                if not budget.ok(spec.reserve_s + last_s.get(shape.name, last_s.get("any", 0.0))):
                    rows.append(skipped_row(shape, v, "time budget", spec))
                    continue
                row = measure_decode(v, data, timer, num_sms, log, keep_output=v.name in referenced,
                                     time_left=time_left)
                last_s[shape.name] = last_s["any"] = row.get("seconds", 0.0)
                rows.append(row)
                log(_describe(row))
                if row["status"] == "error" and _sticky_cuda_error(row["error"]):
                    log("sticky CUDA error: the context is unusable, stopping the decode measurements")
                    return rows
            if on_progress:
                on_progress(rows)
        if prio == priorities[0] and spec.append:
            for name, layout, tpp in spec.append_variants:
                if not budget.ok(spec.reserve_s + last_s.get("append", last_s.get("any", 0.0))):
                    rows.append({"op": "append", "shape": f"append{spec.append_tokens}", "variant": name,
                                 "layout": layout, "status": "skipped", "error": "time budget"})
                    continue
                row = measure_append(name, layout, tpp, spec.append_tokens, timer, dev, r=spec.r, d=spec.d,
                                     rotate_factor=spec.rotate_factor, log=log, time_left=time_left)
                last_s["append"] = row.get("seconds", 0.0)
                rows.append(row)
                log(_describe(row))
            if on_progress:
                on_progress(rows)
    datas.clear()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _build_with_retry(shape: DecodeShape, layouts: set[str], dense: bool, spec: RunSpec,
                      datas: dict[str, ShapeData]) -> ShapeData:
    """Build inputs; on out-of-memory drop the other shapes' inputs and try once more."""
    kw = dict(r=spec.r, d=spec.d, seed=spec.seed, rotate_factor=spec.rotate_factor, need_dense=dense)
    try:
        return build_shape_data(shape, layouts, spec.device, **kw)
    except torch.OutOfMemoryError:
        datas.clear()
        gc.collect()
        torch.cuda.empty_cache()
        return build_shape_data(shape, layouts, spec.device, **kw)


def _sticky_cuda_error(msg: str) -> bool:
    return any(s in msg for s in ("illegal memory access", "unspecified launch failure", "misaligned address",
                                  "device-side assert"))


def _describe(row: dict[str, Any]) -> str:
    head = f"  {row.get('label', row['shape'])} | {row['variant']:<28}"
    if row["status"] not in ("ok", "mismatch"):
        return f"{head} {row['status'].upper()}: {row.get('error', '')}"
    us = row.get("us")
    if us is None:
        return f"{head} {row['status'].upper()}: {row.get('error', '')}"
    extra = f" {row['tflops']:.1f} TFLOP/s" if row.get("tflops") is not None else ""
    chk = f" check {row['check_rel_l2']:.1e}" if row.get("check_rel_l2") is not None else ""
    flag = "" if row["status"] == "ok" else f" MISMATCH ({row['error']})"
    return f"{head} {us:9.1f} us {row['gbps']:7.0f} GB/s{extra}{chk} [{row.get('timer')}]{flag}"
