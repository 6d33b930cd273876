"""A fast, deterministic cell evaluator for sweep tests (also importable by subprocesses and submitit jobs).

It mimics what the lm-eval evaluator returns: per task a score with stderr and per-sample 0/1
outcomes. The baseline (an identity config) gets fixed outcomes per task; any other config flips a
share of them that grows as the cache gets smaller, so paired tests have something to find.
Environment: SQ_FAKE_DELAY (seconds per cell), SQ_FAKE_LOG (append 'start/end <cell_id>' lines).
"""

from __future__ import annotations

import hashlib
import math
import os
import time

import numpy as np

KNOWN = ("fake_a", "fake_b", "fake_c")
N_DEFAULT = 60


def _seed(*parts: str) -> int:
    return int(hashlib.sha256("|".join(parts).encode()).hexdigest()[:8], 16)


def outcomes(task: str, n: int, cfg) -> np.ndarray:
    base = (np.random.default_rng(_seed(task)).random(n) < 0.7).astype(float)
    if cfg.is_identity:
        return base
    from snapquant import bytes_per_token

    flip_share = 0.35 * (1 - bytes_per_token(cfg) / 1152)  # smaller cache, more changed answers
    rng = np.random.default_rng(_seed(task, cfg.to_json()))
    flip = rng.random(n) < flip_share
    wrong = rng.random(n) < 0.8  # flips mostly turn right answers wrong
    out = base.copy()
    out[flip & (base == 1) & wrong] = 0
    out[flip & (base == 0) & ~wrong] = 1
    return out


class FakeEvaluator:
    def __init__(self) -> None:
        self.delay = float(os.environ.get("SQ_FAKE_DELAY", "0"))
        self.log = os.environ.get("SQ_FAKE_LOG")
        self.setups = 0
        self.evaluated: list[str] = []

    def _log(self, what: str) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{what} {os.getpid()}\n")
                f.flush()
                os.fsync(f.fileno())

    def check_tasks(self, names, allow_code_execution, include_path):
        return [f"tasks: {n!r} is not a known task; valid: {', '.join(KNOWN)}" for n in names if n not in KNOWN]

    def validate(self, spec, cells):
        return self.check_tasks([t.name for t in spec.tasks], spec.allow_code_execution, [])

    def setup(self, spec):
        self.setups += 1
        self._log("setup -")
        return {"class": "Fake", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_mla_layers": 4}

    def evaluate(self, cell, spec, progress):
        self._log(f"start {cell.cell_id}")
        self.evaluated.append(cell.cell_id)
        tasks, samples = {}, {}
        for t in spec.tasks:
            n = int(t.limit) if isinstance(t.limit, int) else N_DEFAULT
            progress.phase(t.name, n)
            o = outcomes(t.name, n, cell.config)
            if self.delay:
                time.sleep(self.delay / len(spec.tasks))
            progress.advance(n)
            p = float(o.mean())
            tasks[t.name] = {"metrics": {"acc": {"value": p, "stderr": math.sqrt(p * (1 - p) / (n - 1)),
                                                 "higher_is_better": True, "aggregation": "mean"}},
                             "primary_metric": "acc", "n_samples": n}
            samples[t.name] = [{"doc_id": i, "doc_hash": f"h{i}", "metrics": {"acc": float(v)}} for i, v in enumerate(o)]
        self._log(f"end {cell.cell_id}")
        return {"tasks": tasks, "samples": samples, "lm_eval": {}, "fidelity": None, "timing": {"fake": self.delay}}
