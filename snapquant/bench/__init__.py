"""Decode-kernel benchmarking: FLOP/byte accounting, variants, timers, the harness, results.

    accounting     FLOPs and bytes of a decode step or an append, per format; roofline times
    shapes         the benchmark's (B, H, L) shapes and the mixed-length batch
    variants       every timed variant (our BF16 kernel, each FP8 query/PV mode and kernel knob,
                   plain PyTorch) and how they are selected
    timing         CUDA-graph / do_bench / event timers over L2-rotated input sets (and a wall timer)
    harness        builds inputs, runs the variants within a time budget, one row per measurement
    e2e            the end-to-end decode step of a whole model, stock vs patched, eager and CUDA graph
                   (scripts/bench_e2e.py)
    results        CSV / markdown / JSON writing (atomic) and the performance targets
    plot           the side-by-side figure (PNG + PDF)
    ncu            Nsight Compute CSV exports -> one summary row per kernel (scripts/profile_decode.py)
    compile_stats  compiles the kernels for a GPU target on any machine: registers, spills, shared
                   memory, pipelined loads, MMA kind, the SASS mix of the page loop

Run it as `python scripts/bench_decode.py` or `snapquant bench` (same options).
"""
