"""FLOP and byte counts of MLA decode and of quantize-and-append, and roofline times.

Decode of one query token per request (s_q = S in general), kv_lora_rank r, RoPE width d, H heads:
    FLOPs  = 2 * H * S * sum_b L_b * (r + d + r)     (QK over r + d, PV over r; docs/performance.md)
    bytes  = sum_b L_b * bytes_per_token(format)     (the format's own cache bytes: 1152 bf16, 644
                                                      snapmla, 656 ds_v32 at r = 512, d = 64)
    io     = B * S * H * ((r + d) * 2 + r * 4 + 4)   (bf16 query in, fp32 output and LSE out)
The cache bytes are what "GB/s of the format's own bytes" divides by; io bytes are
reported next to them (at H = 128 they add 5-15 %). With S > 1 and a causal mask the FLOPs count
every query row over every cached token (an upper bound by S - 1 tokens per row).

Quantize-and-append of n tokens from bf16 (or fp32) inputs:
    bytes  = n * ((r + d) * in_bytes + bytes_per_token(format) + 8)   (read input, write cache, slot)
"""

from __future__ import annotations

from ..config import KVQuantConfig
from ..quant import bytes_per_token

R, D = 512, 64  # DeepSeek kv_lora_rank, qk_rope_head_dim

# H200 ceilings (docs/performance.md, "Ceilings"): read bandwidth 4.33 TB/s measured (this rounds it
# down; a device copy reaches only 2.7 TB/s read + write), bf16 dense matmul ~790 TFLOP/s measured;
# FP8 MMA ~2x bf16 by datasheet. Used only for "% of roofline" columns and the plot.
H200_READ_GBPS = 4250.0
H200_BF16_TFLOPS = 790.0


def decode_flops(heads: int, tokens: int, q_tokens: int = 1, r: int = R, d: int = D) -> float:
    """FLOPs of one decode step over `tokens` cached tokens in total (summed over requests)."""
    _positive(heads=heads, q_tokens=q_tokens, r=r, d=d)
    _non_negative(tokens=tokens)
    return 2.0 * heads * q_tokens * tokens * (r + d + r)


def cache_bytes(config: KVQuantConfig, tokens: int, r: int = R, d: int = D) -> float:
    """Bytes of `tokens` cached tokens in `config`'s format (one layer)."""
    _non_negative(tokens=tokens)
    return float(tokens) * bytes_per_token(config, r, d)


def io_bytes(batch: int, heads: int, q_tokens: int = 1, r: int = R, d: int = D) -> float:
    """Query (bf16) read plus output (fp32) and LSE (fp32) written by one decode step."""
    _positive(batch=batch, heads=heads, q_tokens=q_tokens)
    return float(batch * q_tokens * heads * ((r + d) * 2 + r * 4 + 4))


def append_bytes(config: KVQuantConfig, tokens: int, in_bytes: int = 2, r: int = R, d: int = D) -> float:
    """Bytes moved by quantize-and-append of `tokens` tokens: input read, cache written, slot read."""
    _non_negative(tokens=tokens)
    _positive(in_bytes=in_bytes)
    return float(tokens) * ((r + d) * in_bytes + bytes_per_token(config, r, d) + 8)


def rate(amount: float, us: float) -> float:
    """amount per second / 1e9 (GB/s for bytes, GFLOP/s for FLOPs) of `amount` done in `us` microseconds."""
    if not us > 0:
        return float("nan")
    return amount / (us * 1e-6) / 1e9


def roofline_us(bytes_: float, flops: float, gbps: float = H200_READ_GBPS,
                tflops: float = H200_BF16_TFLOPS) -> float:
    """Lower bound on the time: the slower of streaming the bytes and doing the FLOPs."""
    _positive(gbps=gbps, tflops=tflops)
    return max(bytes_ / (gbps * 1e3), flops / (tflops * 1e6))


def _positive(**kw: float) -> None:
    for k, v in kw.items():
        if not v > 0:
            raise ValueError(f"{k} must be positive, got {v!r}")


def _non_negative(**kw: float) -> None:
    for k, v in kw.items():
        if not v >= 0:
            raise ValueError(f"{k} must be >= 0, got {v!r}")
