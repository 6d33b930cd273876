"""How the reference computes its fp8 x fp8 dot products: exactly, or as Hopper's native FP8 MMA does.

The default kernels run every e4m3 x e4m3 product on fp16 MMAs (e4m3 values are exact in fp16, the
products exact in fp32, the sums fp32): `MMANumerics()` (mode "exact") is that arithmetic, and the
reference's own fp32 einsums compute it. The opt-in native FP8 kernels (`fp8_mma=True`) feed the e4m3
codes to wgmma, whose accumulation is not fp32. `MMANumerics(mode="hopper_fp8")` models it
(docs/numerics.md, "MMA numerics"):

  * every product of two e4m3 values is exact (8 significant bits);
  * the tensor core adds `k_group` products at a time (a wgmma FP8 instruction has K = 32) in one fused
    sum: the terms (the products and, with `align_accumulator`, the running accumulator) are aligned to
    the largest one's leading bit and each is truncated to `bits` significant bits below it (a multiple of
    2^(e - bits) where the largest term lies in [2^(e-1), 2^e)); the truncated terms add exactly and the
    result is rounded to the fp32 accumulator. DeepSeek-V3's technical report measured about 14 retained
    bits on H800 (docs/references.md), hence the defaults;
  * a chain of groups is promoted to fp32 every `qk_promote` / `pv_promote` products: the chain restarts
    from zero and its result is added to the running fp32 value in fp32 (None: never; the chain carries
    its accumulator through the MMA).

The defaults are the native8 Gluon kernels' structure (`gluon.narrow8`, `gluon.wide8`): QK in two chains
of 256 channels summed in fp32, PV carried across pages inside the MMA (the rescaled accumulator is the
MMA's C operand). `for_kernel` gives the numerics of each kernel. The retained bits, the group size, the
alignment of the accumulator and the truncation direction are what `scripts/check_mma_numerics_gpu.py`
fits against the kernels on the H200.

The model runs in float64: aligned, truncated terms are multiples of one power of two no more than
2^bits of it apart, so for bits <= 40 and k_group <= 4096 their sum is exact in float64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..errors import ConfigError, unknown_choice

MMA_MODES = ("exact", "hopper_fp8")
MMA_PRODUCTS = ("qk", "pv", "both")
TRUNCATIONS = ("toward_zero", "down")
MAX_BITS = 40  # float64 holds the sum of up to 4096 aligned terms of this many bits exactly
MAX_K_GROUP = 4096


@dataclass(frozen=True)
class MMANumerics:
    """Which arithmetic the fp8 x fp8 products of decode use (see the module docstring); validated.

    mode: "exact" (exact products, fp32 accumulation: the default kernels) | "hopper_fp8" (the native FP8
    MMA model). The other fields are read by "hopper_fp8" only; set away from their defaults in "exact"
    they are a ConfigError, as a knob that does nothing would be.
    """

    mode: str = "exact"
    bits: int | None = 14
    """Significant bits a term keeps below the group's largest leading bit; None: no truncation (then the
    products are exact and the reference runs its exact arithmetic, bit for bit)."""
    k_group: int = 32
    """Products the tensor core sums in one aligned step (a wgmma FP8 instruction: K = 32)."""
    align_accumulator: bool = True
    """The running accumulator joins each group's alignment (and is truncated with it); False: the group's
    sum is rounded to fp32 on its own and added to the accumulator in fp32."""
    truncation: str = "toward_zero"
    """How the aligned terms lose their low bits: toward_zero (sign-magnitude) | down (two's complement)."""
    qk_promote: int | None = 256
    """QK products per chain before the chain is added to the running score in fp32 (None: one chain)."""
    pv_promote: int | None = None
    """PV products per chain (None: the accumulator stays inside the MMA across pages)."""
    products: str = "both"
    """Which products use the native MMA: qk | pv | both (the kernels' fp8_mma "qk" / "pv" / True)."""

    def __post_init__(self) -> None:
        if self.mode not in MMA_MODES:
            raise unknown_choice("mma.mode", self.mode, MMA_MODES)
        if self.bits is not None and not (_is_int(self.bits) and 1 <= self.bits <= MAX_BITS):
            raise ConfigError(f"mma.bits={self.bits!r} is not valid; expected an int in [1, {MAX_BITS}] or None "
                              "(no truncation)")
        if not (_is_int(self.k_group) and 1 <= self.k_group <= MAX_K_GROUP):
            raise ConfigError(f"mma.k_group={self.k_group!r} is not valid; expected an int in [1, {MAX_K_GROUP}]")
        if not isinstance(self.align_accumulator, bool):
            raise ConfigError(f"mma.align_accumulator={self.align_accumulator!r} is not valid; allowed: true, false")
        if self.truncation not in TRUNCATIONS:
            raise unknown_choice("mma.truncation", self.truncation, TRUNCATIONS)
        if self.products not in MMA_PRODUCTS:
            raise unknown_choice("mma.products", self.products, MMA_PRODUCTS)
        for name in ("qk_promote", "pv_promote"):
            v = getattr(self, name)
            # a chain is promoted between MMA instructions, never inside a group
            if v is not None and not (_is_int(v) and v >= 1 and v % self.k_group == 0):
                raise ConfigError(f"mma.{name}={v!r} is not valid; expected a positive multiple of "
                                  f"k_group={self.k_group}, or None (never promoted)")
        if self.mode == "exact":
            changed = [f.name for f in fields(self) if f.name != "mode" and getattr(self, f.name) != f.default]
            if changed:
                raise ConfigError(f"mma.{', mma.'.join(changed)} has no effect with mode='exact' (exact products, "
                                  "fp32 accumulation); set mode='hopper_fp8' or leave the defaults")

    # ------------------------------------------------------------------ what it models
    @property
    def native_qk(self) -> bool:
        """QK's fp8 x fp8 products go through the model (and are not exact)."""
        return self.mode == "hopper_fp8" and self.bits is not None and self.products in ("qk", "both")

    @property
    def native_pv(self) -> bool:
        return self.mode == "hopper_fp8" and self.bits is not None and self.products in ("pv", "both")

    def describe(self) -> str:
        """One line for tables: what the preset's kernel computes its fp8 x fp8 products with."""
        if self.mode == "exact":
            return "exact products, fp32 accumulation"
        bits = "no truncation" if self.bits is None else f"{self.bits} bits"
        acc = "accumulator aligned" if self.align_accumulator else "accumulator fp32"
        return (f"hopper_fp8 ({self.products}): {bits} per {self.k_group}-product group, {acc}, "
                f"{self.truncation}, promoted every qk {self.qk_promote} / pv {self.pv_promote}")

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MMANumerics:
        if not isinstance(d, Mapping):
            raise ConfigError(f"MMANumerics expects a mapping, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        for k in d:
            if k not in names:
                raise unknown_choice("MMANumerics field", k, names)
        return cls(**d)

    def replace(self, **changes: Any) -> MMANumerics:
        return self.from_dict({**self.to_dict(), **changes})

    @classmethod
    def for_kernel(cls, kernel: str, fp8_mma: bool | str = False) -> MMANumerics:
        """The numerics of a decode kernel (a `snapquant.kernels.KERNELS` name) run with `fp8_mma`.

        Without fp8_mma every kernel is exact. With it: the native8 Gluon kernels as the defaults say;
        the Triton tiles promote every 32 products (`max_num_imprecise_acc=32`: each K = 32 step starts
        from zero and is added in fp32). gluon.narrow's fp8_mma="qk" runs narrow8's QK (two 256-channel chains)
        and exact PV, with one slot or two. Any other kernel with native products (gluon.narrow_tile runs exact
        MMAs only) is a ConfigError."""
        mma = {"none": False, "both": True}.get(fp8_mma, fp8_mma) if isinstance(fp8_mma, str) else fp8_mma
        if mma is False:
            return cls()
        products = "both" if mma is True else str(mma)
        if kernel in ("gluon.narrow8", "gluon.wide8") or (kernel == "gluon.narrow" and products == "qk"):
            return cls(mode="hopper_fp8", products=products)
        if kernel.startswith("triton."):
            return cls(mode="hopper_fp8", products=products, qk_promote=32, pv_promote=32)
        raise ConfigError(f"no MMA numerics model for kernel {kernel!r} with fp8_mma={fp8_mma!r}; modelled: "
                          "gluon.narrow8, gluon.wide8, gluon.narrow with fp8_mma='qk', triton.* (or fp8_mma=False: exact)")


def as_mma(mma: MMANumerics | Mapping[str, Any] | str | None) -> MMANumerics:
    """None -> exact; a mode name -> that mode with its defaults; a mapping -> its fields."""
    if mma is None:
        return MMANumerics()
    if isinstance(mma, MMANumerics):
        return mma
    if isinstance(mma, str):
        return MMANumerics(mode=mma)
    if isinstance(mma, Mapping):
        return MMANumerics.from_dict(mma)
    raise ConfigError(f"mma must be an MMANumerics, a mapping, a mode name or None, got {type(mma).__name__}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------------- the model
def group_sum(acc: torch.Tensor, prods: torch.Tensor, numerics: MMANumerics) -> torch.Tensor:
    """One aligned step: acc [...] (fp32 values) plus the products [..., G] (exact), as the tensor core adds
    them; float64 in, float64 out (holding an fp32 value)."""
    bits = numerics.bits
    assert bits is not None
    terms = torch.cat([acc.unsqueeze(-1), prods], -1) if numerics.align_accumulator else prods
    _, e = torch.frexp(terms.abs().amax(-1, keepdim=True))  # largest term in [2^(e-1), 2^e); 0 -> e = 0
    quantum = torch.ldexp(torch.ones_like(terms[..., :1]), e - bits)
    cut = torch.trunc if numerics.truncation == "toward_zero" else torch.floor
    kept = cut(terms / quantum) * quantum  # a power-of-two division: exact
    total = kept.sum(-1)  # exact: integers below 2^53 times one power of two
    if numerics.align_accumulator:
        return total.to(torch.float32).to(torch.float64)
    return (acc + total.to(torch.float32).to(torch.float64)).to(torch.float32).to(torch.float64)


def mma_dot(acc: torch.Tensor, prods: torch.Tensor, numerics: MMANumerics, promote: int | None) -> torch.Tensor:
    """acc + sum over the last axis of `prods`, as the native FP8 MMA computes it.

    acc [...] fp32, prods [..., K] the exact products (float64), in the MMA's K order. K is cut into
    chains of `promote` products (None: one chain starting from acc), each chain into groups of k_group
    (zeros pad the last one: a zero neither moves the largest term nor the sum). Returns fp32.
    """
    g = numerics.k_group
    K = prods.shape[-1]
    chain = K if promote is None else promote
    n_chain = -(-K // chain)
    pad = n_chain * chain - K
    chain_pad = -(-chain // g) * g - chain  # a chain shorter than one group (K < k_group)
    p = torch.nn.functional.pad(prods, (0, pad))
    p = torch.nn.functional.pad(p.unflatten(-1, (n_chain, chain)), (0, chain_pad))
    p = p.unflatten(-1, (-1, g))  # [..., n_chain, groups, g]
    run = acc.to(torch.float64)
    for c in range(n_chain):
        part = run if promote is None else torch.zeros_like(run)
        for k in range(p.shape[-2]):
            part = group_sum(part, p[..., c, k, :], numerics)
        # promoted: the chain's fp32 result is added to the running value in fp32 registers
        run = part if promote is None else (run + part).to(torch.float32).to(torch.float64)
    return run.to(torch.float32)
