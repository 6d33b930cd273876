"""The numbers the formats and the decode pipeline share: one definition each.

The quantizers (`snapquant.quant`), the PyTorch reference (`snapquant.reference`) and the kernels
(`snapquant.kernels`, where Triton and Gluon read them as compile-time constants) all import them from
here, so a kernel cannot silently compute with a different floor or range than the reference it is
tested against (tests/test_constants.py checks the values each kernel module compiles).
"""

from __future__ import annotations

import struct

E4M3_MAX = 448.0
"""Largest finite fp8 e4m3fn magnitude: the scale rule maps a row's amax here (s = amax / 448)."""

E4M3_RCP = struct.unpack("f", struct.pack("f", 1.0 / E4M3_MAX))[0]
"""RN_fp32(1 / 448): a kernel may divide by 448 as a multiply by this plus one fma correction."""

BF16_MAX = 3.3895313892515355e38
"""Largest finite bf16: pre-scaled RoPE (r / s) and the RoPE query (q_r / sigma) are clamped to it."""

SCALE_FLOOR = 2.0**-86
"""Scales never go below this (~1.3e-26), so a row of tiny or subnormal values still gets a finite
quotient, and pre-scaled RoPE r / s stays inside bf16 range for any realistic |r|."""

FLASHMLA_SCALE_MIN = struct.unpack("f", struct.pack("f", 1e-4))[0]
"""RN_fp32(1e-4): FlashMLA's reference quantizer clamps a tile's scale amax / 448 to at least this before
rounding it up to a power of two, so every tile scale is >= 2^-13 (the `flashmla` scale rule)."""

FLT_MIN = 2.0**-126
"""Smallest normal fp32: vLLM's fp8_ds_mla cache writer clamps its tile scales to at least this (the
`vllm` scale rule), so an all-zero tile gets a finite, nonzero scale."""

PI_REL_FLOOR = 2.0**-40
"""fp8_scale_fused P: the P scale pi is floored at PI_REL_FLOOR times the largest earlier pi (in the
current running max's units), so pi_old / pi cannot overflow fp32 when a block's peak lies far below
an earlier one's; it only flushes probabilities below 2^-40 of the earlier peak."""

PI_ABS_FLOOR = 2.0**-100
"""... and at this absolute floor."""

PAGE_SIZE = 64
"""Tokens per cache page, which is also the online-softmax block: P is quantized per row per page, so a
config's pv_block must equal it for the kernels."""
