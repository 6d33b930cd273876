"""Which decode kernel runs: the kernel table, `choose_kernel`, and every eligibility rule in one place.

    KERNELS          name -> KernelSpec (family, module, status, what it runs): the table docs/kernels.md shows
    choose_kernel    (operands, config, query rows, target GPU, DecodeOptions) -> KernelChoice: the kernel and
                     its resolved launch knobs (rows per program, warps, ring slots, split count)
    gluon_reason     why the Gluon kernels cannot run a call (None when they can)

The default (`options.tile` None) depends only on the format, the query rows, the GPU, `fp8_mma` and the
schedule, never on launch knobs:

    Hopper GPU, uniform schedule, Gluon eligible:
        <= 16 rows, snapmla with fp8 query and P, exact MMAs   gluon.narrow (r = 512) / gluon.narrow_tile
        <= 16 rows, fp8_mma="qk" / True with tile="gluon"      gluon.narrow / gluon.narrow8 (16-row programs)
        <= 16 rows, bf16 layout (bf16 query and P)             gluon.narrow_bf16
        <= 16 rows, snapmla exact, num_warps=8 (experimental)  gluon.narrow_halves
        > 16 rows, bf16 layout, r = 512, d = 64                gluon.seesaw (warp_specialize=False: gluon.wide)
        > 16 rows, snapmla, r = 512, d = 64, warp_specialize   gluon.seesaw_fp8 (opt-in)
        > 16 rows, exact MMAs (snapmla fp8 q and P, other bf16) gluon.wide
        > 16 rows, fp8_mma=True (snapmla, r = 512)             gluon.narrow8 (block_m 32) / gluon.wide8 (64)
    otherwise (other GPUs, the interpreter, other modes, the balanced schedule):
        snapmla with fp8 query and P, exact MMAs               triton.pairs
        everything else                                        triton.rows

Launch knobs (block_m, num_warps, num_stages, maxnreg) are then checked against the chosen kernel: one
it cannot honour is a ConfigError naming the knob and the kernel (ask for the Triton tiles with
`tile="rows"` / `"pairs"` to tune those), not a silent switch to another kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import triton

from ..config import KVQuantConfig
from ..errors import ConfigError
from ._launch import interpreting
from .layouts import GLUON_BOX, GLUON_ROWS, GLUON_WIDE_ROWS
from .operands import KernelOperands
from .options import DEFAULT_WIDEN, WIDENS, DecodeOptions

MAX_PARTS = 8192  # balanced schedule: partial buffers are [parts + B, rows, r] fp32
# The narrow Gluon kernels' longest page run per program: the host cannot see the lengths (they live on the
# GPU), and a batch of mixed lengths is as slow as its longest request's run; 32 pages keeps every uniform
# 16-row shape measured at its one-wave split count (docs/kernels.md).
NARROW_MAX_RUN = 32
# Take fewer splits where the run cap would leave a partial last wave (`one_wave_splits`); a switch so that
# `scripts/probe_step_ab.py --switch splits` can time the rule against the plain cap in one process.
TRIM_PARTIAL_WAVES = True


@dataclass(frozen=True)
class KernelSpec:
    """One row of the kernel table."""

    family: str  # the `tile` option that selects it: rows | tokens | pairs | gluon
    module: str  # where its kernel lives, under snapquant/kernels/
    status: str  # default | opt-in | experimental
    runs: str  # which formats, query rows and GPU


KERNELS: dict[str, KernelSpec] = {
    "gluon.narrow": KernelSpec(
        "gluon", "gluon/narrow.py", "default",
        "<= 16 query rows; snapmla layout, fp8 query and P, exact MMAs; kv_lora_rank 512; two slots (two programs "
        "per SM) or num_stages=1 (one slot, three per SM); with fp8_mma='qk' (experimental) native FP8 QK from the "
        "TMA slot; Hopper"),
    "gluon.narrow_tile": KernelSpec(
        "gluon", "gluon/narrow_tile.py", "default",
        "<= 16 query rows; snapmla layout, fp8 query and P, exact MMAs; kv_lora_rank 128 or 256; one slot widened "
        "in place, two programs per SM; Hopper"),
    "gluon.narrow_bf16": KernelSpec(
        "gluon", "gluon/narrow_bf16.py", "default",
        "<= 16 query rows; the bf16 layout (bf16 query and P); kv_lora_rank 128, 256 or 512; 2 ring slots (one "
        "program per SM) or num_stages=1 (two); Hopper"),
    "gluon.narrow_halves": KernelSpec(
        "gluon", "gluon/experimental/narrow_halves.py", "experimental",
        "<= 16 query rows; snapmla layout, fp8 query and P, exact MMAs; kv_lora_rank 512, rope_dim 64; num_warps=8: "
        "two warpgroups split each page's channels (QK, PV), two slots, two programs per SM; Hopper"),
    "gluon.wide": KernelSpec(
        "gluon", "gluon/wide.py", "default",
        "> 16 query rows (64-row tiles); snapmla layout with fp8 query and P, or the bf16 layout where gluon.seesaw "
        "does not run or warp_specialize=False; exact MMAs; Hopper"),
    "gluon.seesaw": KernelSpec(
        "gluon", "gluon/seesaw.py", "default",
        "> 16 query rows (64-row tiles); the bf16 layout, kv_lora_rank 512, rope_dim 64; two warpgroups in "
        "different roles over page pairs; Hopper"),
    "gluon.seesaw_fp8": KernelSpec(
        "gluon", "gluon/seesaw_fp8.py", "opt-in",
        "> 16 query rows (64-row tiles); snapmla layout, fp8 query and P, exact MMAs, kv_lora_rank 512, rope_dim 64; "
        "warp_specialize=True: two warpgroups in different roles over page pairs; Hopper"),
    "gluon.narrow8": KernelSpec(
        "gluon", "gluon/experimental/narrow8.py", "opt-in",
        "32-row programs past 16 query rows (block_m 32, its default), 16-row ones at <= 16, two per SM; snapmla, "
        "fp8 query and P, kv_lora_rank 512; fp8_mma=True; Hopper"),
    "gluon.wide8": KernelSpec(
        "gluon", "gluon/experimental/wide8.py", "opt-in",
        "> 16 query rows (64-row programs); snapmla, fp8 query and P, kv_lora_rank 512; fp8_mma=True, block_m=64; "
        "Hopper"),
    "triton.pairs": KernelSpec(
        "pairs", "triton/decode.py", "default",
        "snapmla layout, fp8 query and P, exact MMAs, where the Gluon kernels do not run (any GPU, interpreter)"),
    "triton.rows": KernelSpec(
        "rows", "triton/decode.py", "default",
        "every layout and mode (ds_v32, bf16 query or P, fp8_mma 'qk' / 'pv' / True) where Gluon does not run"),
    "triton.tokens": KernelSpec(
        "tokens", "triton/decode.py", "experimental",
        "swap AB (the page's tokens as MMA M); one scale per token (snapmla, bf16 layouts)"),
}


@dataclass(frozen=True)
class Target:
    """What the kernels compile for: `native` (compiled code paths; False: the Triton interpreter), the
    CUDA compute capability (`arch`, e.g. 90; None when unknown: a plan built for a GPU on a machine
    without one, where Gluon is allowed when asked for but not chosen by default) and the SM count."""

    native: bool
    arch: int | None
    num_sms: int
    gpu_name: str = ""

    @property
    def hopper(self) -> bool:
        return self.arch is not None and self.arch // 10 == 9

    @classmethod
    def of(cls, device: torch.device, native: bool | None = None, num_sms: int | None = None,
           arch: int | None = None) -> Target:
        """The target of tensors on `device`: a CUDA device's capability, SMs and name (cached), else none."""
        native = (not interpreting(device)) if native is None else bool(native)
        name, sms = "", 1
        if device.type == "cuda":
            dev_arch, name, sms = _device_info(device.index if device.index is not None else torch.cuda.current_device())
            if native and arch is None:
                arch = dev_arch
        return cls(native, arch, num_sms if num_sms is not None else sms, name)


