"""Every timed decode variant, and how a run selects them.

A variant is one implementation with fixed knobs: our BF16 kernel, our kernel over an FP8 cache in
each supported query/PV mode (snapmla layout: fp8 or bf16 query x fp8 scale-fused or bf16 P), a
kernel knob on top of a mode (work schedule, P scaling, native FP8 MMA, splits, tile, warps,
stages), the DeepSeek-V3.2 layout, or a plain PyTorch baseline. Priorities order the run so that a
time budget cuts sweeps before variants and variants before the core set:

    0  core      one per family and FP8 mode, default knobs (every shape)
    1  variants  the kernel variants (every shape; ds_v32 on headline shapes)
    2  sweeps    tuning knobs (headline shapes only)

`check_vs` names the variant whose output (same inputs) this one must match within `tol` (relative
L2): knob variants against their mode's default (tight: 2e-3, or 5e-3 / 1e-2 where P rounding or
the FP8 MMA may differ), modes against our BF16 kernel (0.25: a gross-error detector only, since
the FP8 cache and an fp8 query cost percents on random data, docs/numerics.md "How large the errors
are"). A fast but wrong
variant is reported as status "mismatch".
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from typing import Any

import triton

from ..config import KVQuantConfig
from ..errors import ConfigError
from ..presets import PRESETS
from .shapes import HEADLINE, DecodeShape

FAMILIES = ("bf16", "fp8", "torch", "anchor")
IMPLS = ("kernel", "torch_matmul", "torch_sdpa", "flashmla")
WHERE = ("all", "headline", "small_rows", "small_rows_headline", "rows16", "rows_gt16")


@dataclass(frozen=True)
class Variant:
    name: str
    family: str  # bf16 | fp8 | torch | anchor (FlashMLA, the kernel users run instead)
    layout: str  # bf16 | snapmla | ds_v32 (the cache format it reads)
    query: str = "bf16"
    pv: str = "bf16"
    knobs: tuple[tuple[str, Any], ...] = ()  # mla_decode_plan keywords (+ parts_per_sm, resolved per shape)
    priority: int = 0
    check_vs: str | None = None
    tol: float = 2e-3
    where: str = "all"  # all | headline | small_rows (S * H < 64: block_m 64 pads rows) | small_rows_headline
    # | rows16 (S * H <= 16) | rows_gt16
    impl: str = "kernel"
    note: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"variant {self.name}: family={self.family!r} not in {FAMILIES}")
        if self.impl not in IMPLS or self.where not in WHERE:
            raise ConfigError(f"variant {self.name}: impl={self.impl!r} / where={self.where!r} unknown")

    @property
    def mode(self) -> str:
        """q8p8 style label of the query / P precision."""
        return f"q{8 if self.query == 'fp8_e4m3' else 16}p{8 if self.pv == 'fp8_scale_fused' else 16}"

    @property
    def knob_dict(self) -> dict[str, Any]:
        return dict(self.knobs)

    @property
    def knob_label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.knobs) or "default"

    def config(self) -> KVQuantConfig:
        base = {"bf16": PRESETS["bf16"], "snapmla": PRESETS["snapmla"], "ds_v32": PRESETS["ds_v32"]}[self.layout]
        return base if self.layout == "bf16" else base.replace(query=self.query, pv=self.pv)

    def applies(self, shape: DecodeShape) -> bool:
        if self.where == "headline":
            return shape.name in HEADLINE
        small = shape.heads * shape.q_tokens < 64
        if self.where == "small_rows":
            return small
        if self.where == "small_rows_headline":
            return small and shape.name in HEADLINE
        if self.where == "rows16":  # tile="gluon": one 16-row tile per request
            return shape.heads * shape.q_tokens <= 16
        if self.where == "rows_gt16":  # tile="gluon": 64-row tiles (gluon.wide)
            return shape.heads * shape.q_tokens > 16
        return True

    def kernel_kwargs(self, shape: DecodeShape, num_sms: int) -> dict[str, Any]:
        """Knobs for `mla_decode_plan`; parts_per_sm becomes num_splits for this shape and GPU."""
        kw = self.knob_dict
        pps = kw.pop("parts_per_sm", None)
        if pps is not None:
            rows = shape.heads * shape.q_tokens
            block_m = kw.get("block_m") or min(64, max(16, triton.next_power_of_2(rows)))
            nb = 4 if self.layout == "ds_v32" else 1  # ds_v32 preset: 512 / 128 channel blocks
            kw["num_splits"] = max(1, round(pps * num_sms / (triton.cdiv(rows, block_m) * nb)))
        return kw


def _v(name: str, family: str, layout: str, query: str = "bf16", pv: str = "bf16", *, priority: int = 0,
       check: str | None = None, tol: float = 2e-3, where: str = "all", impl: str = "kernel", note: str = "",
       **knobs: Any) -> Variant:
    return Variant(name, family, layout, query, pv, tuple(sorted(knobs.items())), priority, check, tol, where,
                   impl, note)


Q8, P8 = "fp8_e4m3", "fp8_scale_fused"
VARIANTS: tuple[Variant, ...] = (
    # ---- 0: core
    _v("bf16", "bf16", "bf16", note="our BF16 kernel: the baseline of every ratio"),
    _v("snapmla", "fp8", "snapmla", Q8, P8, check="bf16", tol=0.25, note="SnapMLA: fp8 query, fp8 scale-fused P"),
    _v("snapmla_kv_only", "fp8", "snapmla", check="bf16", tol=0.25, note="FP8 cache, bf16 query and P"),
    _v("snapmla_q_fp8", "fp8", "snapmla", Q8, check="bf16", tol=0.25, note="FP8 cache, fp8 query, bf16 P"),
    _v("snapmla_pv_fp8", "fp8", "snapmla", "bf16", P8, check="bf16", tol=0.25, note="FP8 cache, bf16 query, fp8 P"),
    _v("torch", "torch", "bf16", impl="torch_matmul", check="bf16", tol=2e-2,
       note="plain PyTorch absorbed attention: bf16 bmm over [c|r], fp32 softmax, bf16 P"),
    # FlashMLA BF16 on the same values (its [pages, 64, 1, r + d] layout, same block table): the anchor of
    # every time ratio (vs_flashmla). Its check against our BF16 kernel: both round P to bf16 (independent
    # roundings: ~u / sqrt(3) each in relative L2 on random data, u = 2^-8) and FlashMLA rounds its output
    # to bf16 (<= u): ~6e-3 expected, 2e-2 (the same arithmetic as the plain PyTorch row) detects any layout
    # or block-table error, which is O(1).
    _v("flashmla", "anchor", "bf16", impl="flashmla", check="bf16", tol=2e-2,
       note="FlashMLA BF16 decode (split-KV kernel + combine), when flash_mla is importable"),
    # ---- 1: kernel variants
    _v("snapmla+balanced", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", schedule="balanced"),
    _v("bf16+balanced", "bf16", "bf16", priority=1, check="bf16", schedule="balanced"),
    _v("snapmla+rcp", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=5e-3, p_div="rcp"),
    _v("snapmla+balanced+rcp", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=5e-3,
       schedule="balanced", p_div="rcp"),
    _v("snapmla+rows", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tile="rows", p_div="exact",
       note="the first FP8 kernel: fp8 tile as codes (not pipelined at H = 16), a division per P element"),
    _v("snapmla+exact", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", p_div="exact",
       note="div_rn per P element instead of the fma-corrected reciprocal (same bits)"),
    _v("snapmla+fp8qk", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-2, fp8_mma="qk",
       note="native FP8 QK MMA, exact fp16 PV"),
    # H * S < 64: 64-row tiles. Compile stats (sm_90): Triton pipelines the 8-bit tile only with wgmma
    # (BLOCK_M = 64), never at BLOCK_M = 16 (mma.sync), where the 16-bit tile is pipelined.
    _v("snapmla+bm64", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", where="small_rows", block_m=64,
       tile="pairs", note="64-row tiles (rows padded): wgmma and a pipelined FP8 tile"),
    _v("snapmla+bm64+rcp", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=5e-3, where="small_rows",
       block_m=64, p_div="rcp", tile="pairs"),
    _v("snapmla+balanced+bm64+rcp", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=5e-3,
       where="small_rows", block_m=64, p_div="rcp", schedule="balanced"),
    _v("bf16+bm64", "bf16", "bf16", priority=1, check="bf16", where="small_rows", block_m=64, tile="rows",
       note="64-row tiles (rows padded): wgmma instead of mma.sync"),
    _v("snapmla_kv_only+bm64", "fp8", "snapmla", priority=1, check="snapmla_kv_only", where="small_rows",
       block_m=64),
    _v("snapmla_kv_only+balanced", "fp8", "snapmla", priority=1, check="snapmla_kv_only", schedule="balanced"),
    _v("snapmla_q_fp8+balanced", "fp8", "snapmla", Q8, priority=1, check="snapmla_q_fp8", schedule="balanced"),
    _v("torch_sdpa", "torch", "bf16", priority=1, impl="torch_sdpa", check="bf16", tol=2e-2,
       note="F.scaled_dot_product_attention, one KV head broadcast (enable_gqa)"),
    _v("ds_v32", "fp8", "ds_v32", priority=1, check="bf16", tol=0.25, where="headline",
       note="DeepSeek-V3.2 layout: 4 pow2 scales per token, bf16 query and P"),
    # ---- 2: sweeps (headline shapes)
    _v("bf16+splits8", "bf16", "bf16", priority=2, check="bf16", where="headline", num_splits=8),
    _v("snapmla+splits8", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="headline", num_splits=8),
    # <= 16 rows at long contexts: one wave of 64-page runs instead of the default's cap of 32 pages a program
    # (32x16x32768: 256 programs instead of 512, two waves); the partials merge in another order (tol as above)
    _v("snapmla+splits8+narrow", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="rows16",
       tile="gluon", num_splits=8),
    _v("bf16+splits16", "bf16", "bf16", priority=2, check="bf16", where="headline", num_splits=16),
    _v("snapmla+splits16", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="headline", num_splits=16),
    _v("snapmla+balanced+parts1", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="headline",
       schedule="balanced", parts_per_sm=1),
    _v("snapmla+balanced+parts4", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="headline",
       schedule="balanced", parts_per_sm=4),
    _v("bf16+balanced+parts4", "bf16", "bf16", priority=2, check="bf16", where="headline",
       schedule="balanced", parts_per_sm=4),
    _v("bf16+bm64+balanced", "bf16", "bf16", priority=2, check="bf16", where="small_rows_headline", block_m=64,
       schedule="balanced"),
    _v("snapmla+bm64+s3", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="small_rows_headline",
       block_m=64, num_stages=3, tile="pairs"),
    _v("snapmla+tokens", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="headline", tile="tokens",
       note="swap AB: the page's tokens as the MMA M dimension"),
    _v("bf16+tokens", "bf16", "bf16", priority=2, check="bf16", where="headline", tile="tokens"),
    _v("bf16+w4", "bf16", "bf16", priority=2, check="bf16", where="headline", num_warps=4, tile="rows"),
    _v("snapmla+w4", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="headline", num_warps=4,
       tile="pairs"),
    _v("bf16+s3", "bf16", "bf16", priority=2, check="bf16", where="headline", num_stages=3, tile="rows"),
    _v("snapmla+s3", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="headline", num_stages=3,
       tile="pairs"),
    _v("snapmla+fp8mma", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", tol=1e-2, where="headline",
       fp8_mma=True, note="native FP8 MMA for QK and PV (PV needs an 8-bit transpose)"),
    # Two programs per SM (static, sm_90: 128 registers with 144-176 B of spills, 92 KB of shared memory
    # with one stage): latency hidden by a second resident program instead of prefetching. Unmeasured.
    _v("snapmla+occ2", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", where="small_rows", num_stages=1,
       maxnreg=128, tile="pairs", note="1 stage, 128 registers: two resident programs per SM"),
    _v("snapmla+occ2+balanced4", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", where="small_rows",
       num_stages=1, maxnreg=128, schedule="balanced", parts_per_sm=4),
    _v("bf16+occ2", "bf16", "bf16", priority=1, check="bf16", where="small_rows", maxnreg=128, tile="rows",
       note="128 registers, default stages (95 KB): two resident programs per SM"),
    # Gluon (snapquant/kernels/gluon/): TMA ring + swap-AB wgmma, one 16-row tile per request
    _v("snapmla+gluon+fp8qk+s1", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-2, where="rows16",
       tile="gluon", fp8_mma="qk", num_stages=1,
       note="gluon.narrow's native e4m3 QK with one slot (~57 KB, 168 registers): three programs per SM, each page "
            "asked for as soon as the last one's codes are in registers"),
    _v("snapmla+pairs", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tile="pairs",
       note="the plain-Triton pairs tile (the default where the Gluon kernel does not run)"),
    _v("snapmla+gluon", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tile="gluon",
       note="Gluon kernels: <= 16 rows TMA, swap-AB wgmma with register A operands widened from two slots, "
            "2 programs/SM (gluon.narrow); more rows: 64-row tiles, two warpgroups (gluon.wide)"),
    _v("snapmla+gluon+s1", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", where="rows16", tile="gluon",
       num_stages=1, note="<= 16 rows: gluon.narrow with one slot (~64 KB, 168 registers, one box's operand live at a "
                          "time): three programs per SM, each page asked for once the last one's codes are in registers"),
    _v("snapmla+gluon+halves", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-4, where="rows16",
       tile="gluon", num_warps=8,
       note="<= 16 rows: gluon.narrow_halves (experimental), eight warps whose two warpgroups split each page's "
            "channels (QK, PV) at two programs per SM (128 registers)"),
    _v("bf16+gluon", "bf16", "bf16", priority=1, check="bf16", tile="gluon",
       note="the Gluon kernels on the bf16 layout, wgmma reading the TMA slots directly: <= 16 rows swap AB, two "
            "72 KB slots, one program per SM (gluon.narrow_bf16, opt-in); more rows 64-row tiles (gluon.wide)"),
    _v("bf16+ws", "bf16", "bf16", priority=1, check="bf16", tol=1e-3, where="rows_gt16", tile="gluon",
       warp_specialize=True,
       note="past 16 rows, gluon.seesaw asked for explicitly (the default where it runs): two warpgroups in roles"),
    # the pair schedule on the fp8 layout: same products (exact fp16 MMAs), P^ and row state handed over; check
    # against the default (gluon.wide): fp32 summation order only, as the GPU test's 5e-5 (here 1e-4)
    _v("snapmla+ws", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-4, where="rows_gt16",
       tile="gluon", warp_specialize=True,
       note="past 16 rows, gluon.seesaw_fp8 (opt-in): two warpgroups in roles over page pairs, each widening its "
            "own page"),
    _v("bf16+wide", "bf16", "bf16", priority=1, check="bf16", tol=1e-3, where="rows_gt16", tile="gluon",
       warp_specialize=False,
       note="past 16 rows, gluon.wide (one chain on 8 warps) instead of the default gluon.seesaw (two warpgroups in "
            "roles, lockstep over page pairs)"),
    _v("bf16+gluon+s1", "bf16", "bf16", priority=1, check="bf16", where="rows16", tile="gluon", num_stages=1,
       note="gluon.narrow_bf16 with one slot: two programs per SM, each waiting on its page while the other computes"),
    _v("snapmla+gluon+fp8mma", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-2, where="rows_gt16",
       tile="gluon", fp8_mma=True,
       note="native e4m3 QK and PV past 16 rows: 32-row programs, two per SM (gluon.narrow8), V^T from the TMA slot "
            "into registers"),
    _v("snapmla+gluon+fp8mma16", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-2, where="rows16",
       tile="gluon", fp8_mma=True,
       note="native e4m3 QK and PV at <= 16 rows: gluon.narrow8 with 16-row programs, two per SM"),
    _v("snapmla+gluon+fp8mma16+s1", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-2, where="rows16",
       tile="gluon", fp8_mma=True, num_stages=1,
       note="gluon.narrow8's 16-row programs with one slot (~55 KB, 168 registers): three per SM"),
    _v("snapmla+gluon+fp8mma+bm64", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-2,
       where="rows_gt16", tile="gluon", fp8_mma=True, block_m=64,
       note="native e4m3 QK and PV, 64-row programs (gluon.wide8, one per SM)"),
    _v("bf16+rows", "bf16", "bf16", priority=1, check="bf16", tile="rows",
       note="the plain-Triton BF16 kernel (rows tile), whatever the default"),
    _v("snapmla+gluon+s2", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", where="rows16", tile="gluon",
       num_stages=2, note="gluon.narrow with two slots (~105 KB, 2 programs/SM): the default at r = 512"),
    _v("snapmla+gluon+s3", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", where="rows16", tile="gluon",
       num_stages=3, note="gluon.narrow with three slots (~145 KB, 1 program/SM): slower than two (docs/performance.md)"),
    _v("snapmla+gluon+fp8qk", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=1e-2, where="rows16",
       tile="gluon", fp8_mma="qk", num_stages=2,
       note="gluon.narrow with a native e4m3 QK straight from the TMA slots (PV's operand still widened in registers, "
            "exact fp16 MMA), 2 programs/SM"),
    # how gluon.narrow widens e4m3 into its register A operands: the same bits (tol 0), different units
    _v("snapmla+int", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=0.0, where="rows16", tile="gluon",
       widen="int", note="gluon.narrow widening QK and PV operands by integer ops instead of cvt (same bits)"),
    _v("snapmla+int_qk", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=0.0, where="rows16",
       tile="gluon", widen="int_qk", note="QK operands by integer ops, PV by cvt"),
    _v("snapmla+int_pv", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=0.0, where="rows16",
       tile="gluon", widen="int_pv", note="PV operands by integer ops, QK by cvt"),
    _v("snapmla+int_pv2", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=0.0, where="rows16",
       tile="gluon", widen="int_pv2", note="two of PV's four boxes by integer ops, the rest by cvt"),
    _v("snapmla+int_qk_pv2", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=0.0, where="rows16",
       tile="gluon", widen="int_qk_pv2", note="QK and two PV boxes by integer ops, two PV boxes by cvt"),
    # L2 prefetch a few pages ahead of the narrow kernels' two-slot ring (one bulk prefetch per page and tensor,
    # issued by one thread): the same reads and arithmetic, so the same bits (tol 0)
    *(_v(f"{p}+pf{n}", fam, p, *fmt, priority=1, check=p, tol=0.0, where="rows16", tile="gluon", l2_prefetch=n,
         note=f"{kern} asking the L2 for the page {n} after the ring's next one")
      for p, fam, fmt, kern in (("snapmla", "fp8", (Q8, P8), "gluon.narrow"), ("bf16", "bf16", (), "gluon.narrow_bf16"))
      for n in (1, 2, 4)),
    # the combine as a programmatic dependent launch of stage 1 (opt-in pdl=True): it may launch as stage 1's
    # programs exit and waits for the grid on the GPU; the same arithmetic, so the same bits (tol 0)
    _v("bf16+pdl", "bf16", "bf16", priority=1, check="bf16", tol=0.0, pdl=True,
       note="our BF16 kernel with the combine launched as a programmatic dependent of stage 1"),
    _v("snapmla+pdl", "fp8", "snapmla", Q8, P8, priority=1, check="snapmla", tol=0.0, pdl=True,
       note="the FP8 default with the combine launched as a programmatic dependent of stage 1"),
    _v("bf16+w16", "bf16", "bf16", priority=2, check="bf16", where="headline", num_warps=16, tile="rows"),
    _v("snapmla+w16", "fp8", "snapmla", Q8, P8, priority=2, check="snapmla", where="headline", num_warps=16, tile="pairs",
       note="16 warps: 128 registers per thread, twice the warps to hide latency at one program per SM"),
    _v("snapmla_kv_only+splits8", "fp8", "snapmla", priority=2, check="snapmla_kv_only", where="headline",
       num_splits=8),
)
BY_NAME = {v.name: v for v in VARIANTS}
QUICK = ("bf16", "snapmla", "snapmla_kv_only", "torch", "snapmla+balanced", "snapmla+rcp", "snapmla+fp8qk",
         "snapmla+rows", "snapmla+bm64", "bf16+bm64")
BASELINE = "bf16"
ANCHOR = "flashmla"


def select_variants(spec: str | None = None, *, quick: bool = False, max_priority: int = 2,
                    registry: tuple[Variant, ...] = VARIANTS) -> list[Variant]:
    """Variants named by `spec` (comma list of names or globs; None = all), at most `max_priority`,
    in priority then registry order. The BF16 baseline and the FlashMLA anchor are always included (every
    ratio needs them; without flash_mla the anchor's rows say "FlashMLA not installed")."""
    names = [v.name for v in registry]
    if spec:
        wanted: set[str] = set()
        for pat in (p.strip() for p in spec.split(",") if p.strip()):
            hits = fnmatch.filter(names, pat)
            if not hits:
                raise ConfigError(f"variant {pat!r} matches nothing; known variants: {', '.join(names)}")
            wanted.update(hits)
    else:
        wanted = {n for n in names if not quick or n in QUICK}
    wanted.update((BASELINE, ANCHOR))
    chosen = [v for v in registry if v.name in wanted and (v.priority <= max_priority or v.name in (BASELINE, ANCHOR))]
    return sorted(chosen, key=lambda v: v.priority)


def with_kernel_options(variants: list[Variant], options: dict[str, Any]) -> list[Variant]:
    """`variants` plus, beside each core kernel variant among them (priority 0: default knobs), a twin that
    runs with `options` (the benchmark's `--kernel-options`): named `<name>+options`, checked against its
    core variant within 1e-2 (relative L2: the loosest knob tolerance above, native FP8 MMA's), so an
    option that changes the numbers more than any known knob is reported as a mismatch."""
    if not options:
        return variants
    label = " ".join(f"{k}={v}" for k, v in sorted(options.items()))
    twins = [replace(v, name=f"{v.name}+options", knobs=tuple(sorted(options.items())), check_vs=v.name, tol=1e-2,
                     note=f"--kernel-options {label}")
             for v in variants if v.impl == "kernel" and v.priority == 0]
    return sorted([*variants, *twins], key=lambda v: v.priority)
