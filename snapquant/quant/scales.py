"""Scale formats (how a computed fp32 scale is rounded and stored) and scale rules (how it is computed).

Formats:
- fp32: stored as computed (`amax / qmax`).
- pow2: rounded *up* to a power of two, stored as fp32 (FlashMLA's DeepSeek-V3.2 tiles). Rounding up
  keeps `amax / scale <= qmax`, so nothing saturates; a power of two survives format conversions.
- e8m0: the same power of two, stored as one biased-exponent byte (OCP MX style, 2^-127..2^127).

Rules (`SCALE_RULES`; docs/numerics.md, "Scales"), with D the divisor (the format's qmax, or the
config's `scale_divisor`):
- snapquant: s = amax / D, 1 where amax = 0, floored at SCALE_FLOOR; pow2 / e8m0 round up exactly.
- flashmla: FlashMLA's reference quantizer (its tests/quant.py): s = max(amax / D, fl32(1e-4)), then
  2^ceil(fl32(log2 s)), with the fp32 logarithm's rounding modelled exactly (pow2 / e8m0 only).
- vllm: vLLM's cache writers: s = max(amax / D, FLT_MIN), kept in fp32 (fp32 only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..constants import FLASHMLA_SCALE_MIN, FLT_MIN, SCALE_FLOOR  # snapquant's floor: ~1.3e-26
from ..errors import unknown_choice


@dataclass(frozen=True)
class ScaleFormat:
    name: str
    bytes_per_scale: int
    storage_dtype: torch.dtype

    def round(self, s: torch.Tensor) -> torch.Tensor:
        """fp32 scale -> the fp32 scale actually used (exactly representable in storage)."""
        if self.name == "fp32":
            return s
        return pow2_ceil(s).clamp(2.0**-127, 2.0**127)

    def encode(self, s_used: torch.Tensor) -> torch.Tensor:
        if self.name == "e8m0":
            _, e = torch.frexp(s_used)  # s_used = 0.5 * 2^e exactly
            return (e - 1 + 127).clamp(0, 254).to(torch.uint8)
        return s_used.to(torch.float32)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        if self.name == "e8m0":
            return torch.ldexp(torch.ones_like(stored, dtype=torch.float32), stored.to(torch.int32) - 127)
        return stored.to(torch.float32)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s (s > 0), exact in fp32 including subnormals."""
    m, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(s), e)


SCALE_FORMATS: dict[str, ScaleFormat] = {
    "fp32": ScaleFormat("fp32", 4, torch.float32),
    "pow2": ScaleFormat("pow2", 4, torch.float32),
    "e8m0": ScaleFormat("e8m0", 1, torch.uint8),
}


def get_scale_format(name: str) -> ScaleFormat:
    try:
        return SCALE_FORMATS[name]
    except KeyError:
        raise unknown_choice("scale_format", name, SCALE_FORMATS) from None


def compute_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The SnapMLA scale rule in fp32: s = amax / qmax, s = 1 where amax == 0, floored at SCALE_FLOOR."""
    amax = amax.to(torch.float32)
    # Divide by a tensor, not a Python float: CUDA turns `t / scalar` into a multiply by the
    # reciprocal, which is not correctly rounded and would make GPU scales differ from CPU ones.
    s = amax / torch.tensor(qmax, dtype=torch.float32, device=amax.device)
    s = torch.where(amax == 0, torch.ones_like(s), s.clamp_min(SCALE_FLOOR))
    return s


# ------------------------------------------------------------------ scale rules
SCALE_RULES: dict[str, tuple[str, ...]] = {
    "snapquant": ("fp32", "pow2", "e8m0"),
    "flashmla": ("pow2", "e8m0"),
    "vllm": ("fp32",),
}
"""Scale rule -> the scale formats it is defined with."""


def rule_scale(amax: torch.Tensor, divisor: float, rule: str, scale_format: ScaleFormat) -> torch.Tensor:
    """The fp32 scale a part stores (before `scale_format.encode`) for the elements whose max |x| is `amax`."""
    amax = amax.to(torch.float32)
    # A tensor divisor: CUDA turns `t / scalar` into a multiply by the reciprocal (see compute_scale).
    s = amax / torch.tensor(divisor, dtype=torch.float32, device=amax.device)
    if rule == "snapquant":
        s = torch.where(amax == 0, torch.ones_like(s), s.clamp_min(SCALE_FLOOR))
        return scale_format.round(s)
    if rule == "flashmla":
        return pow2_ceil_log2f(s.clamp_min(FLASHMLA_SCALE_MIN))
    if rule == "vllm":
        return s.clamp_min(FLT_MIN)
    raise unknown_choice("scale_rule", rule, SCALE_RULES)


def _log2f_round_down_limits() -> torch.Tensor:
    """M[k + 150]: the largest mantissa step m with RN_fp32(log2(2^k (1 + m 2^-23))) == k.

    log2(s) = k + delta with delta = log2(1 + m 2^-23) rounds to the integer k in fp32 exactly when delta
    is below half the fp32 spacing next to k on delta's side: 2^(j - 24) with j = floor(log2 |k|), or
    2^(j - 25) for negative k with |k| = 2^j (the spacing halves below a power of two). k = 0 never
    rounds (delta >= 1.7e-7 is representable). The limits are far from integers (fractional parts >= 0.09),
    so float64 decides them exactly."""
    limits = []
    for k in range(-150, 129):
        if k == 0:
            limits.append(0)
            continue
        j = abs(k).bit_length() - 1
        half = 2.0 ** (j - 25 if k < 0 and abs(k) == 1 << j else j - 24)
        limits.append(math.floor(math.expm1(half * math.log(2.0)) * 2.0**23))
    return torch.tensor(limits, dtype=torch.int32)


_LOG2F_LIMITS = _log2f_round_down_limits()


def pow2_ceil_log2f(s: torch.Tensor) -> torch.Tensor:
    """2^ceil(RN_fp32(log2 s)) for fp32 s > 0: a power of two computed the way FlashMLA's reference does,
    through an fp32 logarithm, clamped to [2^-127, 2^127].

    This is the exact power-of-two ceiling, except for s within a few fp32 steps above a power of two 2^k
    (none for |k| <= 3, up to 22 for |k| >= 64), where the rounded logarithm is the integer k and the
    result is 2^k < s (the quotient then exceeds qmax by < 3e-6 relative and saturates). Modelled with
    integer arithmetic, so every device gives the same bits; it equals PyTorch's fp32 log2 on CPU at every
    such s (docs/numerics.md, "Scale rules")."""
    m, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1): floor(log2 s) = e - 1
    k = e - 1
    steps = ((m * 2 - 1) * 2.0**23).to(torch.int32)  # the mantissa field: exact
    limits = _LOG2F_LIMITS.to(s.device)[(k + 150).clamp(0, _LOG2F_LIMITS.numel() - 1).long()]
    up = (steps > limits).to(k.dtype)  # 0 for exact powers of two and for the rounded-down steps
    return torch.ldexp(torch.ones_like(s), (k + up).clamp(-127, 127))