@dataclass(frozen=True)
class KernelChoice:
    """The kernel one decode call runs, and its resolved knobs."""

    kernel: str  # a key of KERNELS
    tile: str
    schedule: str
    block_m: int  # query rows per program
    num_splits: int
    num_warps: int | None  # None: the interpreter (no launch options)
    num_stages: int | None
    options: DecodeOptions = field(repr=False, default_factory=DecodeOptions)

    @property
    def spec(self) -> KernelSpec:
        return KERNELS[self.kernel]


def choose_kernel(ops: KernelOperands, config: KVQuantConfig, rows: int, target: Target,
                  options: DecodeOptions) -> KernelChoice:
    """The kernel for query rows `rows` (S * H) over `ops` on `target`, with `options`' knobs resolved.
    Raises ConfigError (naming the option) when an asked-for kernel or knob cannot run here."""
    q8, p8 = config.query == "fp8_e4m3", config.pv == "fp8_scale_fused"
    opts, tile = options, options.tile
    defaulted = tile is None
    if defaulted:
        tile = default_tile(ops.layout, config, opts.fp8_mma)
        # <= 16 rows: the narrow Gluon kernels run the snapmla pipeline (where pairs is the Triton default) and
        # the bf16 layout; past that gluon.wide runs both, and gluon_reason refuses every other format
        eligible = tile == "pairs" or ops.layout == "bf16" if rows <= GLUON_ROWS else True
        tuning = replace(opts, block_m=None, num_warps=None, num_stages=None, maxnreg=None)
        if (opts.schedule == "uniform" and target.hopper and eligible
                and gluon_reason(ops, config, rows, target, tuning) is None):
            tile = "gluon"
    if tile == "tokens" and ops.num_scale_blocks != 1:
        raise ConfigError(f"tile='tokens' needs one scale per token; the {ops.layout} layout has "
                          f"{ops.num_scale_blocks} scale blocks")
    if tile == "gluon" and opts.schedule != "uniform":
        raise ConfigError(f"tile={tile!r} runs the uniform schedule only")
    if tile == "pairs" and (ops.layout != "snapmla" or not q8 or not p8 or opts.fp8_mma is not False):
        raise ConfigError(f"tile={tile!r} runs the snapmla layout with an fp8 query, fp8 P and exact fp16 MMAs; got "
                          f"the {ops.layout} layout, query={config.query!r}, pv={config.pv!r}, "
                          f"fp8_mma={opts.fp8_mma!r}")
    if tile == "gluon":
        reason = gluon_reason(ops, config, rows, target, opts)
        if reason is not None:
            if defaulted:  # only a launch knob can refuse the default Gluon kernel
                reason += (f" (the default kernel here is Gluon; for the Triton one pass "
                           f"tile={default_tile(ops.layout, config, opts.fp8_mma)!r})")
            raise ConfigError(reason)
        choice = _gluon_choice(ops, rows, target, opts)
    else:
        choice = _triton_choice(ops, rows, target, opts, tile)
    if opts.widen not in (None, "cvt") and choice.kernel != "gluon.narrow":
        raise ConfigError(f"widen={opts.widen!r} is a knob of gluon.narrow (<= {GLUON_ROWS} query rows on Hopper, "
                          f"exact fp16 MMAs, kv_lora_rank 512, two or more ring slots); the kernel here is "
                          f"{choice.kernel}")
    if opts.fp8_mma == "qk" and WIDENS[opts.widen or DEFAULT_WIDEN][0]:
        raise ConfigError(f"widen={opts.widen!r} widens QK's operand by integer operations, but fp8_mma='qk' runs QK "
                          f"as a native FP8 MMA that widens nothing; use widen='cvt' or 'int_pv' / 'int_pv2'")
    if opts.l2_prefetch and choice.kernel not in ("gluon.narrow", "gluon.narrow_bf16"):
        raise ConfigError(f"l2_prefetch={opts.l2_prefetch!r} is a knob of gluon.narrow / gluon.narrow_bf16 (<= "
                          f"{GLUON_ROWS} query rows on Hopper, two or more ring slots); the kernel here is "
                          f"{choice.kernel}")
    if opts.warp_specialize and choice.kernel not in SEESAW_KERNELS.values():
        raise ConfigError(f"warp_specialize=True is a knob of gluon.seesaw / gluon.seesaw_fp8 (the bf16 and snapmla "
                          f"layouts past {GLUON_ROWS} query rows on Hopper, tile='gluon'); the kernel here is "
                          f"{choice.kernel}")
    return choice


