"""Triton decode and append kernels: run compiled on any CUDA GPU and interpreted on CPU.

    common.py   exact number-format conversions, reductions and the dtype-switched dot (interpreter-safe)
    decode.py   split-KV decode, stage 1 (tiles rows / tokens / pairs; uniform and balanced schedules)
    combine.py  the LSE combine of the split partials
    append.py   the fused quantize-and-append
"""
