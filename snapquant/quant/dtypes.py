"""Element formats: how one scaled value becomes a stored code and back.

Each format is one small object in a registry, so a new format is one `register_element_format`
call (kvpress / lm-eval style) and every config, quantizer and report picks it up.

Conventions shared by all formats (docs/numerics.md, "Element formats"):
- the quantizer divides by the scale in fp32 and hands the true fp32 quotient to `encode`;
- float formats round to nearest even with saturation to +-max (never to inf/NaN);
- integer formats are symmetric, round half to even, and saturate to the two's-complement range;
- 16-bit "passthrough" formats have no scale: they are a plain cast (rounding to nearest even).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import unknown_choice

Kind = Literal["passthrough", "float", "int"]


@dataclass(frozen=True)
class ElementFormat:
    name: str
    kind: Kind
    bits: int
    storage_dtype: torch.dtype
    # Largest magnitude the scale maps amax to (448 for e4m3). None for passthrough formats.
    qmax: float | None = None
    # Saturation bounds of the code domain (float max, or the int range).
    lo: float = 0.0
    hi: float = 0.0

    @property
    def is_quantized(self) -> bool:
        return self.kind != "passthrough"

    def storage_bytes(self, n_elements: int) -> float:
        return n_elements * self.bits / 8

    def encode(self, x32: torch.Tensor) -> torch.Tensor:
        """fp32 values (already divided by the scale) -> stored codes. int4 is packed in pairs."""
        if self.kind == "passthrough":
            return x32.to(self.storage_dtype)
        x = x32.clamp(self.lo, self.hi)  # saturate: the cast itself must never see out-of-range values
        if self.kind == "float":
            return x.to(self.storage_dtype)
        q = torch.round(x)  # round half to even
        if self.bits == 4:
            return _pack_int4(q.to(torch.int8))
        return q.to(self.storage_dtype)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Stored codes -> their exact values in fp32 (every code of every format is exact in fp32)."""
        if self.bits == 4:
            return _unpack_int4(codes).to(torch.float32)
        return codes.to(torch.float32)

    def round_trip(self, x32: torch.Tensor) -> torch.Tensor:
        """encode then decode: the value a quantized element takes, in fp32."""
        return self.decode(self.encode(x32))


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], last dim even -> uint8, element 2i in the low nibble, 2i+1 in the high."""
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    both = torch.stack([lo, hi], dim=-1).flatten(-2)
    return torch.where(both >= 8, both - 16, both)  # two's complement nibble


_FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_FP8_E5M2_MAX = float(torch.finfo(torch.float8_e5m2).max)  # 57344

ELEMENT_FORMATS: dict[str, ElementFormat] = {}


def register_element_format(fmt: ElementFormat) -> ElementFormat:
    ELEMENT_FORMATS[fmt.name] = fmt
    return fmt


register_element_format(ElementFormat("bf16", "passthrough", 16, torch.bfloat16))
register_element_format(ElementFormat("fp16", "passthrough", 16, torch.float16))
register_element_format(
    ElementFormat("fp8_e4m3", "float", 8, torch.float8_e4m3fn, _FP8_E4M3_MAX, -_FP8_E4M3_MAX, _FP8_E4M3_MAX)
)
register_element_format(
    ElementFormat("fp8_e5m2", "float", 8, torch.float8_e5m2, _FP8_E5M2_MAX, -_FP8_E5M2_MAX, _FP8_E5M2_MAX)
)
register_element_format(ElementFormat("int8", "int", 8, torch.int8, 127.0, -128.0, 127.0))
register_element_format(ElementFormat("int4", "int", 4, torch.uint8, 7.0, -8.0, 7.0))


def get_element_format(name: str, field: str = "dtype") -> ElementFormat:
    try:
        return ELEMENT_FORMATS[name]
    except KeyError:
        raise unknown_choice(field, name, ELEMENT_FORMATS) from None


# Largest finite value of the 16-bit storage types, used to saturate pre-scaled RoPE.
SIXTEEN_BIT_MAX = {
    torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
    torch.float16: float(torch.finfo(torch.float16).max),
}
