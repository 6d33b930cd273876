"""Difficulty calibration of the offline tasks: accuracy per knob setting, with its interval and n.

A setting is a task name plus the task metadata knobs it is built with (the same names a sweep's
per-task `metadata:` takes, see `snapquant/eval/tasks/README.md`; a pass-key setting's
`max_seq_lengths` is one length, its documents the first n of the task's shuffled lengths x depths). Each setting's documents are
scored with the direct harness (plain transformers): greedy decoding for the generation tasks,
what lm-eval's generate_until does; for the multiple-choice task (`MULTIPLE_CHOICE`) the summed
log-probability of each choice's tokens given the context, argmax (lm-eval's multiple_choice
`acc`), read through the cache one decode step at a time by default (`loglikelihood="decode"`,
`direct.decode_loglikelihoods`: with a `prefill: bf16` preset the one way its quantized cache can
change an answer) or by lm-eval's single forward pass (`"forward"`; the same numbers up to float
rounding on the unpatched model, the unpatched model's numbers under any `prefill: bf16` preset).
Optionally also with a quantized cache on the SAME documents, which gives
the discordance rate from which the exact McNemar test's minimum detectable effect and the n
needed to detect a given drop follow (`snapquant.analysis.significance.mde_paired_binary`).
`scripts/calibrate_tasks.py` is the command line; it writes `results/tasks/calibration.{md,csv}`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .tasks import direct, sq_utils

# The experiments' generation budget for code completion (configs/presets_all.yaml): long enough
# for every target line, which is at most 100 characters.
COMPLETION_GEN_TOKENS = 48
CONFIDENCE = 0.95
CSV_COLUMNS = ["task", "knobs", "n", "correct", "accuracy", "ci_low", "ci_high", "interval", "seconds",
               "compare", "compare_accuracy", "discordant", "discordance", "mde", "n_for_target"]


@dataclass(frozen=True)
class Setting:
    """One task built with one set of difficulty knobs (task metadata names -> values)."""

    task: str
    knobs: Mapping[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        """Every knob of the task with its value, defaults filled in (so a row survives a changed default)."""
        knobs = dict(self.knobs)
        family = "sq_kv_retrieval" if kv_task_length(self.task) else self.task
        defaults = {"sq_kv_retrieval": {"kv_digits": sq_utils.KV_DIGITS, "kv_distractors": sq_utils.KV_DISTRACTORS},
                    "sq_code_completion": {"completion_prefix": sq_utils.COMPLETION_PREFIX,
                                           "completion_words": sq_utils.COMPLETION_WORDS,
                                           "completion_copyable": sq_utils.COMPLETION_COPYABLE},
                    "sq_code_completion_mc": sq_utils.MC_DEFAULTS,
                    **{task: PASSKEY_DEFAULTS for task in PASSKEY_TASKS}}.get(family, {})
        return ",".join(f"{k}={v}" for k, v in sorted({**defaults, **knobs}.items()))


def parse_setting(text: str) -> Setting:
    """'TASK' or 'TASK:key=value,key=value' (values: true/false, int, float, else kept as text)."""
    task, _, rest = text.partition(":")
    knobs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"setting {text!r}: {item!r} is not key=value")
        knobs[key.strip()] = _number(value.strip())
    return Setting(task.strip(), knobs)


def _number(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


# Pass-key tasks and their haystacks; `max_seq_lengths` takes one length here (default: the YAML's lengths).
PASSKEY_TASKS = {"sq_passkey": "repeat", "sq_passkey_code": "code"}
PASSKEY_DEFAULTS = {"passkey_digits": sq_utils.PASSKEY_DIGITS, "passkey_distractors": sq_utils.PASSKEY_DISTRACTORS,
                    "max_seq_lengths": "+".join(map(str, sq_utils.DEFAULT_LENGTHS))}
KNOBS = {"sq_code_completion": {"completion_prefix", "completion_words", "completion_copyable"},
         "sq_code_completion_mc": set(sq_utils.MC_DEFAULTS),
         "sq_kv_retrieval": {"kv_digits", "kv_distractors"},
         **{task: set(PASSKEY_DEFAULTS) for task in PASSKEY_TASKS}}
# Tasks scored by loglikelihood (lm-eval output_type multiple_choice): documents carry `choices` and `gold`.
MULTIPLE_CHOICE = frozenset({"sq_code_completion_mc"})


def kv_task_length(task: str) -> int | None:
    """Context length of a per-length kv-retrieval task (sq_kv_retrieval_<N>k -> N * 1024), else None."""
    prefix = "sq_kv_retrieval_"
    if task.startswith(prefix) and task[len(prefix):-1].isdigit() and task.endswith("k"):
        return int(task[len(prefix):-1]) * 1024
    return None


def build(setting: Setting, n: int, seed: int = sq_utils.DEFAULT_SEED,
          tokenizer_path: str | None = None) -> tuple[list[str], list[dict], Callable[[dict, str], float], int,
                                                      list[str]]:
    """(prompts, docs, scorer, max_new_tokens, stop strings) of a setting's first n docs; the scorer
    takes (doc, generation), or for a MULTIPLE_CHOICE task (doc, one loglikelihood per choice), which
    needs no generation budget (0) and no stops."""
    length = kv_task_length(setting.task)
    family = "sq_kv_retrieval" if length else setting.task
    if family not in KNOBS:
        raise ConfigError(f"setting task={setting.task!r} is not calibrated here; allowed: sq_code_completion, "
                          "sq_code_completion_mc, sq_kv_retrieval_<N>k, sq_passkey, sq_passkey_code")
    unknown = set(setting.knobs) - KNOBS[family]
    if unknown:
        raise ConfigError(f"setting {setting.task}: unknown knob(s) {sorted(unknown)}; allowed: "
                          f"{sorted(KNOBS[family])}")
    if length:
        docs = sq_utils.kv_rows(length, seed, n, tokenizer_path, **sq_utils.kv_knobs(dict(setting.knobs)))
        return ([d["prompt"] for d in docs], docs,
                lambda d, g: sq_utils.process_exact_match(d, [g])["exact_match"], sq_utils.ANSWER_RESERVE,
                ['"', "\n"])
    if family in PASSKEY_TASKS:
        knobs = dict(setting.knobs)
        lengths = sq_utils.task_lengths(knobs)
        per_cell = -(-n // (len(lengths) * len(sq_utils.PASSKEY_DEPTHS)))  # the first n of the shuffled docs
        docs = sq_utils.passkey_rows(lengths, seed, per_cell, tokenizer_path, PASSKEY_TASKS[family],
                                     **sq_utils.passkey_knobs(knobs))[:n]
        return ([d["prompt"] for d in docs], docs, lambda d, g: sq_utils.process_passkey(d, [g])["exact_match"],
                sq_utils.ANSWER_RESERVE, ["\n", "."])
    if family in MULTIPLE_CHOICE:
        docs = sq_utils.completion_mc_rows(seed, n, **sq_utils.completion_mc_knobs(dict(setting.knobs)))
        return ([d["context"] for d in docs], docs, lambda d, lls: float(direct.mc_pick(lls) == d["gold"]), 0, [])
    docs = sq_utils.completion_rows(seed, n, **sq_utils.completion_knobs(dict(setting.knobs)))
    return ([d["context"] for d in docs], docs,
            lambda d, g: sq_utils.process_code_completion(d, [g])["exact_match"], COMPLETION_GEN_TOKENS, ["\n"])


def score(model, tokenizer, setting: Setting, n: int, *, seed: int = sq_utils.DEFAULT_SEED,
          tokenizer_path: str | None = None, batch_size: int = 8, max_new_tokens: int | None = None,
          loglikelihood: str = "decode") -> list[float]:
    """Per-document 0/1 scores of the setting's first n documents (greedy, as the lm-eval task; a
    multiple-choice task by loglikelihood argmax, `direct.choice_loglikelihoods` through `loglikelihood`:
    "decode" (each context prefilled once, its choices teacher-forced through the cache in batches of
    `batch_size`) or "forward" (lm-eval's pass: batches of `batch_size` on a patched model, one context
    at a time with its choices batched otherwise)); `max_new_tokens` caps the task's generation budget
    (quick checks; answers may be cut)."""
    direct.check_loglikelihood_path("loglikelihood", loglikelihood)
    prompts, docs, scorer, max_new, stops = build(setting, n, seed, tokenizer_path)
    if setting.task in MULTIPLE_CHOICE:
        lls = direct.choice_loglikelihoods(model, tokenizer, prompts, [d["choices"] for d in docs], batch_size,
                                           through=loglikelihood)
        return [scorer(d, ll) for d, ll in zip(docs, lls, strict=True)]
    max_new = min(max_new, max_new_tokens) if max_new_tokens else max_new
    gens = direct.greedy_generate(model, tokenizer, prompts, max_new, stops, batch_size)
    return [scorer(d, g) for d, g in zip(docs, gens, strict=True)]


def proportion_interval(correct: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion (`analysis.significance.proportion_interval`)."""
    from ..analysis.significance import proportion_interval as exact

    return exact(correct, n, confidence)


