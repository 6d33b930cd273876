"""`QuantizedTensor`: one quantized part of the cache (latent or RoPE) as a cache would store it.

Scales are kept in one canonical layout so every consumer (dequantize, reference decode, kernels,
byte counting) reads them the same way:

    scale: [*lead, n_token_groups, n_channel_blocks]      (leading dims may be 1 = broadcast)

with `token_group` tokens sharing a row and `width // n_channel_blocks` channels sharing a column:

    per_token            [*lead, T, 1]            token_group = 1
    per_token_block      [*lead, T, width/block]   token_group = 1
    per_channel          [*lead, ceil(T/G), width] token_group = G (or T: one group)
    per_tensor_*         [1, ..., 1, 1]            token_group = T (broadcast)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtypes import ElementFormat
from .scales import ScaleFormat


@dataclass
class QuantizedTensor:
    data: torch.Tensor
    """Codes in the storage dtype: fp8 / int8 / packed-int4 uint8 / bf16 / fp16. Shape [*lead, T, w(/2)]."""
    scale: torch.Tensor | None
    """Stored scales (fp32, or uint8 exponents for e8m0) in the canonical layout above; None = no scale."""
    fmt: ElementFormat
    scale_fmt: ScaleFormat | None
    granularity: str
    width: int
    token_group: int | None = None
    """Tokens per scale row (1 for per-token formats, None = all tokens share one row)."""

    # ----------------------------------------------------------------- shape
    @property
    def num_tokens(self) -> int:
        return self.data.shape[-2]

    @property
    def lead_shape(self) -> torch.Size:
        return self.data.shape[:-2]

    @property
    def channel_blocks(self) -> int:
        return 1 if self.scale is None else self.scale.shape[-1]

    @property
    def block_width(self) -> int:
        return self.width // self.channel_blocks

    # ----------------------------------------------------------------- values
    def codes_f32(self) -> torch.Tensor:
        """The exact value of every stored code, fp32, [*lead, T, width]."""
        return self.fmt.decode(self.data)

    def scale_f32(self) -> torch.Tensor | None:
        """Decoded scales in the canonical (compact) layout."""
        if self.scale is None:
            return None
        return self.scale_fmt.decode(self.scale)

    def token_scales(self) -> torch.Tensor:
        """Scales expanded along tokens: [*lead, T, n_channel_blocks] fp32 (ones when unscaled)."""
        T = self.num_tokens
        s = self.scale_f32()
        if s is None:
            return torch.ones(*self.lead_shape, T, 1, dtype=torch.float32, device=self.data.device)
        if self.token_group is None:
            s = s.expand(*s.shape[:-2], T, s.shape[-1])
        elif self.token_group > 1:
            s = s.repeat_interleave(self.token_group, dim=-2)[..., :T, :]
        return s.expand(*self.lead_shape, T, s.shape[-1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        x = self.codes_f32()
        if self.scale is not None:
            x = x * self.token_scales().repeat_interleave(self.block_width, dim=-1)
        return x.to(dtype)

    # ----------------------------------------------------------------- bytes
    @property
    def nbytes(self) -> int:
        """Bytes a cache holds for this part: codes plus stored scales (broadcast scales counted once)."""
        n = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            n += self.scale.numel() * self.scale.element_size()
        return n

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(
            self.data.to(device), None if self.scale is None else self.scale.to(device), self.fmt,
            self.scale_fmt, self.granularity, self.width, self.token_group,
        )
