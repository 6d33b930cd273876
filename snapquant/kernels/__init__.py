"""Triton and Gluon kernels for MLA decode over a paged latent cache (FP8 SnapMLA, DeepSeek-V3.2, BF16).

    PagedMLACache      the cache in the kernels' page layout (pages of 64 tokens), with conversions
                       to and from the contiguous `QuantizedKV` the reference decode reads
    quantize_append    fused quantize-and-append of new tokens (bit-exact to `quantize_kv`)
    mla_decode         split-KV absorbed MLA decode with an LSE combine -> (out, lse)
    mla_decode_plan    the same checks and launches as a replayable plan (benchmarks, CUDA graphs)
    DecodeOptions      the decode's knobs (kernel family, schedule, splits, native FP8 MMA, ...), validated
    choose_kernel      which kernel runs for a format, query rows, GPU and options (`dispatch.KERNELS`)
    supports(config)   whether the kernels implement a config
    triton_backend     the decode backend `snapquant.attention.backends` registers as `triton`
                       (zero-copy over the patch's store)

Where things live (docs/kernels.md has the dispatch table and each kernel's status):

    layouts.py, paged.py, operands.py   formats -> page layouts, the paged cache, the kernels' view of it
    options.py, dispatch.py, decode.py  the knobs, the kernel choice, the launch plans
    backend.py                          the patch seam's backend
    triton/                             Triton kernels (any CUDA GPU; the interpreter on CPU)
    gluon/                              Gluon kernels (Hopper); gluon/experimental/ the opt-in ones

CUDA tensors run compiled kernels; CPU tensors run the Triton kernels in the Triton interpreter
(slow; for tests at small shapes). The Gluon kernels have no interpreter.
"""

from .backend import triton_backend
from .decode import DecodePlan, mla_decode, mla_decode_plan
from .dispatch import KERNELS, choose_kernel
from .layouts import LAYOUTS, PAGE_SIZE, layout_of, supports, unsupported_reason
from .options import DecodeOptions
from .paged import PagedMLACache, quantize_append

__all__ = [
    "KERNELS", "LAYOUTS", "PAGE_SIZE", "DecodeOptions", "DecodePlan", "PagedMLACache", "choose_kernel", "layout_of",
    "mla_decode", "mla_decode_plan", "quantize_append", "supports", "triton_backend", "unsupported_reason",
]