def n_for_mde(discordance: float, target: float, *, alpha: float = 0.05, n_max: int = 100_000) -> int | None:
    """Smallest paired n whose exact McNemar MDE (at `discordance`) is <= `target`; None beyond n_max.

    The MDE falls with n except for small wiggles of the exact test's discrete critical values, so
    the bisection finds the first n below target up to such a wiggle (a handful of samples).
    """
    from ..analysis.significance import mde_paired_binary

    hi = 8
    while not mde_paired_binary(hi, discordance, alpha=alpha) <= target:  # doubling: cost ~ the answer
        if hi >= n_max:
            return None
        hi = min(2 * hi, n_max)
    lo = hi // 2 + 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mde_paired_binary(mid, discordance, alpha=alpha) <= target else (mid + 1, hi)
    return lo


def calibrate(model, tokenizer, settings: Sequence[Setting], n: int, *, compare: str | None = None,
              target_effect: float = 0.05, seed: int = sq_utils.DEFAULT_SEED, tokenizer_path: str | None = None,
              batch_size: int = 8, max_new_tokens: int | None = None, loglikelihood: str = "decode",
              log: Callable[[str], None] = print) -> list[dict]:
    """One row per setting: accuracy of the unpatched model with its exact 95% interval and n; with
    `compare` (a preset name) also that preset's accuracy on the same documents, the discordance,
    the MDE at this n and the n at which the MDE reaches `target_effect`. `loglikelihood` ("decode" or
    "forward", see `score`) is how a multiple-choice task is read, by both models alike."""
    from ..analysis.significance import mde_paired_binary

    if n < 1:
        raise ConfigError(f"n={n!r} must be >= 1")
    direct.check_loglikelihood_path("loglikelihood", loglikelihood)
    rows = []
    for s in settings:
        build(s, 1, seed, tokenizer_path)  # bad task or knob: fail before any model time is spent
    for s in settings:
        t0 = time.perf_counter()
        base = score(model, tokenizer, s, n, seed=seed, tokenizer_path=tokenizer_path, batch_size=batch_size,
                     max_new_tokens=max_new_tokens, loglikelihood=loglikelihood)
        k = int(sum(base))
        low, high = proportion_interval(k, len(base))
        row: dict[str, Any] = {"task": s.task, "knobs": s.label(), "n": len(base), "correct": k,
                               "accuracy": k / len(base), "ci_low": low, "ci_high": high,
                               "interval": "clopper_pearson_95", "compare": compare or "",
                               "compare_accuracy": math.nan, "discordant": math.nan, "discordance": math.nan,
                               "mde": math.nan, "n_for_target": math.nan}
        if compare:
            from ..patching import patched

            with patched(model, compare, backend="reference"):
                other = score(model, tokenizer, s, n, seed=seed, tokenizer_path=tokenizer_path,
                              batch_size=batch_size, max_new_tokens=max_new_tokens, loglikelihood=loglikelihood)
            disc = sum(a != b for a, b in zip(base, other, strict=True))
            row.update(compare_accuracy=sum(other) / len(other), discordant=disc, discordance=disc / len(base),
                       mde=mde_paired_binary(len(base), disc / len(base)))
            needed = n_for_mde(disc / len(base), target_effect)
            row["n_for_target"] = math.nan if needed is None else needed
        row["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"{s.task} {s.label()}: {k}/{len(base)} = {k / len(base):.3f} [{low:.3f}, {high:.3f}]"
            + (f"; {compare} {row['compare_accuracy']:.3f}, discordance {row['discordance']:.3f}" if compare else "")
            + f" ({row['seconds']:.0f} s)")
        rows.append(row)
    return rows


