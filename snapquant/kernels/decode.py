"""Split-KV absorbed MLA decode over the paged cache: the host side (checks, launch plans).

    mla_decode(q, paged_cache, tau, config, num_splits, options=..., **knobs) -> (out, lse)
    mla_decode_plan(...)   the same checks and launches as a `DecodePlan`; `plan.run()` replays it into
                           the plan's own buffers (benchmarks, CUDA graphs)
    plan_decode(q, ops, ...) a plan over `KernelOperands` (pages or the patch's dense rows); with
                           native=True it builds a GPU plan anywhere (`snapquant.kernels.compile_stats`,
                           `scripts/dump_ptx.py`)

The knobs are a `DecodeOptions` (`options.py`), given whole (`options=`) or as keywords; which kernel
runs is `dispatch.choose_kernel`'s table (docs/kernels.md). This module only builds the launches: the
Triton stage 1 (`triton/decode.py`, uniform or balanced schedule) or a Gluon page loop (`gluon/`),
then the LSE combine of the splits (`triton/combine.py`). The kernels' numerics, step by step against
`snapquant.mla_decode_reference`, are in `triton/decode.py`'s docstring.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

from ..config import KVQuantConfig
from ..errors import ConfigError, ShapeError
from ._checks import check_tensor
from ._launch import for_device
from .dispatch import NARROW_HALVES_MAXNREG, NARROW_ONE_SLOT_MAXNREG, KernelChoice, Target, choose_kernel
from .layouts import LAYOUT_ID, PAGE_SIZE, layout_of, unsupported_reason
from .operands import KernelOperands
from .options import DEFAULT_L2_PREFETCH, DEFAULT_WIDEN, P_DIVS, WIDENS, DecodeOptions, as_options
from .paged import PagedMLACache
from .triton.combine import mla_decode_combine, mla_decode_combine_balanced
from .triton.common import OP_BF16, OP_F32, OP_FP8, OP_FP16
from .triton.decode import balanced_metadata, mla_decode_balanced, mla_decode_stage1

LOG2E = math.log2(math.e)
_TILE_ID = {"rows": 0, "tokens": 1, "pairs": 2}  # the Triton kernels' TILE constexpr
_FP8_MMA = {False: (False, False), True: (True, True), "qk": (True, False), "pv": (False, True)}  # -> (QK, PV)


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
    knobs: dict = field(default_factory=dict)  # the kernel and its resolved knobs (for reports)
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
    options: DecodeOptions | Mapping[str, Any] | None = None,
    **knobs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode of `q_abs` over a paged cache; same contract as `mla_decode_reference`.

    Args:
        q_abs: `[B, H, r + d]` or `[B, S, H, r + d]` (bf16, fp16 or fp32), last dim contiguous;
            the S query tokens are the last S of each request's `lengths` tokens.
        paged_cache: the cache (its `lengths` include the query tokens).
        softmax_scale: tau (e.g. 1 / sqrt(qk_head_dim) times the yarn mscale^2).
        config: decode knobs (query, pv); default the cache's config. Must match its layout.
        num_splits: KV splits per request (uniform schedule) or parts of the batch's pages (balanced);
            default a heuristic per kernel (`dispatch`). The same as `options.num_splits`.
        causal: with S > 1, query token i sees positions < length - (S - 1 - i).
        check_bounds: validate lengths and the block table first (one device sync).
        options: a `DecodeOptions` (or a mapping of its fields): tile, schedule, num_splits, fp8_mma,
            p_div, block_m, num_warps, num_stages, maxnreg (see `snapquant.kernels.options`).
        **knobs: the same fields as keywords, on top of `options`.

    Returns:
        (out `[B, (S,) H, r]` fp32, lse `[B, (S,) H]` fp32 natural log); rows that see no token
        give out = 0 and lse = -inf.
    """
    return mla_decode_plan(q_abs, paged_cache, softmax_scale, config, num_splits, causal=causal,
                           check_bounds=check_bounds, options=options, **knobs).run()


def mla_decode_plan(
    q_abs: torch.Tensor,
    paged_cache: PagedMLACache,
    softmax_scale: float,
    config: KVQuantConfig | None = None,
    num_splits: int | None = None,
    *,
    check_bounds: bool = True,
    **kwargs: Any,
) -> DecodePlan:
    """`mla_decode`'s checks and launch plan without running it: `plan.run()` decodes into the
    plan's own output buffers, so a benchmark (or a CUDA graph) can replay it with no allocation
    or validation per call. Arguments as in `mla_decode`."""
    cache = _check_cache(paged_cache)
    config = cache.config if config is None else config
    _check_config(config, cache)
    if check_bounds:
        cache.check_bounds()
    return plan_decode(q_abs, KernelOperands.from_paged(cache), softmax_scale, config, num_splits, **kwargs)


