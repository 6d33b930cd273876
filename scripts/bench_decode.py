#!/usr/bin/env python
"""MLA decode benchmark: our FP8 decode in every query/PV mode and kernel variant, our BF16 kernel and
plain PyTorch, side by side on the target shapes, plus quantize-and-append.

    python scripts/bench_decode.py --out results/bench          # full run on the H200 (~6-7 min)
    python scripts/bench_decode.py --quick --out results/bench  # smoke run (~2-3 min)
    python scripts/bench_decode.py --help                       # every option

The same command as `snapquant bench`; the implementation is snapquant.bench (see snapquant/bench/runner.py).
"""

import typer

from snapquant.commands.bench import bench

if __name__ == "__main__":
    typer.run(bench)