def default_tile(layout: str, config: KVQuantConfig, fp8_mma: bool | str = False) -> str:
    """The Triton tile where the Gluon kernels do not run: "pairs" where it applies (snapmla layout, fp8
    query and P, exact fp16 MMAs; measured faster than rows at every shape), else "rows"."""
    fp8_both = config.query == "fp8_e4m3" and config.pv == "fp8_scale_fused"
    return "pairs" if layout == "snapmla" and fp8_both and fp8_mma in (False, "none") else "rows"


def gluon_reason(ops: KernelOperands, config: KVQuantConfig, rows: int, target: Target,
                 options: DecodeOptions) -> str | None:
    """Why tile="gluon" cannot run these operands, config and knobs (None when it can). A CUDA target must
    be Hopper; a target of unknown arch (plans compiled without a GPU, `compile_stats`) is taken as one."""
    reason = gluon_format_reason(ops.layout, config.query == "fp8_e4m3", config.pv == "fp8_scale_fused", rows,
                                 ops.kv_lora_rank, ops.rope_dim, ops.latent, ops.lat_strides, ops.rope,
                                 ops.rope_strides)
    if reason is not None:
        return reason
    if not target.native:
        return "tile='gluon' needs a Hopper GPU (Gluon kernels have no interpreter mode)"
    fp8_mma, block_m, num_warps, num_stages = options.fp8_mma, options.block_m, options.num_warps, options.num_stages
    wide = rows > GLUON_ROWS
    native8_rows = (block_m or 32) if wide and fp8_mma is True else None
    if native8_rows not in (None, 32, 64):
        return (f"tile='gluon' with fp8_mma=True runs block_m 32 (gluon.narrow8) or 64 (gluon.wide8), "
                f"got block_m={block_m}")
    if block_m is not None and native8_rows is None:
        return (f"tile='gluon' picks its own rows per program ({GLUON_ROWS} or {GLUON_WIDE_ROWS}); block_m is a knob "
                f"of the native FP8 kernels past {GLUON_ROWS} rows (fp8_mma=True) only, got block_m={block_m}")
    if options.maxnreg is not None:
        return f"tile='gluon' takes no maxnreg (a launch knob of the Triton tiles), got maxnreg={options.maxnreg}"
    if options.warp_specialize:
        if not seesaw_runs(ops, rows) or fp8_mma is True:
            return (f"warp_specialize=True (gluon.seesaw, gluon.seesaw_fp8) runs the bf16 and snapmla layouts past "
                    f"{GLUON_ROWS} query rows at kv_lora_rank 512 and rope_dim 64 with exact MMAs; got the "
                    f"{ops.layout} layout, {rows} query rows, kv_lora_rank {ops.kv_lora_rank}, rope_dim "
                    f"{ops.rope_dim}, fp8_mma={fp8_mma!r}")
    warps = 8 if wide and native8_rows != 32 and not uses_seesaw(ops, rows, options) else 4
    if not wide and num_warps == HALVES_WARPS:  # gluon.narrow_halves: two warpgroups split each page's channels
        if (ops.layout, fp8_mma, ops.kv_lora_rank, ops.rope_dim) != ("snapmla", False, 512, 64) \
                or num_stages not in (None, 2):
            return (f"tile='gluon' at {rows} query rows runs num_warps=4; num_warps={HALVES_WARPS} (gluon.narrow_halves) "
                    f"runs the snapmla layout with exact MMAs at kv_lora_rank 512, rope_dim 64 and two slots; got the "
                    f"{ops.layout} layout, fp8_mma={fp8_mma!r}, kv_lora_rank {ops.kv_lora_rank}, rope_dim "
                    f"{ops.rope_dim}, num_stages={num_stages}")
        warps = HALVES_WARPS
    if num_warps not in (None, warps):
        return f"tile='gluon' at {rows} query rows runs num_warps={warps}, got num_warps={num_warps}"
    if wide and fp8_mma is True and num_stages not in (None, 2, 3, 4):
        return (f"tile='gluon' with fp8_mma=True at > {GLUON_ROWS} query rows runs num_stages 2, 3 or 4 (TMA slots), "
                f"got num_stages={num_stages}")
    if wide and fp8_mma is not True and num_stages not in (None, 2):
        return f"tile='gluon' at > {GLUON_ROWS} query rows runs num_stages=2 (two TMA slots), got num_stages={num_stages}"
    bf16_narrow = not wide and ops.layout == "bf16"
    if bf16_narrow and num_stages not in (None, 1, 2):
        return (f"tile='gluon' on the bf16 layout at <= {GLUON_ROWS} query rows (gluon.narrow_bf16) runs num_stages 1 "
                f"or 2 (72 KB page slots), got num_stages={num_stages}")
    if bf16_narrow and ops.kv_lora_rank not in (128, 256, 512):
        return (f"tile='gluon' on the bf16 layout at <= {GLUON_ROWS} query rows (gluon.narrow_bf16) needs kv_lora_rank "
                f"128, 256 or 512 (one [r, 16] accumulator), got {ops.kv_lora_rank}")
    if wide:  # native FP8 MMAs past 16 rows (gluon.narrow8 / gluon.wide8): the snapmla layout only
        allowed = (False, True) if ops.layout == "snapmla" else (False,)
    else:
        allowed = (False, "qk", True) if ops.layout == "snapmla" else (False,)
    if fp8_mma not in allowed:
        native8 = " or fp8_mma=True (the snapmla layout)" if wide else " or fp8_mma=qk / True" if not bf16_narrow else ""
        return f"tile='gluon' runs exact fp16 MMAs{native8} at {rows} query rows, got fp8_mma={fp8_mma!r}"
    if target.arch is not None and not target.hopper:
        return f"tile='gluon' runs on Hopper (sm_90) only, not {target.gpu_name or f'sm_{target.arch}'}"
    if not wide and fp8_mma is True and num_stages not in (None, 1, 2):
        return (f"tile='gluon' with fp8_mma=True at <= {GLUON_ROWS} query rows (gluon.narrow8, 16-row programs) runs "
                f"num_stages 2 (two TMA slots) or 1 (one, three programs per SM), got num_stages={num_stages}")
    if not wide and fp8_mma is not True and ops.layout == "snapmla" and ops.kv_lora_rank != 512 \
            and narrow_stages(num_stages, ops.kv_lora_rank, ops.layout) != 1:
        return (f"tile='gluon' at <= {GLUON_ROWS} rows with num_stages >= 2 (register operands, gluon.narrow) is "
                f"written for kv_lora_rank 512 (four 128-channel boxes), got {ops.kv_lora_rank}")
    if fp8_mma in ("qk", True) and ops.kv_lora_rank != 512:
        return (f"tile='gluon' with fp8_mma={fp8_mma!r} is written for kv_lora_rank 512 (four 128-channel boxes), "
                f"got {ops.kv_lora_rank}")
    return None


