"""Opt-in Gluon kernels: SnapMLA's native FP8 MMA design past 16 query rows (`fp8_mma=True`).

    native8.py   what both share: the page slots, V^T from a slot into registers, the fewest-instruction
                 softmax and P^, the transposing epilogue
    narrow8.py   32 query rows per program, one warpgroup, two programs per SM (block_m 32, the default
                 of fp8_mma=True)
    wide8.py     64 query rows per program, two warpgroups, one program per SM (block_m 64)
    stream.py    not a decode kernel: the snapmla page ring with no arithmetic, the instrument of
                 scripts/probe_stream.py (how fast a ring structure streams the cache)

Both accumulate inside Hopper's FP8 MMA (~14 bits per chain), so they are not the reference's exact
arithmetic; `snapquant.kernels.dispatch` runs them only when asked for (docs/kernels.md).
"""
