"""Scale formats: how a computed fp32 scale is rounded and stored.

- fp32: stored as computed (`amax / qmax`).
- pow2: rounded *up* to a power of two, stored as fp32 (DeepSeek-V3.2's fp8_ds_mla). Rounding up
  keeps `amax / scale <= qmax`, so nothing saturates; a power of two survives format conversions.
- e8m0: the same power of two, stored as one biased-exponent byte (OCP MX style, 2^-127..2^127).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..constants import SCALE_FLOOR  # scales never go below this (~1.3e-26)
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