def gluon_format_reason(layout: str, q_fp8: bool, p_fp8: bool, rows: int, r: int, d: int, lat: torch.Tensor,
                        lat_strides: tuple[int, int], rope: torch.Tensor,
                        rope_strides: tuple[int, int]) -> str | None:
    """Why the Gluon kernels cannot run this format, these widths or these operands' memory (None when they
    can): the snapmla layout with fp8 query and P, or the bf16 layout (bf16 query and P); TMA needs 16-byte
    aligned rows and a page stride that is a whole number of rows."""
    from .gluon import HAVE_GLUON

    if not HAVE_GLUON:
        return "this triton has no Gluon (triton.experimental.gluon)"
    snapmla8 = layout == "snapmla" and q_fp8 and p_fp8
    if not (snapmla8 or (layout == "bf16" and not q_fp8 and not p_fp8)):
        return (f"tile='gluon' runs the snapmla layout (fp8 query and P) or the bf16 layout (bf16 query and P), got "
                f"{layout} (q fp8 {q_fp8}, P fp8 {p_fp8})")
    if r % GLUON_BOX or r > 512 or d * 2 > 128 or d < 8:
        return f"tile='gluon' needs kv_lora_rank a multiple of {GLUON_BOX} up to 512 and 8 <= rope_dim <= 64, got {r}, {d}"
    lat_size = 2 if layout == "bf16" else 1
    for name, t, (sp, st), size in (("latent", lat, lat_strides, lat_size), ("rope", rope, rope_strides, 2)):
        if t.stride(-1) != 1 or (st * size) % 16 or t.data_ptr() % 16 or sp % st:
            return (f"tile='gluon' needs the {name} rows 16-byte aligned, contiguous and a page stride that is a "
                    f"multiple of the row stride (TMA), got strides {tuple(t.stride())}")
    return None


