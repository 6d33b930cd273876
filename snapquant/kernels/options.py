"""`DecodeOptions`: the decode's knobs, typed and validated in one place.

Every field has a default that `snapquant.kernels.dispatch.choose_kernel` resolves per call (format,
query rows, GPU); a field set by the caller is a request, and one the chosen kernel cannot honour is a
`ConfigError` naming the field, never a silent switch to another kernel (docs/kernels.md has the table).

    tile        which kernel family: "rows" | "tokens" | "pairs" (the Triton tiles) | "gluon" (Hopper's
                Gluon kernels); None: the default for the format, rows and GPU
    schedule    "uniform" (every request cut into num_splits equal runs) | "balanced" (the batch's pages
                cut into num_splits equal parts; Triton only)
    num_splits  KV splits per request (uniform) or parts of the batch (balanced); None: a heuristic
    fp8_mma     Hopper's native FP8 MMA for the fp8 x fp8 products: False (exact fp16 MMAs of the e4m3
                values, the reference's arithmetic) | "qk" | "pv" | True (both); opt-in
    p_div       how P^ = e4m3(f / pi) divides: "fma" (a reciprocal and one fma correction: the correctly
                rounded quotient) | "exact" (div_rn, the same bits) | "rcp" (within ~1 ulp)
    block_m     query rows per program: the Triton tiles (a power of two >= 16), or the native FP8 Gluon
                kernels (32: narrow8, 64: wide8)
    widen       how the exact fp16 MMAs' A operands are widened from e4m3 in registers (`gluon.narrow`):
                "cvt" (cvt.rn.f16x2.e4m3x2 on Hopper's conversion unit) | "int" (integer operations, values
                times 2^-8 undone on the fp32 accumulators: the same bits, except NaN codes) | "int_qk" /
                "int_pv" (one product each way) | "int_pv2" / "int_qk_pv2" (two of PV's four 128-channel
                boxes by integers: both units busy); None: the kernel's default
    warp_specialize  past 16 query rows on Hopper (r = 512, d = 64): two warpgroups in different roles over
                page pairs (True; on the bf16 layout `gluon.seesaw`, its default there with None; on the
                snapmla layout `gluon.seesaw_fp8`, opt-in: measured slower than `gluon.wide`) or one chain on
                8 warps (`gluon.wide`: False, and the snapmla layout's default)
    pdl         launch the split combine as a programmatic dependent of stage 1 (compute capability >= 9.0): it
                may launch as stage 1's programs exit and waits for the grid on the GPU (FlashMLA launches its
                combine this way); the same arithmetic and bits. Opt-in: on an H100 it changed no decode time by
                more than the noise (docs/performance.md)
    l2_prefetch pages ahead of the ring's next page that `gluon.narrow` / `gluon.narrow_bf16` ask the L2 to fetch
                (Hopper's bulk prefetch, issued by one thread a page): the ring's two slots keep at most two pages
                in flight per program, a prefetched page arrives in L2 latency; 0 (the default) off. Reads and
                arithmetic unchanged, so the same bits; None: DEFAULT_L2_PREFETCH
    num_warps, num_stages, maxnreg   launch parameters (num_stages: ring slots of the Gluon kernels)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, unknown_choice

TILES = ("rows", "tokens", "pairs", "gluon")
SCHEDULES = ("uniform", "balanced")
P_DIVS = ("exact", "rcp", "fma")
FP8_MMA = (False, "qk", "pv", True)
# widen -> (QK widened by integer ops, PV boxes (of 4) widened by integer ops)
WIDENS = {"cvt": (False, 0), "int": (True, 4), "int_qk": (True, 0), "int_pv": (False, 4), "int_pv2": (False, 2),
          "int_qk_pv2": (True, 2)}
DEFAULT_WIDEN = "cvt"
DEFAULT_L2_PREFETCH = 0  # off until measured faster on the H200 (docs/performance.md)
MAX_L2_PREFETCH = 8  # pages ahead: 264 programs x 8 x 40 KB = 84 MB would already exceed an H200's L2
_FP8_MMA_ALIASES = {"none": False, "both": True}


@dataclass(frozen=True)
class DecodeOptions:
    """The decode's knobs (see the module docstring); validated on construction."""

    tile: str | None = None
    schedule: str = "uniform"
    num_splits: int | None = None
    fp8_mma: bool | str = False
    p_div: str = "fma"
    block_m: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    maxnreg: int | None = None
    widen: str | None = None
    warp_specialize: bool | None = None
    pdl: bool = False
    l2_prefetch: int | None = None

    def __post_init__(self) -> None:
        if self.tile is not None and self.tile not in TILES:
            raise unknown_choice("tile", self.tile, TILES)
        if self.schedule not in SCHEDULES:
            raise unknown_choice("schedule", self.schedule, SCHEDULES)
        if self.p_div not in P_DIVS:
            raise unknown_choice("p_div", self.p_div, P_DIVS)
        if self.widen is not None and self.widen not in WIDENS:
            raise unknown_choice("widen", self.widen, tuple(WIDENS))
        mma = _FP8_MMA_ALIASES.get(self.fp8_mma, self.fp8_mma) if isinstance(self.fp8_mma, str) else self.fp8_mma
        if not (isinstance(mma, bool) or mma in ("qk", "pv")):
            raise unknown_choice("fp8_mma", self.fp8_mma, [str(v) for v in FP8_MMA])
        object.__setattr__(self, "fp8_mma", mma)
        if self.warp_specialize is not None and not isinstance(self.warp_specialize, bool):
            raise ConfigError(f"warp_specialize={self.warp_specialize!r} is not valid; allowed values: True, False, "
                              "None (the default: gluon.seesaw on the bf16 layout where it runs, else gluon.wide)")
        if not isinstance(self.pdl, bool):
            raise ConfigError(f"pdl={self.pdl!r} is not valid; allowed values: True, False")
        if self.l2_prefetch is not None and not (
                isinstance(self.l2_prefetch, int) and not isinstance(self.l2_prefetch, bool)
                and 0 <= self.l2_prefetch <= MAX_L2_PREFETCH):
            raise ConfigError(f"l2_prefetch={self.l2_prefetch!r} is not valid; allowed values: an int from 0 (off) "
                              f"to {MAX_L2_PREFETCH} (pages ahead), or None (the kernel's default)")
        _positive_int("num_splits", self.num_splits)
        _positive_int("num_stages", self.num_stages)
        _positive_int("maxnreg", self.maxnreg)
        _positive_int("num_warps", self.num_warps, pow2=True)
        _positive_int("block_m", self.block_m, pow2=True, low=16)

    @classmethod
    def from_dict(cls, knobs: Mapping[str, Any] | None) -> DecodeOptions:
        """Options from a mapping (a sweep YAML's kernel_options, a benchmark's knobs); unknown keys are an
        error naming them and the valid fields."""
        knobs = dict(knobs or {})
        unknown = sorted(set(knobs) - set(FIELDS))
        if unknown:
            raise ConfigError(f"unknown decode option(s) {', '.join(map(repr, unknown))}; "
                              f"valid options: {', '.join(FIELDS)}")
        return cls(**knobs)

    def replace(self, **changes: Any) -> DecodeOptions:
        return self.from_dict({**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def launch_knobs(self) -> dict[str, int]:
        """The launch parameters the caller set (block_m, num_warps, num_stages, maxnreg)."""
        return {k: v for k, v in (("block_m", self.block_m), ("num_warps", self.num_warps),
                                  ("num_stages", self.num_stages), ("maxnreg", self.maxnreg)) if v is not None}


FIELDS = tuple(f.name for f in dataclasses.fields(DecodeOptions))


def as_options(options: DecodeOptions | Mapping[str, Any] | None = None, **knobs: Any) -> DecodeOptions:
    """`options` (a DecodeOptions, a mapping or None) with keyword knobs on top; None-valued knobs are unset."""
    if options is not None and not isinstance(options, (DecodeOptions, Mapping)):
        raise ConfigError(f"options must be a DecodeOptions or a mapping, got {type(options).__name__}")
    base = options.as_dict() if isinstance(options, DecodeOptions) else dict(options or {})
    base.update({k: v for k, v in knobs.items() if v is not None})
    return DecodeOptions.from_dict(base)


def _positive_int(name: str, v: object, *, pow2: bool = False, low: int = 1) -> None:
    if v is None:
        return
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= low and (not pow2 or v & (v - 1) == 0)
    if not ok:
        want = f"a power of two >= {low}" if pow2 else "a positive int"
        raise ConfigError(f"{name}={v!r} is not valid; allowed values: {want} (or None for the default)")
