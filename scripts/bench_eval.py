#!/usr/bin/env python
"""lm-eval generation throughput: HF generate vs snapquant's decode loop (CUDA graph steps, grouped experts),
on random-weight DeepSeek-V2-Lite and DeepSeek-V3 shapes, with the loop checked against HF first.

    python scripts/bench_eval.py --smoke --out /tmp/eval_smoke            # CPU plumbing, tiny model, seconds
    python scripts/bench_eval.py --models v2lite --presets bf16,snapmla   # on an H200: one call < 8 minutes
    python scripts/bench_eval.py --models v3 --contexts 1024,8192          # further calls merge into the table
    python scripts/bench_eval.py --models v2lite --e2e-lmeval --paths ''   # end to end through lm-eval's generate_until
    python scripts/bench_eval.py --help                                   # every option

Writes results/bench/eval_h200.{csv,md,json}. The implementation is snapquant.bench.eval_gen.
"""

import sys

from snapquant.bench.eval_gen import main

if __name__ == "__main__":
    sys.exit(main())