# ------------------------------------------------------------------------------------------- resolved knobs
def narrow_stages(num_stages: int | None, r: int, layout: str = "snapmla") -> int:
    """Ring slots of the <= 16-row Gluon kernel when not given: at r = 512 two (gluon.narrow: register
    operands, exact or with a native QK, two programs per SM, each with a page in flight); other widths the
    in-place slot of gluon.narrow_tile (two programs per SM); the bf16 layout two (gluon.narrow_bf16)."""
    if num_stages is not None:
        return num_stages
    return 2 if r == 512 or layout == "bf16" else 1


def narrow_kernel(stages: int, layout: str = "snapmla", r: int = 512) -> str:
    """The <= 16-row Gluon kernel: gluon.narrow_bf16 for the bf16 layout; for snapmla at r = 512 gluon.narrow
    (register operands; with fp8_mma="qk" a native e4m3 QK from the slot; one slot runs three programs per SM,
    `NARROW_ONE_SLOT_MAXNREG`), at other widths the in-place fp16 tile (gluon.narrow_tile, one slot)."""
    if layout == "bf16":
        return "gluon.narrow_bf16"
    return "gluon.narrow" if r == 512 else "gluon.narrow_tile"


# gluon.narrow with one slot (~64 KB exact, ~57 KB with the native QK's fp8 query) and gluon.narrow8's 16-row
# programs with one (~55 KB): three programs share an SM when a thread keeps to 65536 / (3 x 128) = 170
# registers (rounded down to the allocation unit of 8). Compiled for sm_90 they stay asynchronous there and
# spill 48-160 bytes (the exact kernel once each box's MMA is waited for before the next box is loaded: with
# two boxes' operands live ptxas serializes its wgmma chain, C7512)
NARROW_ONE_SLOT_MAXNREG = 168


