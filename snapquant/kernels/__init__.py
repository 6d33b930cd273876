"""Triton kernels for MLA decode over a paged latent cache (FP8 SnapMLA, DeepSeek-V3.2, BF16 baseline).

    PagedMLACache      the cache in the kernels' page layout (pages of 64 tokens), with conversions
                       to and from the contiguous `QuantizedKV` the reference decode reads
    quantize_append    fused quantize-and-append of new tokens (bit-exact to `quantize_kv`)
    mla_decode         split-KV absorbed MLA decode with an LSE combine -> (out, lse); knobs for
                       the work schedule (uniform / balanced) and the FP8 variants (kernels and
                       their numerics: decode_kernels.py; on Hopper the Gluon kernels
                       gluon_regs.py (<= 16 query rows: register MMA operands read through
                       box_views.py; gluon_decode.py at other widths), gluon_wide.py (64-row
                       tiles) and the native FP8 MMA kernels (opt-in) gluon_narrow8.py (32-row
                       tiles, two per SM) and gluon_wide8.py (64-row); host side: mla_decode.py)
    mla_decode_plan    the same checks and launches as a replayable plan (benchmarks, CUDA graphs)
    supports(config)   whether the kernels implement a config
    triton_backend     the decode backend `snapquant.attention.backends` calls `triton`; importing
                       this package registers it (zero-copy over the patch's store)

CUDA tensors run compiled kernels; CPU tensors run the same kernels in the Triton interpreter
(slow; for tests at small shapes).
"""

from .backend import register as _register
from .backend import triton_backend
from .layouts import LAYOUTS, PAGE_SIZE, layout_of, supports, unsupported_reason
from .mla_decode import DecodePlan, mla_decode, mla_decode_plan
from .paged import PagedMLACache
from .quantize_append import quantize_append

_register()

__all__ = [
    "LAYOUTS", "PAGE_SIZE", "DecodePlan", "PagedMLACache", "layout_of", "mla_decode", "mla_decode_plan",
    "quantize_append", "supports",
    "triton_backend", "unsupported_reason",
]
