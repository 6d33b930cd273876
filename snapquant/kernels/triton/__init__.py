"""Triton decode and append kernels: run compiled on any CUDA GPU and interpreted on CPU.

    common.py   exact number-format conversions, reductions and the dtype-switched dot (interpreter-safe)
    decode.py   split-KV decode, stage 1 (tiles rows / tokens / pairs; uniform and balanced schedules)
    combine.py  the LSE combine of the split partials
    append.py   the fused quantize-and-append
    expert_groups.py   MoE: a decode step's routed pairs grouped by expert (one launch)
    expert_gate.py     MoE: silu(gate) * up in one pass, torch's bits
    expert_combine.py  MoE: each token's k expert outputs weighted and summed in one pass, torch's bits
"""