def to_markdown(rows: Sequence[dict], meta: Mapping[str, Any], target_effect: float = 0.05) -> str:
    """The calibration table with how it was made (model, seed, n, hardware, commit, wall time)."""
    head = ["task", "knobs", "n", "accuracy", "95% CI (Clopper-Pearson)", "seconds"]
    compare = any(r.get("compare") for r in rows)
    if compare:
        head += ["compare", "its accuracy", "discordance", "MDE at n", f"n for MDE {target_effect:g}"]
    out = ["# Offline task calibration", "",
           "Accuracy of the unpatched model (greedy, exact match; a multiple-choice task: argmax of the "
           "choices' summed log-probabilities, lm-eval's acc) per difficulty setting; the interval is "
           "exact (Clopper-Pearson, 95%)."]
    if compare:
        out.append("With a compared preset: its accuracy on the same documents, the share of documents on "
                   "which the two disagree (discordance), the exact McNemar minimum detectable effect at "
                   f"this n (alpha 0.05, power 0.8) and the paired n at which it reaches {target_effect:g}.")
    out += ["", *(f"- {k}: {v}" for k, v in meta.items()), "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["task"], f"`{r['knobs']}`", str(r["n"]), f"{r['accuracy']:.3f}",
                 f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]", f"{r['seconds']:.0f}"]
        if compare:
            need = r["n_for_target"]
            cells += [r["compare"] or "-", _fmt(r["compare_accuracy"]), _fmt(r["discordance"]), _fmt(r["mde"]),
                      "-" if not isinstance(need, int | float) or math.isnan(need) else str(int(need))]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _fmt(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"
