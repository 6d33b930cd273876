"""Which `KVQuantConfig`s the Triton kernels implement, and how each is laid out in pages.

Three cache layouts, all in pages of 64 tokens (`PAGE_SIZE`, from `snapquant.constants`):

    snapmla  latent [P, 64, r] fp8 e4m3, scale [P, 64] fp32 (one per token),
             rope [P, 64, d] bf16 pre-divided by the token's scale (SnapMLA, 644 B at 512/64)
    ds_v32   latent [P, 64, r] fp8 e4m3, scale [P, 64, r / block] fp32 (powers of two for the ds_v32
             preset, plain for ds_v32_vllm), rope [P, 64, d] bf16 as is (DeepSeek-V3.2's 656 B at
             512/64 with block 128)
    bf16     latent [P, 64, r] bf16, rope [P, 64, d] bf16, no scale (the baseline, 1152 B)

Decode knobs: query bf16 | fp8_e4m3, pv bf16 | fp8_scale_fused on both fp8 layouts; the bf16
layout takes query bf16 and pv bf16 only. P is quantized per row per 64-token page, so the config's
pv_block must be 64. Widths r and d must be powers of two >= 16 (tl.arange and tl.dot shapes).
"""

from __future__ import annotations

from ..config import KVQuantConfig
from ..constants import PAGE_SIZE

GLUON_ROWS = 16  # query rows per program of the narrow Gluon kernels (gluon/narrow*.py: wgmma N) ...
GLUON_WIDE_ROWS = 64  # ... and of the 64-row one past that (gluon/wide.py: wgmma M)
GLUON_BOX = 128  # bytes per row of the Gluon kernels' TMA boxes (the widest swizzle): 128 fp8 channels
LAYOUTS = ("snapmla", "ds_v32", "bf16")
LAYOUT_ID = {"bf16": 0, "snapmla": 1, "ds_v32": 2}  # the kernels' LAYOUT constexpr
MIN_WIDTH = 16

__all__ = ["GLUON_BOX", "GLUON_ROWS", "GLUON_WIDE_ROWS", "LAYOUTS", "LAYOUT_ID", "MIN_WIDTH", "PAGE_SIZE", "layout_of",
           "supports", "unsupported_reason"]


def layout_of(config: KVQuantConfig) -> str | None:
    """The page layout that stores `config`'s cache, or None when no kernel layout does."""
    return _layout_and_reason(config)[0]


def unsupported_reason(
    config: KVQuantConfig, kv_lora_rank: int | None = None, rope_dim: int | None = None
) -> str | None:
    """Why the kernels cannot run `config` (at these widths, if given); None when they can."""
    layout, reason = _layout_and_reason(config)
    if layout is None:
        return reason
    if config.query not in ("bf16", "fp8_e4m3"):
        return f"query={config.query!r} is not implemented (bf16, fp8_e4m3)"
    if config.pv not in ("bf16", "fp8_scale_fused"):
        return f"pv={config.pv!r} is not implemented by the kernels (bf16, fp8_scale_fused)"
    if layout == "bf16" and (config.query != "bf16" or config.pv != "bf16"):
        return "the bf16 cache layout takes query='bf16' and pv='bf16' only"
    if config.pv_block != PAGE_SIZE:
        return f"pv_block={config.pv_block} must equal the page size {PAGE_SIZE} (P is quantized per page)"
    for name, width in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        if width is not None and not _pow2_at_least(width, MIN_WIDTH):
            return f"{name}={width} must be a power of two >= {MIN_WIDTH}"
    if layout == "ds_v32" and kv_lora_rank is not None:
        if kv_lora_rank % config.block_size:
            return f"block_size={config.block_size} does not divide kv_lora_rank={kv_lora_rank}"
        if not _pow2_at_least(config.block_size, MIN_WIDTH):
            return f"block_size={config.block_size} must be a power of two >= {MIN_WIDTH}"
    return None


def supports(config: KVQuantConfig, kv_lora_rank: int | None = None, rope_dim: int | None = None) -> bool:
    """True when the Triton kernels implement `config` (and these widths, if given)."""
    return unsupported_reason(config, kv_lora_rank, rope_dim) is None


def _layout_and_reason(config: KVQuantConfig) -> tuple[str | None, str | None]:
    if not isinstance(config, KVQuantConfig):
        return None, f"expected a KVQuantConfig, got {type(config).__name__}"
    nope, rope = config.nope_dtype, config.rope_dtype
    if nope == "bf16" and rope == "bf16" and not config.rope_prescale:
        return "bf16", None
    if nope != "fp8_e4m3":
        return None, f"nope_dtype={nope!r} has no kernel layout (fp8_e4m3, or bf16 for the baseline)"
    if rope != "bf16":
        return None, f"rope_dtype={rope!r} has no kernel layout (the kernels keep RoPE in bf16)"
    if config.scale_format not in ("fp32", "pow2"):
        return None, f"scale_format={config.scale_format!r} has no kernel layout (fp32, pow2)"
    if config.nope_granularity == "per_token" and config.rope_prescale:
        return "snapmla", None
    if config.nope_granularity == "per_token_block" and not config.rope_prescale:
        return "ds_v32", None
    return None, (
        f"nope_granularity={config.nope_granularity!r} with rope_prescale={config.rope_prescale} has no kernel "
        "layout (per_token with rope_prescale=true, or per_token_block with rope_prescale=false)"
    )


def _pow2_at_least(n: object, lo: int) -> bool:
    return isinstance(n, int) and n >= lo and n & (n - 1) == 0
