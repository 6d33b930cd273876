#!/usr/bin/env python
"""End-to-end decode step time: stock transformers vs snapquant-patched (bf16 and snapmla presets), eager
and as a CUDA graph, with the largest context that fits a memory budget.

    python scripts/bench_e2e.py --threads 1                 # CPU: 2 layers, batch 1, L = 1K, 4K, 16K
    python scripts/bench_e2e.py --device cuda --layers 8 --batch 32 --contexts 8192,32768 \\
        --backend triton --graphs --out results/bench/e2e_h200.json      # the H200 run in results/
    python scripts/bench_e2e.py --help                      # every option

The implementation is snapquant.bench.e2e (the model, what is timed and what each row records).
"""

import sys

from snapquant.bench.e2e import main

if __name__ == "__main__":
    sys.exit(main())