# gluon.narrow_halves (num_warps=8 at <= 16 rows): eight warps per program, two programs per SM (~105 KB each), so a
# thread keeps to 65536 / (2 x 256) = 128 registers
HALVES_WARPS = 8
NARROW_HALVES_MAXNREG = 128


# the pair-schedule kernel of each layout, and the layouts where it is the default past 16 rows (measured faster
# than gluon.wide at every shape, docs/performance.md); elsewhere warp_specialize=True asks for it
SEESAW_KERNELS = {"bf16": "gluon.seesaw", "snapmla": "gluon.seesaw_fp8"}
SEESAW_DEFAULT_LAYOUTS = ("bf16",)


def seesaw_runs(ops: KernelOperands, rows: int) -> bool:
    """Where the pair-schedule kernels run: the bf16 layout (`gluon.seesaw`) and the snapmla layout
    (`gluon.seesaw_fp8`; its fp8 query and P are checked with the format) past 16 query rows at kv_lora_rank
    512 and rope_dim 64."""
    return rows > GLUON_ROWS and ops.layout in SEESAW_KERNELS and ops.kv_lora_rank == 512 and ops.rope_dim == 64


def uses_seesaw(ops: KernelOperands, rows: int, opts: DecodeOptions) -> bool:
    """`warp_specialize`: True asks for the pair-schedule kernel, False for `gluon.wide`; None (the default)
    takes it where it runs, its layout is in SEESAW_DEFAULT_LAYOUTS and no launch knob asks for 8 warps."""
    if opts.warp_specialize is not None:
        return opts.warp_specialize
    return (seesaw_runs(ops, rows) and ops.layout in SEESAW_DEFAULT_LAYOUTS and opts.num_warps in (None, 4)
            and opts.fp8_mma is not True)


