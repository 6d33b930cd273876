"""Storage cost of a scheme, from the config alone (no tensors): `bytes_per_token`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .scales import get_scale_format

if TYPE_CHECKING:  # config imports the element formats from this package
    from ..config import KVQuantConfig


def part_bytes_per_token(config: KVQuantConfig, part: str, width: int) -> float:
    """Bytes one token costs for one part; group-shared scales are amortised (so may be fractional)."""
    fmt = config.part_format(part)
    data = fmt.storage_bytes(width)
    if not fmt.is_quantized or (part == "rope" and config.rope_prescale):
        return data  # pre-scaled RoPE reuses the latent's scale: no bytes of its own
    scale_bytes = get_scale_format(config.scale_format).bytes_per_scale
    gran = config.part_granularity(part)
    if gran == "per_token":
        return data + scale_bytes
    if gran == "per_token_block":
        return data + scale_bytes * (width // config.block_size)
    if gran == "per_channel" and config.token_group is not None:
        return data + scale_bytes * width / config.token_group
    return data  # per-tensor and whole-sequence per-channel scales are O(1) per layer


def bytes_per_token(config: KVQuantConfig, kv_lora_rank: int = 512, rope_dim: int = 64) -> float:
    """Cache bytes per token per layer. DeepSeek dims: bf16 1152, snapmla 644, ds_v32 656, per_tensor_fp8 576."""
    config.check_dims(kv_lora_rank, rope_dim)
    total = part_bytes_per_token(config, "nope", kv_lora_rank) + part_bytes_per_token(config, "rope", rope_dim)
    return int(total) if float(total).is_integer() else total
