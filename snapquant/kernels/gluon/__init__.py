"""Gluon decode kernels (Triton's explicit-layout dialect): Hopper (sm_90) only, no interpreter.

    common.py       host TMA descriptors and the kernels' shared Gluon helpers (ring, query, softmax, P)
    box_views.py    register-operand views of a TMA page box (pure Python, tested on any machine)
    narrow.py       <= 16 query rows, register MMA operands: the default at kv_lora_rank 512
    narrow_tile.py  <= 16 query rows over an fp16 tile: the default at other widths (and fp8_mma="qk")
    narrow_bf16.py  <= 16 query rows of the bf16 layout, MMAs reading the TMA slot (opt-in: tile="gluon")
    wide.py         64-row tiles past 16 query rows, fp8 (snapmla) and bf16 layouts: the default there
    experimental/   opt-in native FP8 MMA kernels (fp8_mma=True)

Which one runs for which format, rows, GPU and options: `snapquant.kernels.dispatch` (docs/kernels.md).
"""

from .common import HAVE_GLUON

__all__ = ["HAVE_GLUON"]