def narrow_resident(stages: int, layout: str = "snapmla", r: int = 512, d: int = 64) -> int:
    """Programs of the <= 16-row kernel per SM (shared memory, registers): the in-place slot (~98 KB) and the
    register-operand kernel with two slots (~105 KB; ~97 KB with the fp8 query of fp8_mma="qk") fit two, the
    register-operand kernel with one slot (~57-64 KB, `NARROW_ONE_SLOT_MAXNREG`) three; the bf16 kernel two
    where its slots and query fit half an SM (`narrow_bf16_smem`: one 72 KB slot at r = 512, two at r <= 256);
    the other configurations one."""
    if layout == "bf16":
        return 2 if narrow_bf16_smem(stages, r, d) <= HALF_SM_SMEM else 1
    if stages == 1 and narrow_kernel(stages, layout, r) == "gluon.narrow":
        return 3
    return 2 if stages <= 2 else 1


HALF_SM_SMEM = 113 * 1024  # Hopper: 228 KB of shared memory per SM, 1 KB of it reserved per resident block
_NARROW_BF16_EXTRA = 4096  # what the compiler adds (barriers, alignment, layout-conversion scratch), measured


def narrow_bf16_smem(stages: int, r: int, d: int) -> int:
    """Shared memory of `gluon.narrow_bf16` in bytes: `stages` page slots ([64, r + d] bf16), the query
    ([16, r + d] bf16) and P ([16, 64] bf16), plus the compiler's own (checked against compiled kernels)."""
    return stages * 64 * (r + d) * 2 + 16 * (r + d) * 2 + 16 * 64 * 2 + _NARROW_BF16_EXTRA


def _gluon_choice(ops: KernelOperands, rows: int, target: Target, opts: DecodeOptions) -> KernelChoice:
    B, r = ops.block_table.shape[0], ops.kv_lora_rank
    if rows <= GLUON_ROWS and opts.fp8_mma is True:  # both products native: gluon.narrow8 at 16 rows
        stages = opts.num_stages or 2  # one slot: three programs per SM (`NARROW_ONE_SLOT_MAXNREG`)
        kernel, block_m, warps, resident, max_run = "gluon.narrow8", GLUON_ROWS, 4, 3 if stages == 1 else 2, NARROW_MAX_RUN
    elif rows <= GLUON_ROWS and opts.num_warps == HALVES_WARPS:  # two warpgroups per page, two programs per SM
        kernel, block_m, warps, stages, resident, max_run = "gluon.narrow_halves", GLUON_ROWS, 8, 2, 2, NARROW_MAX_RUN
    elif rows <= GLUON_ROWS:
        stages = narrow_stages(opts.num_stages, r, ops.layout)
        kernel, block_m, warps = narrow_kernel(stages, ops.layout, r), GLUON_ROWS, 4
        resident = narrow_resident(stages, ops.layout, r, ops.rope_dim)
        max_run = NARROW_MAX_RUN
    elif opts.fp8_mma is True:
        block_m = opts.block_m or 32
        kernel = "gluon.narrow8" if block_m == 32 else "gluon.wide8"
        stages, warps, resident, max_run = opts.num_stages or 2, 4 if block_m == 32 else 8, 2 if block_m == 32 else 1, None
    elif uses_seesaw(ops, rows, opts):
        kernel, block_m, stages, warps, resident, max_run = SEESAW_KERNELS[ops.layout], GLUON_WIDE_ROWS, 2, 4, 1, None
    else:
        kernel, block_m, stages, warps, resident, max_run = "gluon.wide", GLUON_WIDE_ROWS, 2, 8, 1, None
    splits = opts.num_splits or one_wave_splits(B * triton.cdiv(rows, block_m), ops.block_table.shape[1],
                                                target.num_sms * resident, max_run)
    return KernelChoice(kernel, "gluon", "uniform", block_m, splits, warps, stages, opts)


