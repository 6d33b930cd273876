"""A fast, deterministic cell evaluator for sweep tests (also importable by subprocesses and submitit jobs).

It mimics what the lm-eval evaluator returns: per task a score with stderr and per-sample 0/1
outcomes. The baseline (an identity config) gets fixed outcomes per task; any other config flips a
share of them that grows as the cache gets smaller, so paired tests have something to find.
With `FakeEvaluator(fidelity=True)` and the sweep's fidelity on, each cell also gets fidelity
results built from synthetic per-position KL (`fake_fidelity`) through the real statistics, with
one planted large-KL position per quantized cell, and its arrays file.
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
PLANTED = (1, 3, 2.0)
"""(sequence, mode position, KL) of the planted large-KL position of every quantized cell."""


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


class LetterTokenizer:
    """Token id i is the character chr(i): the fake fidelity text is lowercase letters and spaces."""

    def decode(self, ids, **_) -> str:
        return "".join(chr(int(i)) for i in ids)


def fake_tokens(n: int, t: int) -> np.ndarray:
    rng = np.random.default_rng(_seed("tokens"))
    return np.where(rng.random((n, t)) < 0.2, 32, rng.integers(97, 123, (n, t)))


def fake_fidelity(cfg, spec) -> tuple[dict, dict]:
    """(the cell's fidelity JSON part, its arrays) from synthetic KL: larger for smaller caches, 0 unquantized."""
    from snapquant import bytes_per_token
    from snapquant.eval.fidelity import summarize_positions
    from snapquant.sweep.evaluate import fidelity_arrays

    f = spec.fidelity
    ids = fake_tokens(f.num_sequences, f.seq_len)
    out = {"num_sequences": f.num_sequences, "seq_len": f.seq_len, "causal_consistent": cfg.causal_consistent,
           "tokens_sha256": "fake" + str(_seed("tokens"))}
    scale = 0.0 if cfg.is_identity else 1e-3 * 1152 / bytes_per_token(cfg)
    for mode in f.modes:
        first = 0 if mode == "prefill" else f.prompt_len
        rng = np.random.default_rng(_seed(mode, cfg.to_json()))
        ref_top1 = ids[:, first + 1:]
        kl = scale * rng.lognormal(0, 0.5, (ids.shape[0], 1)) * rng.exponential(1, ref_top1.shape)
        if not cfg.is_identity:
            kl[PLANTED[0], PLANTED[1]] = PLANTED[2]
        quant_top1 = np.where(kl > 0.02, (ref_top1 - 96) % 26 + 97, ref_top1)
        nll_ref = rng.uniform(0.5, 3.0, kl.shape)
        met = {"kl": kl, "flip": (quant_top1 != ref_top1).astype(float), "nll_ref": nll_ref,
               "nll_quant": nll_ref + kl, "ref_top1": ref_top1, "quant_top1": quant_top1}
        out[mode] = summarize_positions(met, first, keep_positions=True, n_resamples=200, seed=spec.seed)
        if mode == "decode":
            out[mode]["prompt_len"] = first
    return fidelity_arrays(out, ids)


class FakeEvaluator:
    def __init__(self, fidelity: bool = False) -> None:
        self.fidelity = fidelity
        self.tokenizer = LetterTokenizer() if fidelity else None
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
        fid, arrays = fake_fidelity(cell.config, spec) if self.fidelity and spec.fidelity.enabled else (None, None)
        return {"tasks": tasks, "samples": samples, "lm_eval": {}, "fidelity": fid, "timing": {"fake": self.delay},
                **({"arrays": arrays} if arrays else {})}