def launch_decode(
    q_abs: torch.Tensor,
    ops: KernelOperands,
    softmax_scale: float,
    config: KVQuantConfig,
    num_splits: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the query and options, then run stage 1 (and the combine). `ops` is trusted."""
    return plan_decode(q_abs, ops, softmax_scale, config, num_splits, **kwargs).run()


def plan_decode(
    q_abs: torch.Tensor,
    ops: KernelOperands,
    softmax_scale: float,
    config: KVQuantConfig,
    num_splits: int | None = None,
    *,
    causal: bool = True,
    options: DecodeOptions | Mapping[str, Any] | None = None,
    native: bool | None = None,
    num_sms: int | None = None,
    arch: int | None = None,
    **knobs: Any,
) -> DecodePlan:
    """Allocate the outputs and build the launches of one decode call, without running them.

    `native` (default: the tensors are on a GPU) picks the compiled code paths (True) or the
    interpreter's (False); `num_sms` overrides the device's SM count in the default split counts and
    `arch` its compute capability (e.g. 90) in the default kernel. They exist so a plan can be built
    for a GPU target on a machine without one (without `arch` such a plan defaults to the Triton tiles,
    and runs a Gluon kernel when asked for with tile="gluon").
    """
    opts = as_options(options, num_splits=num_splits, **knobs)
    q, single = _check_query(q_abs, ops)
    B, S, H, _ = q.shape
    if not (isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
            and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ShapeError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    target = Target.of(ops.device, native, num_sms, arch)
    choice = choose_kernel(ops, config, S * H, target, opts)
    dev, r, rows = ops.device, ops.kv_lora_rank, S * H
    out = torch.empty(B, S, H, r, dtype=torch.float32, device=dev)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=dev)
    knobs = {"kernel": choice.kernel, "schedule": choice.schedule, "num_splits": choice.num_splits,
             "block_m": choice.block_m, "fp8_mma": opts.fp8_mma, "p_div": opts.p_div, "tile": choice.tile}
    if choice.num_warps is not None:
        knobs.update(num_warps=choice.num_warps, num_stages=choice.num_stages)
    if opts.maxnreg is not None and target.native:
        knobs["maxnreg"] = opts.maxnreg
    pdl = _use_pdl(opts, target)
    knobs["pdl"] = pdl
    plan = DecodePlan(out, lse, single, dev, knobs=knobs)
    sm_scale_log2 = float(softmax_scale) * LOG2E
    if choice.schedule == "balanced":
        plan.launches += _balanced_launches(q, ops, config, choice, target, out, lse, sm_scale_log2, causal, pdl)
        return plan
    nb, splits = ops.num_scale_blocks, choice.num_splits
    if splits == 1:  # stage 1 writes the final result directly
        o_part = out.view(B, rows, 1, r)
        lse_part = lse.view(B, rows, 1, 1)
        if nb > 1:  # one LSE per output chunk; the final LSE is chunk 0's
            lse_part = torch.empty(B, rows, 1, nb, dtype=torch.float32, device=dev)
    else:
        o_part = torch.empty(B, rows, splits, r, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B, rows, splits, nb, dtype=torch.float32, device=dev)
    if choice.tile == "gluon":
        plan.launches.append(_gluon_launch(q, ops, choice, o_part, lse_part, sm_scale_log2, causal))
    else:
        plan.launches.append(_uniform_launch(q, ops, config, choice, target, o_part, lse_part, sm_scale_log2,
                                             causal))
    out_v, lse_v = out.view(B, rows, r), lse.view(B, rows)
    if splits == 1:
        if nb > 1:  # the final LSE is chunk 0's
            plan.epilogue = functools.partial(lse_v.copy_, lse_part[:, :, 0, 0])
        return plan
    plan.launches.append(KernelLaunch("combine", mla_decode_combine, (B, rows, nb), (
        o_part, lse_part, out_v, lse_v,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        out_v.stride(0), out_v.stride(1), lse_v.stride(0), splits,
    ), dict(NSPLIT_P2=triton.next_power_of_2(splits), NB=nb, BW=r // nb, NATIVE=target.native,
            **_small_launch(target, pdl))))
    return plan


def _use_pdl(opts: DecodeOptions, target: Target) -> bool:
    """Whether the combine is launched as a programmatic dependent of stage 1 (`DecodeOptions.pdl`)."""
    able = target.native and target.arch is not None and target.arch >= 90
    if opts.pdl and not able:
        where = "the Triton interpreter" if not target.native else f"compute capability {target.arch}"
        raise ConfigError(f"pdl=True needs kernels compiled for compute capability >= 9.0, not {where}")
    return opts.pdl


# ------------------------------------------------------------------------------------------- Triton launches
def _triton_constexprs(q: torch.Tensor, ops: KernelOperands, config: KVQuantConfig, choice: KernelChoice,
                       target: Target, causal: bool) -> dict[str, Any]:
    """The Triton stage-1 kernels' constexprs and launch options for this call."""
    opts = choice.options
    q_fp8, p_fp8 = config.query == "fp8_e4m3", config.pv == "fp8_scale_fused"
    bw = ops.kv_lora_rank // ops.num_scale_blocks
    if not target.native:
        qk_kind = pv_kind = r_kind = OP_F32
    else:
        # e4m3 values are exact in fp16 and an fp16 MMA accumulates exact products in fp32, which is
        # the reference's arithmetic; Hopper's FP8 MMA keeps only ~14 bits inside each K=32 step
        # (not the reference's arithmetic even when promoted every 32). Opt in with fp8_mma.
        mma_qk, mma_pv = _FP8_MMA[opts.fp8_mma]
        r_kind = OP_BF16
        qk_kind = (OP_FP8 if mma_qk and bw >= 32 else OP_FP16) if q_fp8 else OP_BF16
        pv_kind = (OP_FP8 if mma_pv else OP_FP16) if p_fp8 else OP_BF16
    launch: dict[str, int] = {}
    if target.native:
        launch = {"num_warps": choice.num_warps, "num_stages": choice.num_stages}
        if opts.maxnreg is not None:  # a register cap, e.g. 128 with 8 warps lets two programs share an SM
            launch["maxnreg"] = opts.maxnreg
    return dict(
        S=q.shape[1], R=ops.kv_lora_rank, D=ops.rope_dim, NB=ops.num_scale_blocks, LAYOUT=LAYOUT_ID[ops.layout],
        Q_FP8=q_fp8, P_FP8=p_fp8, Q_BITS16=q.dtype == torch.bfloat16, CAUSAL=bool(causal), BLOCK_M=choice.block_m,
        PAGE=PAGE_SIZE, NATIVE=target.native, QK_KIND=qk_kind, PV_KIND=pv_kind, R_KIND=r_kind,
        P_DIV=P_DIVS.index(opts.p_div), TILE=_TILE_ID[choice.tile], **launch,
    )


def _triton_cache_args(q: torch.Tensor, ops: KernelOperands, tile: str) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """(query argument, the query and cache strides, latent argument) of the Triton stage-1 kernels."""
    lat_arg, lat_strides = ops.latent, ops.lat_strides
    if tile == "pairs":  # the same bytes as int16 pairs of codes; strides in int16 units
        if any(st % 2 for st in lat_strides) or ops.kv_lora_rank % 2:
            raise ShapeError(f"tile='pairs' needs even latent strides, got {lat_strides} "
                             f"(kv_lora_rank {ops.kv_lora_rank})")
        lat_arg, lat_strides = ops.latent.view(torch.int16), tuple(st // 2 for st in lat_strides)
    q_arg = q.view(torch.int16) if q.dtype == torch.bfloat16 else q
    strides = (q.stride(0), q.stride(1), q.stride(2),
               *lat_strides, *ops.rope_strides, *ops.scale_strides, ops.block_table.stride(0))
    return q_arg, strides, lat_arg


def _uniform_launch(q, ops, config, choice, target, o_part, lse_part, sm_scale_log2, causal) -> KernelLaunch:
    B, S, H = q.shape[:3]
    q_arg, strides, lat_arg = _triton_cache_args(q, ops, choice.tile)
    consts = _triton_constexprs(q, ops, config, choice, target, causal)
    grid = (B, triton.cdiv(S * H, choice.block_m), choice.num_splits * ops.num_scale_blocks)
    return KernelLaunch("decode_uniform", mla_decode_stage1, grid, (
        q_arg, lat_arg, ops.rope, ops.scale, ops.block_table, ops.lengths, o_part, lse_part, sm_scale_log2, *strides,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), H, choice.num_splits,
    ), dict(LSE_NATURAL=choice.num_splits == 1, **consts))


def _balanced_launches(q, ops, config, choice, target, out, lse, sm_scale_log2, causal,
                       pdl: bool = False) -> list[KernelLaunch]:
    """The balanced schedule: the page prefix sum, stage 1 over parts of the batch, the combine."""
    B, S, H = q.shape[:3]
    rows, r, nb, parts, dev = S * H, ops.kv_lora_rank, ops.num_scale_blocks, choice.num_splits, ops.device
    q_arg, strides, lat_arg = _triton_cache_args(q, ops, choice.tile)
    consts = _triton_constexprs(q, ops, config, choice, target, causal)
    small = _small_launch(target)
    out_v, lse_v = out.view(B, rows, r), lse.view(B, rows)
    cum = torch.empty(B + 1, dtype=torch.int32, device=dev)
    o_part = torch.empty(parts + B, rows, r, dtype=torch.float32, device=dev)
    lse_part = torch.empty(parts + B, rows, nb, dtype=torch.float32, device=dev)
    return [
        KernelLaunch("balanced_metadata", balanced_metadata, (1,), (ops.lengths, cum, B),
                     dict(PAGE=PAGE_SIZE, BLOCK_B=triton.next_power_of_2(B), **small)),
        KernelLaunch("decode_balanced", mla_decode_balanced, (parts, triton.cdiv(rows, choice.block_m), nb), (
            q_arg, lat_arg, ops.rope, ops.scale, ops.block_table, ops.lengths, cum, out_v, lse_v,
            o_part, lse_part, sm_scale_log2, *strides,
            out_v.stride(0), out_v.stride(1), lse_v.stride(0),
            o_part.stride(0), o_part.stride(1), lse_part.stride(0), lse_part.stride(1),
            H, B, parts), consts),
        KernelLaunch("combine_balanced", mla_decode_combine_balanced, (B, rows, nb), (
            cum, o_part, lse_part, out_v, lse_v,
            o_part.stride(0), o_part.stride(1), lse_part.stride(0), lse_part.stride(1),
            out_v.stride(0), out_v.stride(1), lse_v.stride(0), B, parts),
            dict(BW=r // nb, **_small_launch(target, pdl))),
    ]


def _small_launch(target: Target, pdl: bool = False) -> dict[str, Any]:
    """Launch options of the small helper kernels (combine, metadata): 4 warps on a GPU; `pdl`: a combine
    launched as a programmatic dependent of the kernel before it (it calls `griddepcontrol.wait` first)."""
    if not target.native:
        return {}
    return {"num_warps": 4, "PDL": True, "launch_pdl": True} if pdl else {"num_warps": 4}


# ------------------------------------------------------------------------------------------- Gluon launches
_GLUON_KERNELS = {  # dispatch name -> (module under snapquant.kernels, function, launch name)
    "gluon.narrow": ("gluon.narrow", "_snapmla_decode_gluon_regs", "decode_gluon_narrow"),
    "gluon.narrow_tile": ("gluon.narrow_tile", "_snapmla_decode_gluon", "decode_gluon_narrow_tile"),
    "gluon.narrow_bf16": ("gluon.narrow_bf16", "_bf16_decode_gluon_narrow", "decode_gluon_narrow_bf16"),
    "gluon.wide": ("gluon.wide", "_mla_decode_gluon_wide", "decode_gluon_wide"),
    "gluon.seesaw": ("gluon.seesaw", "_bf16_decode_gluon_seesaw", "decode_gluon_seesaw"),
    "gluon.seesaw_fp8": ("gluon.seesaw_fp8", "_snapmla_decode_gluon_seesaw", "decode_gluon_seesaw_fp8"),
    "gluon.narrow_halves": ("gluon.experimental.narrow_halves", "_snapmla_decode_gluon_halves",
                            "decode_gluon_narrow_halves"),
    "gluon.narrow8": ("gluon.experimental.narrow8", "_mla_decode_gluon_narrow8", "decode_gluon_narrow8"),
    "gluon.wide8": ("gluon.experimental.wide8", "_mla_decode_gluon_wide8", "decode_gluon_wide8"),
}


def _gluon_launch(q, ops, choice, o_part, lse_part, sm_scale_log2, causal) -> KernelLaunch:
    """A Gluon page loop as stage 1 of the uniform schedule. Every Gluon kernel takes the same arguments: the
    query, TMA descriptors of the latent (fp8, or the bf16 layout's int16 bits seen as bf16) and RoPE rows,
    the rest as strides; grid (row tiles, requests, splits) past 16 rows (a request's row tiles are adjacent
    programs: they read the same pages from L2), (requests, 1, splits) at <= 16."""
    import importlib

    from .gluon.common import make_descriptors

    B, S, H = q.shape[:3]
    opts, splits = choice.options, choice.num_splits
    fp8 = ops.layout == "snapmla"
    (lp, lt), (rp, rt) = ops.lat_strides, ops.rope_strides
    lat = ops.latent if fp8 else ops.latent.view(torch.bfloat16)
    lat_desc, rope_desc = make_descriptors(lat, lt, ops.rope.view(torch.bfloat16), rt, fp8)
    args = (q, lat_desc, rope_desc, ops.scale, ops.block_table, ops.lengths, o_part, lse_part, sm_scale_log2,
            q.stride(0), q.stride(1), q.stride(2), lp // lt, rp // rt, ops.scale_strides[0], ops.scale_strides[1],
            ops.block_table.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), H, splits)
    consts = dict(S=S, R=ops.kv_lora_rank, D=ops.rope_dim, PAGE=PAGE_SIZE, CAUSAL=bool(causal),
                  P_DIV=P_DIVS.index(opts.p_div), LSE_NATURAL=splits == 1)
    module, fn, name = _GLUON_KERNELS[choice.kernel]
    kernel = getattr(importlib.import_module(f"{__package__}.{module}"), fn)
    if choice.kernel in ("gluon.narrow", "gluon.narrow_tile", "gluon.narrow_bf16", "gluon.narrow_halves"):
        consts.update(STAGES=choice.num_stages)
        if choice.kernel != "gluon.narrow_tile":
            ahead = DEFAULT_L2_PREFETCH if opts.l2_prefetch is None else opts.l2_prefetch
            args += _prefetch_args(ops, lat, lp, lt, rp, rt, ahead)
            consts.update(PF=ahead)
        if choice.kernel == "gluon.narrow":
            qk_int, pv_int = WIDENS[opts.widen or DEFAULT_WIDEN]
            consts.update(QK_INT=qk_int, PV_INT=pv_int, QK_FP8=opts.fp8_mma == "qk")
        grid = (B, 1, splits)
    else:
        grid = (triton.cdiv(S * H, choice.block_m), B, splits)
        if choice.kernel == "gluon.wide":
            consts.update(FP8=fp8)
        elif choice.kernel not in ("gluon.seesaw", "gluon.seesaw_fp8"):
            consts.update(STAGES=choice.num_stages)
        if choice.kernel == "gluon.narrow8":
            consts.update(BN=choice.block_m)
    if choice.kernel in ("gluon.narrow", "gluon.narrow8") and choice.num_stages == 1:
        consts.update(maxnreg=NARROW_ONE_SLOT_MAXNREG)  # one slot (<= 16 rows): three programs per SM
    if choice.kernel == "gluon.narrow_halves":
        consts.update(maxnreg=NARROW_HALVES_MAXNREG)  # eight warps, two programs per SM
    return KernelLaunch(name, kernel, grid, args, dict(**consts, num_warps=choice.num_warps))


def _prefetch_args(ops, lat: torch.Tensor, lp: int, lt: int, rp: int, rt: int, ahead: int) -> tuple:
    """The narrow kernels' L2 prefetch operands: the latent and RoPE tensors (their base addresses), the byte
    stride of a page in each and the bytes from a page's first row to the end of its last (64 rows)."""
    rope = ops.rope
    es_l, es_r = lat.element_size(), rope.element_size()
    lat_span = ((PAGE_SIZE - 1) * lt + lat.shape[-1]) * es_l
    rope_span = ((PAGE_SIZE - 1) * rt + rope.shape[-1]) * es_r
    page_bytes = (lp * es_l, rp * es_r)
    if ahead and (any(t.data_ptr() % 16 for t in (lat, rope)) or any(b % 16 for b in page_bytes)):
        raise ConfigError(f"l2_prefetch={ahead} needs 16-byte aligned pages (the bulk prefetch's unit); the cache's "
                          f"latent / RoPE start at {lat.data_ptr() % 16} / {rope.data_ptr() % 16} mod 16 with page "
                          f"strides of {page_bytes[0]} / {page_bytes[1]} bytes")
    return (lat, rope, *page_bytes, -(-lat_span // 16) * 16, -(-rope_span // 16) * 16)


# ------------------------------------------------------------------------------------------- checks
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