def _triton_choice(ops: KernelOperands, rows: int, target: Target, opts: DecodeOptions, tile: str) -> KernelChoice:
    B, nb = ops.block_table.shape[0], ops.num_scale_blocks
    block_m = opts.block_m or min(64, max(16, triton.next_power_of_2(rows)))
    m_blocks = triton.cdiv(rows, block_m)
    if opts.num_splits is not None:
        splits = opts.num_splits
    elif opts.schedule == "uniform":
        splits = default_splits(B * m_blocks * nb, ops.block_table.shape[1], target.num_sms)
    else:
        splits = default_parts(m_blocks * nb, target.num_sms)
    if opts.schedule == "balanced" and splits > MAX_PARTS:
        raise ConfigError(f"num_splits={splits} parts is above the balanced schedule's limit {MAX_PARTS}")
    warps = stages = None
    if target.native:
        # the fastest measured (docs/kernels.md): 8 warps for every layout; 3 stages for the bf16 layout at
        # 16-row tiles, 2 everywhere else (3 stages are much slower at 64-row tiles)
        warps = opts.num_warps or 8
        stages = opts.num_stages or (3 if ops.layout == "bf16" and block_m == 16 else 2)
    return KernelChoice(f"triton.{tile}", tile, opts.schedule, block_m, splits, warps, stages, opts)


# ------------------------------------------------------------------------------------------- split counts
def one_wave_splits(programs: int, max_pages: int, slots: int, max_run: int | None = None) -> int:
    """tile="gluon": as few splits as fill one wave of program slots (SMs x programs per SM), never more
    than the pages or 64. Each split writes an fp32 partial per query row that the combine reads back,
    and a second, partial wave costs a whole page run (docs/kernels.md has the measurements)."""
    programs = max(programs, 1)
    splits = slots // programs
    if max_run is not None:  # at least enough splits that no program runs more than max_run pages
        splits = max(splits, triton.cdiv(max_pages, max_run))
    splits = max(1, min(splits, max_pages, 64))
    # The run cap can spill programs into a last, partial wave that costs a whole run with most of the GPU idle
    # (a table 514 pages wide at 32 requests: 17 splits, 544 programs, 3 waves of 31 pages). One wave fewer
    # means longer runs, which a batch of equal lengths pays once per wave (waves x run) but a long request
    # among short ones pays alone (run: its programs are the only ones with work). The count that fills one
    # wave fewer is taken when it lowers the product of the two, waves x run^2: 514 pages -> 16 splits, two
    # waves of 33 pages (not 8 splits, one wave of 65: 1% less for equal lengths, twice the long request's run).
    while (TRIM_PARTIAL_WAVES and max_run is not None and (waves := triton.cdiv(programs * splits, slots)) > 1
           and programs * splits < waves * slots):
        fewer = (waves - 1) * slots // programs
        if fewer < 1 or (waves - 1) * triton.cdiv(max_pages, fewer) ** 2 >= waves * triton.cdiv(max_pages, splits) ** 2:
            break
        splits = fewer
    return splits


def default_splits(programs: int, max_pages: int, sms: int, min_wave_fill: float = 0.9) -> int:
    """Uniform schedule, Triton tiles: about 2 programs per SM, never more than the pages or 64 (combine
    cost), nudged to the nearest count whose last wave of programs is nearly full. The Triton kernels run
    one program per SM (registers), so 288 programs on 132 SMs take 3 waves for 2.2 waves of work."""
    cap = max(1, min(max_pages, 64))
    base = max(1, min(triton.cdiv(2 * sms, programs), cap))

    def fill(s: int) -> float:
        total = programs * s
        return total / (triton.cdiv(total, sms) * sms)

    if fill(base) >= min_wave_fill:
        return base
    # More splits first: with mixed lengths the longest request's run sets the time, so fewer splits
    # would lengthen it; then fewer.
    for s in [*range(base + 1, cap + 1), *range(base - 1, 0, -1)]:
        if fill(s) >= min_wave_fill:
            return s
    return base


def default_parts(row_tiles_x_chunks: int, num_sms: int) -> int:
    """Balanced schedule: two programs per SM over all row tiles and output chunks (FlashMLA runs one
    part per SM with one CTA each; ours hold fewer rows, so two give latency hiding room)."""
    return max(1, min(MAX_PARTS, (2 * num_sms) // max(row_tiles_x_chunks, 1)))


@functools.lru_cache(maxsize=16)
def _device_info(index: int) -> tuple[int, str, int]:
    """(compute capability as 10 * major + minor, name, SM count) of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return 10 * props.major + props.minor, props.name, props.multi_processor_count
