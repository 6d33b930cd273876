"""Split-KV absorbed MLA decode over the paged cache: the host side (checks, launch plans).

    mla_decode(q, paged_cache, tau, config, num_splits, **knobs) -> (out, lse)
    mla_decode_plan(...)   the same checks and launches as a `DecodePlan`; `plan.run()` replays it
                           into the plan's own buffers (benchmarks, CUDA graphs)
    plan_decode(q, ops, ...) a plan over `KernelOperands` (pages or the patch's dense rows); with
                           native=True it builds a GPU plan anywhere (`snapquant.bench.compile_stats`)

The kernels, their numerics (step by step against `snapquant.mla_decode_reference`), the work
schedules (uniform / balanced) and the FP8 variants (fp8_mma, tile, p_div) are described in
`decode_kernels.py`; the Gluon kernels (tile="gluon") in `gluon_decode.py` (<= 16 query rows) and
`gluon_wide.py` (64-row tiles). Defaults are the fastest exact configuration measured on the H200:
uniform schedule with the split heuristic below; on Hopper the Gluon kernels for the snapmla layout
with fp8 query and P, and (past 16 rows) for the bf16 layout; else the pairs tile (rows for other
modes), P divided by the fma-corrected reciprocal (bit-identical to a division), exact fp16 MMAs
over e4m3.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

from ..config import KVQuantConfig
from ..errors import ConfigError, ShapeError, unknown_choice
from ._checks import check_tensor
from ._launch import for_device, interpreting
from ._tl import OP_BF16, OP_F32, OP_FP8, OP_FP16
from .decode_kernels import (
    _balanced_metadata,
    _mla_decode_balanced,
    _mla_decode_combine,
    _mla_decode_combine_balanced,
    _mla_decode_stage1,
)
from .layouts import GLUON_ROWS, GLUON_WIDE_ROWS, PAGE_SIZE, layout_of, unsupported_reason
from .paged import PagedMLACache

_LAYOUT_ID = {"bf16": 0, "snapmla": 1, "ds_v32": 2}
LOG2E = math.log2(math.e)
SCHEDULES = ("uniform", "balanced")
P_DIVS = ("exact", "rcp", "fma")
TILES = ("rows", "tokens", "pairs", "gluon")
_TILE_ID = {"rows": 0, "tokens": 1, "pairs": 2}  # the Triton kernels' TILE (gluon: a separate kernel)
# fp8_mma value -> (native FP8 MMA for QK, for PV)
_FP8_MMA = {False: (False, False), True: (True, True), "none": (False, False), "qk": (True, False),
            "pv": (False, True), "both": (True, True)}
# tile="gluon" ring slots. 1: the page is converted in place (~100 KB of shared memory), two programs per
# SM hide each other's waits; H200, B=128 H=16 L=4K: 162.7 us vs 195.1 (2 slots, one page prefetched,
# one program per SM) and 200.2 (3 slots); mixed lengths 220 vs 306 us (results/bench/h200_gluon6_raw)
GLUON_STAGES = 1
# ... except at r = 512, where two slots run `gluon_regs` (register operands widened from the slots, no fp16
# tile: ~105 KB, still two programs per SM, each with a page in flight while it computes one): B=128 H=16
# L=4K 116.7 vs 141.8 us (results/bench/h200_regs)
GLUON_REGS_STAGES = 2
# page slots of the native FP8 kernels (fp8_mma=True past 16 rows): 40 KB each; gluon_wide8, H200 B=32 H=64 L=8K
# 138.7 us with 2, 141.0 with 3, 144.0 with 4 (results/bench/h200_wide8v/r2)
WIDE8_STAGES = 2
# query rows per program of the native FP8 kernels past 16 rows: 32 runs `gluon_narrow8` (4 warps, two
# programs per SM), 64 `gluon_wide8` (8 warps, one program per SM)
WIDE8_ROWS = 32
# Past 16 rows the wide kernel is the default for the snapmla (fp8 query and P) and bf16 layouts. H200
# (results/bench/decode_h200.md): B=32 H=64 L=8K bf16 106.0 vs 304.5 us (Triton rows), snapmla 149.8 vs
# 305.2 (Triton pairs); B=128 H=128 L=4K bf16 361.7 vs 1073.9, snapmla 517.7 vs 985.8; at 32 rows (B=64
# H=32 L=4K, padded to 64) snapmla 166.5 vs 212.2, bf16 100.1 vs 159.8
GLUON_WIDE_DEFAULT = True
MAX_PARTS = 8192  # balanced schedule: partial buffers are [parts + B, rows, r] fp32


@dataclass
class KernelOperands:
    """The cache as the decode kernel addresses it: token t of request b is row t % 64 of "page"
    block_table[b, t // 64], at `page * page_stride + row * token_stride` in each tensor.

    A `PagedMLACache` gives real pages (page_stride = 64 rows). Dense per-request rows `[B, T, ...]`
    (the patch's store) are pages too: page ids are then token offsets b * T' + 64 i and the page
    stride is one row (see `snapquant.kernels.backend`), so no copy is made.
    """

    layout: str
    latent: torch.Tensor  # fp8, or int16 bits for the bf16 layout
    rope: torch.Tensor  # int16 bits of bf16
    scale: torch.Tensor  # fp32; any tensor for the bf16 layout (never read)
    lat_strides: tuple[int, int]  # (page, row)
    rope_strides: tuple[int, int]
    scale_strides: tuple[int, int, int]  # (page, row, block)
    block_table: torch.Tensor  # [B, max_pages] int32
    lengths: torch.Tensor  # [B] int32
    kv_lora_rank: int
    rope_dim: int
    num_scale_blocks: int  # 1 for snapmla and bf16

    @property
    def device(self) -> torch.device:
        return self.latent.device

    @classmethod
    def from_paged(cls, cache: PagedMLACache) -> KernelOperands:
        scale = cache.scale if cache.scale is not None else cache.lengths
        s_strides = (0, 0, 0) if cache.scale is None else (
            scale.stride(0), scale.stride(1), scale.stride(2) if scale.dim() == 3 else 0)
        lat = cache.latent.view(torch.int16) if cache.layout == "bf16" else cache.latent
        return cls(cache.layout, lat, cache.rope.view(torch.int16), scale,
                   (cache.latent.stride(0), cache.latent.stride(1)), (cache.rope.stride(0), cache.rope.stride(1)),
                   s_strides, cache.block_table, cache.lengths, cache.kv_lora_rank, cache.rope_dim,
                   max(cache.num_scale_blocks, 1))


@dataclass
class KernelLaunch:
    """One kernel launch of a plan: `kernel[grid](*args, **kwargs)` (kernel as decorated, compiled build)."""

    name: str
    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict


@dataclass
class DecodePlan:
    """The launches of one decode call and the tensors they write; `run()` performs them."""

    out: torch.Tensor  # [B, S, H, r]
    lse: torch.Tensor  # [B, S, H]
    single: bool  # the query was [B, H, r + d]: return [B, H, ...]
    device: torch.device
    launches: list[KernelLaunch] = field(default_factory=list)
    knobs: dict = field(default_factory=dict)  # the resolved tuning knobs (for reports)
    epilogue: Any = None  # a torch step after the launches (or None)

    compiled: list = field(default_factory=list)  # what each launch returned (compiled kernels on a GPU)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.compiled = [for_device(ln.kernel, self.device)[ln.grid](*ln.args, **ln.kwargs)
                         for ln in self.launches]
        if self.epilogue is not None:
            self.epilogue()
        if self.single:
            return self.out[:, 0], self.lse[:, 0]
        return self.out, self.lse


def mla_decode(
    q_abs: torch.Tensor,
    paged_cache: PagedMLACache,
    softmax_scale: float,
    config: KVQuantConfig | None = None,
    num_splits: int | None = None,
    *,
    causal: bool = True,
    check_bounds: bool = True,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_mma: bool | str = False,
    schedule: str = "uniform",
    p_div: str = "fma",
    tile: str | None = None,
    maxnreg: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode of `q_abs` over a paged cache; same contract as `mla_decode_reference`.

    Args:
        q_abs: `[B, H, r + d]` or `[B, S, H, r + d]` (bf16, fp16 or fp32), last dim contiguous;
            the S query tokens are the last S of each request's `lengths` tokens.
        paged_cache: the cache (its `lengths` include the query tokens).
        softmax_scale: tau (e.g. 1 / sqrt(qk_head_dim) times the yarn mscale^2).
        config: decode knobs (query, pv); default the cache's config. Must match its layout.
        num_splits: uniform schedule: KV splits per request (default: enough programs to fill the
            GPU; tile="gluon": one wave of programs, at most 32 pages each at <= 16 query rows,
            `_one_wave_splits`); balanced schedule: parts of the whole batch's pages (default 2 per SM
            per row tile).
        causal: with S > 1, query token i sees positions < length - (S - 1 - i).
        check_bounds: validate lengths and the block table first (one device sync).
        block_m, num_warps, num_stages, maxnreg: tuning knobs (rows per program; launch
            parameters; maxnreg caps registers per thread, GPU only). With tile="gluon", block_m
            only picks the native FP8 kernel past 16 rows (32 or 64, see tile).
        fp8_mma: native FP8 MMAs (faster, but Hopper accumulates each K=32 step in ~14 bits) for
            the fp8 x fp8 products: False (exact fp16 MMAs), "qk", "pv" or True (both).
        schedule: "uniform" or "balanced" (see the module docstring).
        p_div: how fp8 P = e4m3(f / pi) divides: "fma" (default: a reciprocal per row and one fma
            correction per element, the correctly rounded quotient), "exact" (div_rn per element,
            same bits, slower) or "rcp" (f * (1 / pi): within ~1 ulp, may flip a rounding).
        tile: "rows" (query rows are the MMA's M dimension), "tokens" (swap AB: the page's 64
            tokens are; snapmla and bf16 layouts only), "pairs" (rows, with the fp8 latent read
            as int16 pairs of codes: snapmla layout with fp8 query and P) or "gluon" (Hopper GPU,
            uniform schedule; <= 16 query rows: snapmla with fp8 query and P, two programs per SM,
            `gluon_regs.py` (register MMA operands, two slots: the default at r = 512) or with
            num_stages 1 (the default at other widths) or fp8_mma "qk" `gluon_decode.py`; more rows: `gluon_wide.py`,
            64-row tiles, snapmla with fp8 query and P or the bf16 layout, exact MMAs, or with
            fp8_mma=True native e4m3 QK and PV (snapmla, r = 512): `gluon_narrow8.py` (32-row
            programs, two per SM, the default) or with block_m=64 `gluon_wide8.py`). None
            (default): gluon where it runs, else pairs where it applies, else rows (`default_tile`).

    Returns:
        (out `[B, (S,) H, r]` fp32, lse `[B, (S,) H]` fp32 natural log); rows that see no token
        give out = 0 and lse = -inf.
    """
    return mla_decode_plan(q_abs, paged_cache, softmax_scale, config, num_splits, causal=causal,
                           check_bounds=check_bounds, block_m=block_m, num_warps=num_warps,
                           num_stages=num_stages, fp8_mma=fp8_mma, schedule=schedule, p_div=p_div,
                           tile=tile, maxnreg=maxnreg).run()


def mla_decode_plan(
    q_abs: torch.Tensor,
    paged_cache: PagedMLACache,
    softmax_scale: float,
    config: KVQuantConfig | None = None,
    num_splits: int | None = None,
    *,
    check_bounds: bool = True,
    **knobs: Any,
) -> DecodePlan:
    """`mla_decode`'s checks and launch plan without running it: `plan.run()` decodes into the
    plan's own output buffers, so a benchmark (or a CUDA graph) can replay it with no allocation
    or validation per call. Knobs as in `mla_decode`."""
    cache = _check_cache(paged_cache)
    config = cache.config if config is None else config
    _check_config(config, cache)
    if check_bounds:
        cache.check_bounds()
    return plan_decode(q_abs, KernelOperands.from_paged(cache), softmax_scale, config, num_splits, **knobs)


def launch_decode(
    q_abs: torch.Tensor,
    ops: KernelOperands,
    softmax_scale: float,
    config: KVQuantConfig,
    num_splits: int | None = None,
    **knobs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the query and launch knobs, then run stage 1 (and the combine). `ops` is trusted."""
    return plan_decode(q_abs, ops, softmax_scale, config, num_splits, **knobs).run()


def plan_decode(
    q_abs: torch.Tensor,
    ops: KernelOperands,
    softmax_scale: float,
    config: KVQuantConfig,
    num_splits: int | None = None,
    *,
    causal: bool = True,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    fp8_mma: bool | str = False,
    schedule: str = "uniform",
    p_div: str = "fma",
    tile: str | None = None,
    native: bool | None = None,
    num_sms: int | None = None,
) -> DecodePlan:
    """Allocate the outputs and build the launches of one decode call, without running them.

    `native` (default: the tensors are on a GPU) picks the compiled code paths (True) or the
    interpreter's (False); `num_sms` overrides the device's SM count in the default split and part
    counts. Both exist so a plan can be built for a GPU target on a machine without one.
    """
    q, single = _check_query(q_abs, ops)
    B, S, H, _ = q.shape
    r, d, dev, nb = ops.kv_lora_rank, ops.rope_dim, ops.device, ops.num_scale_blocks
    if not (isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
            and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ShapeError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    if schedule not in SCHEDULES:
        raise unknown_choice("schedule", schedule, SCHEDULES)
    if p_div not in P_DIVS:
        raise unknown_choice("p_div", p_div, P_DIVS)
    if tile is None:
        tile = default_tile(ops.layout, config, fp8_mma)
        triton_knobs = (block_m, num_warps, num_stages, maxnreg) != (None, None, None, None)
        eligible = tile == "pairs" if S * H <= GLUON_ROWS else GLUON_WIDE_DEFAULT
        if schedule == "uniform" and not triton_knobs and eligible and _gluon_runs(ops, S * H, fp8_mma, config):
            # the Gluon kernels where they run (Hopper); launch knobs given for the Triton kernels
            # (block_m, num_warps, num_stages, maxnreg) keep the Triton tile
            tile = "gluon"
    if tile not in TILES:
        raise unknown_choice("tile", tile, TILES)
    if tile == "tokens" and nb != 1:
        raise ConfigError(f"tile='tokens' needs one scale per token; the {ops.layout} layout has {nb} scale blocks")
    if tile == "gluon" and schedule != "uniform":
        raise ConfigError(f"tile={tile!r} runs the uniform schedule only")
    if tile == "pairs" and (ops.layout != "snapmla" or config.query != "fp8_e4m3"
                            or config.pv != "fp8_scale_fused" or fp8_mma not in (False, "none")):
        raise ConfigError(f"tile={tile!r} runs the snapmla layout with an fp8 query, fp8 P and exact fp16 MMAs; got the "
                          f"{ops.layout} layout, query={config.query!r}, pv={config.pv!r}, fp8_mma={fp8_mma!r}")
    if not isinstance(fp8_mma, (bool, str)) or fp8_mma not in _FP8_MMA:
        raise unknown_choice("fp8_mma", fp8_mma, [str(k) for k in _FP8_MMA])
    native = (not interpreting(dev)) if native is None else bool(native)
    if tile == "gluon" and (reason := _gluon_reason(ops, S * H, native, num_warps, num_stages, fp8_mma,
                                                     config, block_m)) is not None:
        raise ConfigError(reason)
    sms = num_sms if num_sms is not None else _num_sms(dev)
    bw = r // nb
    rows = S * H
    if tile == "gluon":  # the kernel's query rows per program (native FP8 past 16 rows: 32 or 64, a knob)
        block_m = (GLUON_ROWS if S * H <= GLUON_ROWS else (block_m or WIDE8_ROWS) if fp8_mma is True
                   else GLUON_WIDE_ROWS)
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
    _check_pow2("block_m", block_m, 16)
    m_blocks = triton.cdiv(rows, block_m)
    if num_splits is None:
        if tile == "gluon":
            # the narrow kernel with one stage fits two programs per SM (shared memory ~100 KB)
            narrow = block_m == GLUON_ROWS
            resident = (_narrow_resident(_gluon_stages(num_stages, fp8_mma, r), fp8_mma == "qk") if narrow
                        else 2 if block_m == 32 else 1)
            num_splits = _one_wave_splits(B * m_blocks, ops.block_table.shape[1], sms * resident,
                                          NARROW_MAX_RUN if narrow else None)
        elif schedule == "uniform":
            num_splits = _default_splits(B * m_blocks * nb, ops.block_table.shape[1], sms)
        else:
            num_splits = default_parts(m_blocks * nb, sms)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ShapeError(f"num_splits must be a positive int, got {num_splits!r}")
    if schedule == "balanced" and num_splits > MAX_PARTS:
        raise ShapeError(f"num_splits={num_splits} parts is above the balanced schedule's limit {MAX_PARTS}")
    for name, v in (("num_warps", num_warps), ("num_stages", num_stages), ("maxnreg", maxnreg)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ShapeError(f"{name} must be a positive int, got {v!r}")

    q_fp8, p_fp8 = config.query == "fp8_e4m3", config.pv == "fp8_scale_fused"
    if not native:
        qk_kind = pv_kind = r_kind = OP_F32
    else:
        # e4m3 values are exact in fp16 and an fp16 MMA accumulates exact products in fp32, which is
        # the reference's arithmetic; Hopper's FP8 MMA keeps only ~14 bits inside each K=32 step
        # (measured 4.5e-5 relative at M = 64 even when promoted every 32). Opt in with fp8_mma.
        mma_qk, mma_pv = _FP8_MMA[fp8_mma]
        r_kind = OP_BF16
        qk_kind = (OP_FP8 if mma_qk and bw >= 32 else OP_FP16) if q_fp8 else OP_BF16
        pv_kind = (OP_FP8 if mma_pv else OP_FP16) if p_fp8 else OP_BF16
    launch: dict[str, int] = {}
    if native:
        # 8 warps measured fastest on an H200 for every layout at H = 16 and 64 (e.g. bf16 280 -> 225 us)
        # 3 stages for the BF16 layout at 16-row tiles: 214-215 vs 218-224 us at B=128 H=16 L=4K in three
        # H200 runs (2.81 TB/s); 2 everywhere else (3 stages cost 30-60 % at 64-row tiles)
        stages = 3 if ops.layout == "bf16" and block_m == 16 else 2
        launch = {"num_warps": num_warps or 8, "num_stages": num_stages or stages}
        if maxnreg is not None:  # a register cap, e.g. 128 with 8 warps lets two programs share an SM
            launch["maxnreg"] = maxnreg
    q_arg = q.view(torch.int16) if q.dtype == torch.bfloat16 else q
    common = dict(
        S=S, R=r, D=d, NB=nb, LAYOUT=_LAYOUT_ID[ops.layout], Q_FP8=q_fp8, P_FP8=p_fp8,
        Q_BITS16=q.dtype == torch.bfloat16, CAUSAL=bool(causal), BLOCK_M=block_m, PAGE=PAGE_SIZE,
        NATIVE=native, QK_KIND=qk_kind, PV_KIND=pv_kind, R_KIND=r_kind, P_DIV=P_DIVS.index(p_div),
        TILE=_TILE_ID.get(tile, -1), **launch,
    )
    lat_arg, lat_strides = ops.latent, ops.lat_strides
    if tile == "pairs":  # the same bytes as int16 pairs of codes; strides in int16 units
        if any(st % 2 for st in lat_strides) or r % 2:
            raise ShapeError(f"tile='pairs' needs even latent strides, got {lat_strides} (kv_lora_rank {r})")
        lat_arg, lat_strides = ops.latent.view(torch.int16), tuple(st // 2 for st in lat_strides)
    cache_args = (
        q.stride(0), q.stride(1), q.stride(2),
        *lat_strides, *ops.rope_strides, *ops.scale_strides, ops.block_table.stride(0),
    )
    out = torch.empty(B, S, H, r, dtype=torch.float32, device=dev)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=dev)
    knobs = {"schedule": schedule, "num_splits": num_splits, "block_m": block_m, "fp8_mma": fp8_mma,
             "p_div": p_div, "tile": tile, **launch}
    plan = DecodePlan(out, lse, single, dev, knobs=knobs)
    out_v, lse_v = out.view(B, rows, r), lse.view(B, rows)
    small = {} if not native else {"num_warps": 4}
    if schedule == "balanced":
        cum = torch.empty(B + 1, dtype=torch.int32, device=dev)
        o_part = torch.empty(num_splits + B, rows, r, dtype=torch.float32, device=dev)
        lse_part = torch.empty(num_splits + B, rows, nb, dtype=torch.float32, device=dev)
        plan.launches += [
            KernelLaunch("balanced_metadata", _balanced_metadata, (1,), (ops.lengths, cum, B),
                         dict(PAGE=PAGE_SIZE, BLOCK_B=triton.next_power_of_2(B), **small)),
            KernelLaunch("decode_balanced", _mla_decode_balanced, (num_splits, m_blocks, nb), (
                q_arg, lat_arg, ops.rope, ops.scale, ops.block_table, ops.lengths, cum, out_v, lse_v,
                o_part, lse_part, float(softmax_scale) * LOG2E, *cache_args,
                out_v.stride(0), out_v.stride(1), lse_v.stride(0),
                o_part.stride(0), o_part.stride(1), lse_part.stride(0), lse_part.stride(1),
                H, B, num_splits), common),
            KernelLaunch("combine_balanced", _mla_decode_combine_balanced, (B, rows, nb), (
                cum, o_part, lse_part, out_v, lse_v,
                o_part.stride(0), o_part.stride(1), lse_part.stride(0), lse_part.stride(1),
                out_v.stride(0), out_v.stride(1), lse_v.stride(0), B, num_splits), dict(BW=bw, **small)),
        ]
        return plan
    if num_splits == 1:  # stage 1 writes the final result directly
        o_part = out.view(B, rows, 1, r)
        lse_part = lse.view(B, rows, 1, 1)
        if nb > 1:  # one LSE per output chunk; the final LSE is chunk 0's
            lse_part = torch.empty(B, rows, 1, nb, dtype=torch.float32, device=dev)
    else:
        o_part = torch.empty(B, rows, num_splits, r, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B, rows, num_splits, nb, dtype=torch.float32, device=dev)
    if tile == "gluon" and block_m == GLUON_ROWS:
        plan.launches.append(_gluon_launch(q, ops, o_part, lse_part, float(softmax_scale) * LOG2E, num_splits,
                                           bool(causal), P_DIVS.index(p_div), fp8_mma == "qk",
                                           _gluon_stages(num_stages, fp8_mma, r), num_warps or 4))
        knobs.update(num_warps=num_warps or 4, num_stages=_gluon_stages(num_stages, fp8_mma, r))
    elif tile == "gluon":
        plan.launches.append(_gluon_wide_launch(q, ops, o_part, lse_part, float(softmax_scale) * LOG2E, num_splits,
                                                bool(causal), P_DIVS.index(p_div), m_blocks, fp8_mma is True,
                                                num_stages or WIDE8_STAGES, block_m))
        knobs.update(num_warps=4 if block_m == 32 else 8,
                     num_stages=(num_stages or WIDE8_STAGES) if fp8_mma is True else 2)
    else:
        plan.launches.append(KernelLaunch("decode_uniform", _mla_decode_stage1, (B, m_blocks, num_splits * nb), (
            q_arg, lat_arg, ops.rope, ops.scale, ops.block_table, ops.lengths, o_part, lse_part,
            float(softmax_scale) * LOG2E, *cache_args,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), H, num_splits,
        ), dict(LSE_NATURAL=num_splits == 1, **common)))
    if num_splits == 1:
        if nb > 1:  # the final LSE is chunk 0's
            plan.epilogue = functools.partial(lse_v.copy_, lse_part[:, :, 0, 0])
        return plan
    plan.launches.append(KernelLaunch("combine", _mla_decode_combine, (B, rows, nb), (
        o_part, lse_part, out_v, lse_v,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        out_v.stride(0), out_v.stride(1), lse_v.stride(0), num_splits,
    ), dict(NSPLIT_P2=triton.next_power_of_2(num_splits), NB=nb, BW=bw, NATIVE=native, **small)))
    return plan


def _gluon_reason(ops: KernelOperands, rows: int, native: bool, num_warps: int | None, num_stages: int | None,
                  fp8_mma: bool | str, config: KVQuantConfig, block_m: int | None = None) -> str | None:
    """Why tile="gluon" cannot run these operands, config and knobs (None when it can). A CUDA device
    must be Hopper; a meta device (plans compiled without a GPU, `compile_stats`) is taken as one."""
    from .gluon_decode import gluon_unsupported_reason

    reason = gluon_unsupported_reason(ops.layout, config.query == "fp8_e4m3", config.pv == "fp8_scale_fused", rows,
                                      ops.kv_lora_rank, ops.rope_dim, ops.latent, ops.lat_strides, ops.rope,
                                      ops.rope_strides)
    if reason is not None:
        return reason
    if not native:
        return "tile='gluon' needs a Hopper GPU (Gluon kernels have no interpreter mode)"
    wide = rows > GLUON_ROWS
    wide8_rows = (block_m or WIDE8_ROWS) if wide and fp8_mma is True else None
    if wide8_rows not in (None, 32, 64):
        return f"tile='gluon' with fp8_mma=True runs block_m 32 (gluon_narrow8) or 64 (gluon_wide8), got {block_m}"
    if block_m is not None and wide8_rows is None:
        return (f"tile='gluon' picks its own rows per program ({GLUON_ROWS} or {GLUON_WIDE_ROWS}); block_m is a knob "
                f"of the native FP8 kernels past {GLUON_ROWS} rows (fp8_mma=True) only, got block_m={block_m}")
    warps = 8 if wide and wide8_rows != 32 else 4
    if num_warps not in (None, warps):
        return f"tile='gluon' at {rows} query rows runs num_warps={warps}, got num_warps={num_warps}"
    if wide and fp8_mma is True and num_stages not in (None, 2, 3, 4):
        return (f"tile='gluon' with fp8_mma=True at > {GLUON_ROWS} query rows runs num_stages 2, 3 or 4 (TMA slots), "
                f"got num_stages={num_stages}")
    if wide and fp8_mma is not True and num_stages not in (None, 2):
        return f"tile='gluon' at > {GLUON_ROWS} query rows runs num_stages=2 (two TMA slots), got num_stages={num_stages}"
    if wide:  # native FP8 MMAs past 16 rows (gluon_narrow8 / gluon_wide8): the snapmla layout only
        allowed = (False, "none", True) if ops.layout == "snapmla" else (False, "none")
    else:
        allowed = (False, "none", "qk")
    if fp8_mma not in allowed:
        native8 = " or fp8_mma=True (the snapmla layout)" if wide else " or fp8_mma=qk"
        return f"tile='gluon' runs exact fp16 MMAs{native8} at {rows} query rows, got fp8_mma={fp8_mma!r}"
    if ops.device.type == "cuda" and _capability(ops.device)[0] != 9:
        return f"tile='gluon' runs on Hopper (sm_90) only, not {torch.cuda.get_device_name(ops.device)}"
    regs = not wide and _narrow_regs(_gluon_stages(num_stages, fp8_mma, ops.kv_lora_rank), fp8_mma == "qk")
    if regs and ops.kv_lora_rank != 512:
        return (f"tile='gluon' at <= {GLUON_ROWS} rows with num_stages >= 2 (register operands, gluon_regs) is "
                f"written for kv_lora_rank 512 (four 128-channel boxes), got {ops.kv_lora_rank}")
    if fp8_mma in ("qk", True) and ops.kv_lora_rank != 512:
        return (f"tile='gluon' with fp8_mma={fp8_mma!r} is written for kv_lora_rank 512 (four 128-channel boxes), "
                f"got {ops.kv_lora_rank}")
    return None


def _gluon_runs(ops: KernelOperands, rows: int, fp8_mma: bool | str, config: KVQuantConfig) -> bool:
    """True when tile="gluon" runs these operands on their (real) GPU: the default tile's test."""
    dev = ops.device
    return (dev.type == "cuda" and not interpreting(dev)
            and _gluon_reason(ops, rows, True, None, None, fp8_mma, config) is None)


def _gluon_stages(num_stages: int | None, fp8_mma: bool | str, r: int) -> int:
    """Ring slots of the <= 16-row Gluon kernel when not given. Exact MMAs at r = 512: two, i.e.
    `gluon_regs` (register operands, no fp16 tile, two programs per SM); H200 B=128 H=16 L=4K 116.7 us vs
    141.8 for the in-place slot of `gluon_decode`, B=32 L=16K 115.2 vs 140.5, B=8 L=32K 68.4 vs 81.3
    (results/bench/h200_regs). Other widths: the in-place slot (GLUON_STAGES). Native FP8 QK: two
    separate slots in `gluon_decode` (175.5 vs 195.2 us exact at the time; its single-slot form measured
    163.7 vs 162.2 us exact, run W4)."""
    if num_stages is not None:
        return num_stages
    if fp8_mma == "qk":
        return 2
    return GLUON_REGS_STAGES if r == 512 else GLUON_STAGES


def _gluon_args(q, ops, o_part, lse_part, sm_scale_log2, num_splits, fp8):
    """The arguments both Gluon page loops take (their signatures match): the query, TMA descriptors of
    the latent (fp8, or the bf16 layout's int16 bits seen as bf16) and RoPE rows, the rest as strides."""
    from .gluon_decode import make_descriptors

    (lp, lt), (rp, rt) = ops.lat_strides, ops.rope_strides
    lat = ops.latent if fp8 else ops.latent.view(torch.bfloat16)
    lat_desc, rope_desc = make_descriptors(lat, lt, ops.rope.view(torch.bfloat16), rt, fp8)
    return (q, lat_desc, rope_desc, ops.scale, ops.block_table, ops.lengths, o_part, lse_part, sm_scale_log2,
            q.stride(0), q.stride(1), q.stride(2), lp // lt, rp // rt, ops.scale_strides[0], ops.scale_strides[1],
            ops.block_table.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), q.shape[2], num_splits)


def _gluon_launch(q, ops, o_part, lse_part, sm_scale_log2, num_splits, causal, p_div, qk_fp8, stages, warps):
    """The <= 16-row Gluon page loop as stage 1 of the uniform schedule: `gluon_decode` (one slot widened
    in place, or slots feeding its native FP8 QK) or, with exact MMAs and two or more slots,
    `gluon_regs` (register operands widened from the slots, no fp16 tile)."""
    B, S = q.shape[:2]
    args = _gluon_args(q, ops, o_part, lse_part, sm_scale_log2, num_splits, True)
    common = dict(S=S, R=ops.kv_lora_rank, D=ops.rope_dim, PAGE=PAGE_SIZE, STAGES=stages, CAUSAL=causal,
                  P_DIV=p_div, LSE_NATURAL=num_splits == 1, num_warps=warps)
    if _narrow_regs(stages, qk_fp8):
        from .gluon_regs import _snapmla_decode_gluon_regs

        return KernelLaunch("decode_gluon_regs", _snapmla_decode_gluon_regs, (B, 1, num_splits), args, common)
    from .gluon_decode import _snapmla_decode_gluon

    return KernelLaunch("decode_gluon", _snapmla_decode_gluon, (B, 1, num_splits), args,
                        dict(QK_FP8=qk_fp8, **common))


def _narrow_regs(stages: int, qk_fp8: bool) -> bool:
    """The <= 16-row kernel with register operands (`gluon_regs`): exact MMAs and two or more slots."""
    return stages >= 2 and not qk_fp8


def _narrow_resident(stages: int, qk_fp8: bool) -> int:
    """Programs of the <= 16-row kernel per SM (shared memory): the in-place slot (~98 KB) and the
    register-operand kernel with two slots (~105 KB) fit two; the other configurations one."""
    return 2 if stages == 1 or (stages == 2 and not qk_fp8) else 1


def _gluon_wide_launch(q, ops, o_part, lse_part, sm_scale_log2, num_splits, causal, p_div, m_blocks, mma8, stages,
                       block_m):
    """The Gluon page loop past 16 rows as stage 1 of the uniform schedule: `gluon_wide` (64 rows, exact
    fp16 MMAs, fp8 snapmla or bf16, two slots) or, with native FP8 MMAs (fp8_mma=True, `stages` slots),
    `gluon_narrow8` (block_m 32) or `gluon_wide8` (64), both with FAST=True (their softmax in fewer
    instructions, the same arithmetic; H200 B=32 H=64 L=8K 124.7 -> 117.7 us and 140.2 -> 125.9,
    results/bench/h200_native8). `gluon_narrow8` with AHEAD=True (block-table indices a page early:
    118.1 -> 116.8 us there, 404.4 -> 400.6 at B=128 H=128 L=4K; `gluon_wide8` measured none faster,
    results/bench/h200_trace/probe1.json)."""
    B, S = q.shape[:2]
    fp8 = ops.layout == "snapmla"
    args = _gluon_args(q, ops, o_part, lse_part, sm_scale_log2, num_splits, fp8)
    common = dict(S=S, R=ops.kv_lora_rank, D=ops.rope_dim, PAGE=PAGE_SIZE, CAUSAL=causal, P_DIV=p_div,
                  LSE_NATURAL=num_splits == 1, num_warps=8)
    if mma8 and block_m == 32:
        from .gluon_narrow8 import _mla_decode_gluon_narrow8

        return KernelLaunch("decode_gluon_narrow8", _mla_decode_gluon_narrow8, (m_blocks, B, num_splits), args,
                            dict(CHAINS=2, STAGES=stages, FAST=True, AHEAD=True, **dict(common, num_warps=4)))
    if mma8:
        from .gluon_wide8 import _mla_decode_gluon_wide8

        return KernelLaunch("decode_gluon_wide8", _mla_decode_gluon_wide8, (m_blocks, B, num_splits), args,
                            dict(CHAINS=2, STAGES=stages, FAST=True, **common))
    from .gluon_wide import _mla_decode_gluon_wide

    return KernelLaunch("decode_gluon_wide", _mla_decode_gluon_wide, (m_blocks, B, num_splits), args,
                        dict(FP8=fp8, SM_ROWS=True, **common))


def default_tile(layout: str, config: KVQuantConfig, fp8_mma: bool | str = False) -> str:
    """"pairs" where it applies (snapmla layout, fp8 query and P, exact fp16 MMAs), else "rows".

    H200 (results/bench/decode_h200.md): pairs is faster than rows at every shape measured, e.g.
    B=128 H=16 L=4096 266 vs 321 us, B=32 H=64 L=8192 332 vs 417 us (both with a reciprocal P scale)."""
    fp8_both = config.query == "fp8_e4m3" and config.pv == "fp8_scale_fused"
    return "pairs" if layout == "snapmla" and fp8_both and fp8_mma in (False, "none") else "rows"


def _capability(device: torch.device) -> tuple[int, int]:
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def default_parts(row_tiles_x_chunks: int, num_sms: int) -> int:
    """Balanced schedule: two programs per SM over all row tiles and output chunks (FlashMLA runs one
    part per SM with one CTA each; ours hold fewer rows, so two give latency hiding room)."""
    return max(1, min(MAX_PARTS, (2 * num_sms) // max(row_tiles_x_chunks, 1)))


@functools.lru_cache(maxsize=16)
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _sms_of(device.index if device.index is not None else torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------- checks
def _check_cache(cache: object) -> PagedMLACache:
    if not isinstance(cache, PagedMLACache):
        raise ShapeError(f"paged_cache must be a PagedMLACache, got {type(cache).__name__}")
    return cache


def _check_config(config: KVQuantConfig, cache: PagedMLACache) -> None:
    if not isinstance(config, KVQuantConfig):
        raise ConfigError(f"config must be a KVQuantConfig, got {type(config).__name__}")
    reason = unsupported_reason(config, cache.kv_lora_rank, cache.rope_dim)
    if reason is not None:
        raise ConfigError(f"the Triton decode does not implement config {config.label()!r}: {reason}")
    same_blocks = cache.layout != "ds_v32" or config.block_size == cache.config.block_size
    if layout_of(config) != cache.layout or not same_blocks:
        raise ConfigError(f"config {config.label()!r} reads the {layout_of(config)} layout but the cache holds "
                          f"the {cache.layout} layout of {cache.config.label()!r}")


def _check_query(q: object, cache: KernelOperands) -> tuple[torch.Tensor, bool]:
    check_tensor("q_abs", q, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=(3, 4), device=cache.device)
    single = q.dim() == 3
    q4 = q.unsqueeze(1) if single else q
    B, S, H, D = q4.shape
    r, d = cache.kv_lora_rank, cache.rope_dim
    if D != r + d:
        raise ShapeError(f"q_abs's last dim is {D} but the cache has kv_lora_rank {r} + rope_dim {d} = {r + d}")
    if B != cache.block_table.shape[0]:
        raise ShapeError(f"q_abs has batch {B} but the cache's block_table has {cache.block_table.shape[0]} rows")
    if S < 1 or H < 1:
        raise ShapeError(f"q_abs must have at least one query token and one head, got shape {tuple(q.shape)}")
    return q4, single


def _check_pow2(name: str, v: object, lo: int) -> None:
    if not isinstance(v, int) or v < lo or v & (v - 1):
        raise ShapeError(f"{name} must be a power of two >= {lo}, got {v!r}")


# The narrow kernel's longest page run per program. The host cannot see the lengths (they live on the GPU),
# and a batch of mixed lengths is as slow as its longest request's run: H200, B=64 H=16 lengths 128..32K,
# one wave (4 splits) 474 us, the uniform rule's 12 splits 218 us. 32 pages keeps every uniform H=16 shape
# measured at its one-wave count (e.g. B=128 L=4K: 2 splits, 32 pages each).
NARROW_MAX_RUN = 32


def _one_wave_splits(programs: int, max_pages: int, slots: int, max_run: int | None = None) -> int:
    """tile="gluon": as few splits as fill one wave of program slots (SMs x programs per SM), never more
    than the pages or 64. Each split writes an fp32 partial per query row that the combine reads back,
    and a second, partial wave costs a whole page run. H200 (results/bench/h200_wide_probe,
    h200_narrow_splits): 64 rows, B=32 H=64 L=8K: 4 splits (128 programs) 153 / 118 us (snapmla / bf16),
    8: 171 / 132, 12: 195 / 148; B=128 H=128 L=4K: 2 splits 583 / 444, 4: 651 / 496. 16 rows (two
    programs per SM, 264 slots), snapmla: B=128 H=16 L=4K 2 splits 141.7 us, 3: 184.4, 4: 150.6,
    6 (the old rule): 161.1; B=32 L=16K 8: 140.5, 6: 180.9, 12: 192.3, 23 (old): 175.0; B=64 L=2K
    4: 47.2, 3: 55.5, 6: 63.8, 12 (old): 67.0."""
    splits = slots // max(programs, 1)
    if max_run is not None:  # at least enough splits that no program runs more than max_run pages
        splits = max(splits, triton.cdiv(max_pages, max_run))
    return max(1, min(splits, max_pages, 64))


def _default_splits(programs: int, max_pages: int, sms: int, min_wave_fill: float = 0.9) -> int:
    """Uniform schedule: about 2 programs per SM (the split count validated on the H200), never more
    than the pages or 64 (combine cost), nudged to the nearest count whose last wave of programs is
    nearly full. The decode kernels run one program per SM (registers), so 288 programs on 132 SMs
    take 3 waves for 2.2 waves of work; the H200 measured 256 programs (8 splits at B = 32) 15-19 %
    faster than 288 (9 splits) for both the FP8 and the BF16 kernel (docs/perf-notes.md)."""
    cap = max(1, min(max_pages, 64))
    base = max(1, min(triton.cdiv(2 * sms, programs), cap))

    def fill(s: int) -> float:
        total = programs * s
        return total / (triton.cdiv(total, sms) * sms)

    if fill(base) >= min_wave_fill:
        return base
    # More splits first: with mixed lengths the longest request's run sets the time, so fewer splits
    # would lengthen it (B=64 mixed 128..32K: 5 -> 4 splits measured 16 % slower); then fewer.
    for s in [*range(base + 1, cap + 1), *range(base - 1, 0, -1)]:
        if fill(s) >= min_wave_fill:
            return s
    return base
