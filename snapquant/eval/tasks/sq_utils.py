"""Document builders and scorers for snapquant's offline lm-eval tasks.

lm-eval imports this file by path (`!function sq_utils.NAME` in the YAMLs), so imports are
absolute. Every `custom_dataset` function receives the task's metadata (the YAML `metadata` merged
with `TaskManager(metadata=...)`, which overrides it) plus the YAML `dataset_kwargs`:

- `tokenizer`: path or name of the tokenizer that measures context lengths (default: the embedded
  model's tokenizer, so lengths are exact for it and approximate for others);
- `num_samples`: documents per length; `sq_seed`: seed of the generated instances;
- `max_seq_lengths`: lengths in tokens (pass-key and RULER tasks); per-length tasks fix theirs in
  `dataset_kwargs.context_tokens`;
- difficulty knobs (README "Difficulty knobs"): `kv_digits`, `kv_distractors` (retrieval),
  `completion_prefix`, `completion_words`, `completion_copyable` (code completion; the multiple-choice
  variant takes prefix and copyable with its own defaults, plus `mc_choices`, `mc_distractors`),
  `passkey_digits`, `passkey_distractors` (pass key).
Documents are a pure function of (tokenizer, seed, length, index): the same call gives the same docs.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from pathlib import Path
from typing import Any

from snapquant.data.corpus import load_heldout
from snapquant.data.synthetic import kv_retrieval_example, passkey_example, seed_rng
from snapquant.data.tokenizer import encode_text
from snapquant.errors import ConfigError

DEFAULT_SEED = 1234
DEFAULT_LENGTHS = (1024, 2048, 4096)
# Tokens kept free for the answer: lm-eval left-truncates prompts to max_length - max_gen_toks, so
# prompts are built to fit `length - ANSWER_RESERVE` and the YAMLs set max_gen_toks to it.
ANSWER_RESERVE = 16
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
# Difficulty defaults (README "Difficulty knobs"; results/tasks/calibration.md measures them).
COMPLETION_PREFIX = 0.75
COMPLETION_WORDS = 0
COMPLETION_COPYABLE = True
KV_DIGITS = 9
KV_DISTRACTORS = 16
# The documents the embedded model's training probes and quality bar were defined on (the old
# defaults: values of the trained lengths, no near misses), for the trainers.
KV_TRAINING_FORMAT = {"digits": 7, "distractors": 0}
PASSKEY_DIGITS = 5
PASSKEY_DISTRACTORS = 0
PASSKEY_MAX_DIGITS = 20  # the key must fit the answer budget: 20 random digits are at most 14 tokens
# Metric names the length-keyed YAMLs declare; a length outside them has no metric to land in.
METRIC_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def default_tokenizer_path() -> str:
    from snapquant.embedded import EMBEDDED_PATH

    return str(EMBEDDED_PATH)


@functools.lru_cache(maxsize=8)
def get_tokenizer(name: str | None = None):
    """A transformers tokenizer by path or hub name (offline: local paths or cached names)."""
    from transformers import AutoTokenizer

    path = name or default_tokenizer_path()
    if Path(path).is_dir() and not (Path(path) / "tokenizer.json").exists() and not any(
            Path(path).glob("tokenizer*")):
        raise ConfigError(f"tokenizer={path!r}: folder has no tokenizer files")
    return AutoTokenizer.from_pretrained(path)


def token_counter(tokenizer):
    def count(text: str) -> int:  # documents longer than any one model's context are counted too
        return len(encode_text(tokenizer, text))

    return count


def _tokenizer_name(kwargs: dict[str, Any]) -> str | None:
    # Same precedence as RULER: explicit tokenizer, then the model path lm-eval passes along.
    for key in ("tokenizer", "pretrained"):
        value = kwargs.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _int(kwargs: dict[str, Any], key: str, default: int) -> int:
    value = kwargs.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"task metadata {key}={value!r} must be a positive int")
    return value


def _nonnegative_int(kwargs: dict[str, Any], key: str, default: int) -> int:
    value = kwargs.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"task metadata {key}={value!r} must be an int >= 0")
    return value


def _flag(kwargs: dict[str, Any], key: str, default: bool) -> bool:
    value = kwargs.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"task metadata {key}={value!r} must be true or false")
    return value


def task_lengths(kwargs: dict[str, Any], default=DEFAULT_LENGTHS) -> list[int]:
    """The task's `max_seq_lengths` metadata as a list of supported lengths (one int or a list; errors name it)."""
    lengths = kwargs.get("max_seq_lengths", list(default))
    if isinstance(lengths, int):
        lengths = [lengths]
    bad = [x for x in lengths if x not in METRIC_LENGTHS]
    if bad:
        raise ConfigError(f"task metadata max_seq_lengths={lengths!r}: {bad} not among the lengths the "
                          f"task reports ({', '.join(map(str, METRIC_LENGTHS))})")
    return list(lengths)


def _dataset(rows: list[dict]):
    import datasets

    return {"test": datasets.Dataset.from_list(rows)}


# ------------------------------------------------------------------------------ held-out code

def code_ppl_docs(**kwargs: Any):
    """One document per shipped held-out source file (never trained on), smallest first, so that
    `--limit N` gives a quick estimate; the full set is what the model card reports."""
    rows = sorted(load_heldout(), key=lambda r: (r["bytes"], r["path"]))
    return _dataset([{"path": r["path"], "text": r["text"]} for r in rows])


def _cut_points(line: str) -> list[int]:
    """Where a line may be cut: before each space that ends a word after the indentation.

    BPE vocabularies (the embedded one, GPT-style ones) attach a word's leading space to the word,
    so a prompt ending just before a space ends on a token boundary the model saw in training.
    """
    start = len(line) - len(line.lstrip(" "))
    return [i for i in range(start + 1, len(line)) if line[i] == " " and line[i - 1] != " "]


def completion_rows(seed: int = DEFAULT_SEED, num_samples: int = 200, max_context_chars: int = 4000,
                    prefix: float = COMPLETION_PREFIX, words: int = COMPLETION_WORDS,
                    copyable: bool = COMPLETION_COPYABLE) -> list[dict]:
    """Next-line completion items: the file up to a line (cut at a line start), target = that line.

    Targets are code lines of 8-100 characters that are not comments, blank, or string-only
    (docstring) lines, at least 10 lines into the file. With `prefix` > 0 the context also holds
    the first words of the target line (the share `prefix` of its cut points, `_cut_points`, at least
    one, leaving at least one word); with `words` > 0 the target is the next `words` words only
    (up to the next cut point(s)), else the rest of the line. Either knob skips lines with no cut
    point. `prefix` = 0, `words` = 0, `copyable` = False is the whole next line (the old default). `to_eol` says whether the target
    ends the line (`process_code_completion` scores the two cases). `copyable` keeps only targets
    whose every name and number (`IDENTIFIER`) occurs in the context the model sees: a property of
    the file, not of any model, that makes the target predictable in principle by copying from the
    cache, which is what a quantized KV cache can damage.
    """
    if isinstance(prefix, bool) or not isinstance(prefix, int | float) or not 0.0 <= prefix < 1.0:
        raise ConfigError(f"task metadata completion_prefix={prefix!r} must be a number in [0, 1)")
    if isinstance(words, bool) or not isinstance(words, int) or words < 0:
        raise ConfigError(f"task metadata completion_words={words!r} must be an int >= 0")
    rows = load_heldout()
    rng = seed_rng("eval", "code_completion", seed)
    candidates = []
    for r in rows:
        lines = r["text"].split("\n")
        for i, line in enumerate(lines):
            s = line.strip()
            if i < 10 or not 8 <= len(s) <= 100 or s.startswith(("#", '"', "'")):
                continue
            if (prefix > 0 or words > 0) and not _cut_points(line):
                continue
            candidates.append((r["path"], i))
    if not candidates:
        raise ConfigError("held-out files yield no completion targets")
    by_path = {r["path"]: r["text"].split("\n") for r in rows}
    if not copyable:
        picks = rng.sample(candidates, min(num_samples, len(candidates)))
        return [_completion_row(by_path[path], path, i, max_context_chars, prefix, words) for path, i in picks]
    # The same seeded order as without the filter (for all candidates), filtered until num_samples.
    made = (_completion_row(by_path[path], path, i, max_context_chars, prefix, words)
            for path, i in rng.sample(candidates, len(candidates)))
    return list(itertools.islice(filter(_copyable, made), num_samples))


IDENTIFIER = re.compile(r"[A-Za-z_]\w*|\d+")


def _copyable(row: dict) -> bool:
    seen = set(IDENTIFIER.findall(row["context"]))
    return all(t in seen for t in IDENTIFIER.findall(row["target"]))


def _completion_row(lines: list[str], path: str, i: int, max_context_chars: int, prefix: float,
                    words: int) -> dict:
    context = "\n".join(lines[:i]) + "\n"
    if len(context) > max_context_chars:
        cut = context.find("\n", len(context) - max_context_chars)
        context = context[cut + 1:]
    line, given = lines[i], 0
    points = _cut_points(line)
    if prefix > 0:
        given = points[min(len(points), max(1, round(prefix * (len(points) + 1)))) - 1]
    ends = [p for p in points if p > given]
    end = ends[words - 1] if 0 < words <= len(ends) else len(line)
    return {"path": path, "line": i, "context": context + line[:given], "target": line[given:end],
            "to_eol": end == len(line)}


def completion_knobs(metadata: dict[str, Any]) -> dict[str, Any]:
    """`completion_rows` keyword arguments from task metadata, validated (errors name the key)."""
    prefix = metadata.get("completion_prefix", COMPLETION_PREFIX)
    if isinstance(prefix, bool) or not isinstance(prefix, int | float) or not 0.0 <= prefix < 1.0:
        raise ConfigError(f"task metadata completion_prefix={prefix!r} must be a number in [0, 1)")
    return {"prefix": prefix, "words": _nonnegative_int(metadata, "completion_words", COMPLETION_WORDS),
            "copyable": _flag(metadata, "completion_copyable", COMPLETION_COPYABLE)}


def code_completion_docs(**kwargs: Any):
    seed = _int(kwargs, "sq_seed", DEFAULT_SEED)
    return _dataset(completion_rows(seed, _int(kwargs, "num_samples", 200), **completion_knobs(kwargs)))


def process_code_completion(doc: dict, results: list[str]) -> dict[str, float]:
    # Whitespace at both ends is ignored: indentation at a prompt boundary is a tokenizer artefact.
    pred, target = results[0].split("\n")[0].strip(), doc["target"].strip()
    if doc.get("to_eol", True):
        return {"exact_match": float(pred == target)}
    # A target of the next words only: the line may go on after them, from the next space.
    return {"exact_match": float(pred == target or pred.startswith(target + " "))}


# ------------------------------------------------------------------ code completion, multiple choice

# The multiple-choice variant's difficulty defaults; sq_code_completion_mc.yaml's `metadata` repeats them
# (a test checks they agree). Calibrated in results/tasks/mc (README "Difficulty knobs").
MC_DEFAULTS: dict[str, Any] = {"completion_prefix": 0.0, "completion_copyable": True, "mc_choices": 4,
                               "mc_distractors": "same_file"}
MC_DISTRACTOR_SOURCES = ("same_file", "other_files")
# Distractors are drawn at random among this many pool texts nearest the target in length (per wrong choice).
MC_NEAREST_PER_CHOICE = 4


def completion_mc_knobs(metadata: dict[str, Any]) -> dict[str, Any]:
    """`completion_mc_rows` keyword arguments from task metadata (MC_DEFAULTS where absent), validated;
    an error is one line naming the key."""
    merged = {**MC_DEFAULTS, **{k: v for k, v in metadata.items() if k in MC_DEFAULTS}}
    base = completion_knobs({"completion_words": 0, **merged})
    choices = merged["mc_choices"]
    if not isinstance(choices, int) or isinstance(choices, bool) or not 2 <= choices <= 16:
        raise ConfigError(f"task metadata mc_choices={choices!r} must be an int in [2, 16]")
    source = merged["mc_distractors"]
    if source not in MC_DISTRACTOR_SOURCES:
        raise ConfigError(f"task metadata mc_distractors={source!r} is not valid; allowed values: "
                          f"{', '.join(MC_DISTRACTOR_SOURCES)}")
    return {"prefix": base["prefix"], "copyable": base["copyable"], "choices": choices, "distractors": source}


def _is_code_line(line: str) -> bool:
    s = line.strip()
    return 8 <= len(s) <= 100 and not s.startswith(("#", '"', "'"))


@functools.lru_cache(maxsize=1)
def _distractor_pool() -> dict[str, tuple[str, ...]]:
    """Per held-out file, its code lines (the rules targets follow, at any depth in the file)."""
    return {r["path"]: tuple(ln for ln in r["text"].split("\n") if _is_code_line(ln)) for r in load_heldout()}


def _distractor_text(line: str, target: str, whole_line: bool) -> str | None:
    """What `line` offers as a wrong choice for `target`: with the prompt at the line start, the line
    re-indented like the target (indentation alone would give it away); with the first words given, the
    suffix of `line` from the cut point whose length is nearest the target's (it starts with a space,
    as the target does)."""
    if whole_line:
        return target[:len(target) - len(target.lstrip(" "))] + line.strip()
    points = _cut_points(line)
    if not points:
        return None
    return min((line[p:] for p in points), key=lambda t: (abs(len(t) - len(target)), t))


def _mc_choices(row: dict, seed: int, choices: int, source: str) -> tuple[list[str], int]:
    """The target and `choices - 1` distractors (seeded by seed, file and line), gold position random."""
    target, whole_line = row["target"], row["context"].endswith("\n")
    pool = _distractor_pool()
    if source == "same_file":
        lines = [ln for ln in pool[row["path"]] if ln.strip() != target.strip()]
    else:
        lines = [ln for path, lns in pool.items() if path != row["path"] for ln in lns]
    seen = {target.strip()}
    texts = []
    for ln in lines:
        t = _distractor_text(ln, target, whole_line)
        if t is not None and t.strip() not in seen:
            seen.add(t.strip())
            texts.append(t)
    if len(texts) < choices - 1:
        raise ConfigError(f"{row['path']}: too few distractor lines for mc_choices={choices}")
    texts.sort(key=lambda t: (abs(len(t) - len(target)), t))
    rng = seed_rng("eval", "code_completion_mc", seed, row["path"], row["line"])
    wrong = rng.sample(texts[:MC_NEAREST_PER_CHOICE * (choices - 1)], choices - 1)
    gold = rng.randrange(choices)
    return [*wrong[:gold], target, *wrong[gold:]], gold


def completion_mc_rows(seed: int = DEFAULT_SEED, num_samples: int = 200, max_context_chars: int = 4000,
                       prefix: float = MC_DEFAULTS["completion_prefix"],
                       copyable: bool = MC_DEFAULTS["completion_copyable"], choices: int = MC_DEFAULTS["mc_choices"],
                       distractors: str = MC_DEFAULTS["mc_distractors"]) -> list[dict]:
    """`completion_rows` items (the rest of the line, `prefix`/`copyable` as there) as multiple choice.

    `choices` texts per item: the target and `choices - 1` distractors, code lines of held-out files
    (`distractors`: "same_file", the target's own file, so they share its names and style; or
    "other_files"), never equal to the target (whitespace-trimmed) nor to one another, drawn at random
    among the MC_NEAREST_PER_CHOICE * (choices - 1) candidates nearest the target in length (so length
    alone gives little away), and shaped like the target (`_distractor_text`). `gold` is the target's
    index. Items and choices are a pure function of the arguments.
    """
    rows = completion_rows(seed, num_samples, max_context_chars, prefix=prefix, words=0, copyable=copyable)
    out = []
    for r in rows:
        texts, gold = _mc_choices(r, seed, choices, distractors)
        out.append({**r, "choices": texts, "gold": gold})
    return out


def code_completion_mc_docs(**kwargs: Any):
    seed = _int(kwargs, "sq_seed", DEFAULT_SEED)
    return _dataset(completion_mc_rows(seed, _int(kwargs, "num_samples", 200), **completion_mc_knobs(kwargs)))


# ------------------------------------------------------------------------------ key-value lookup

def kv_rows(length: int, seed: int = DEFAULT_SEED, num_samples: int = 100, tokenizer: str | None = None,
            n_shots: int = 2, digits: int = KV_DIGITS, distractors: int = KV_DISTRACTORS) -> list[dict]:
    """Lookup questions whose prompt + answer fit `length - ANSWER_RESERVE` tokens; depths cycle 0..1.

    `digits` is the value length, `distractors` the number of entries with near-miss keys of the
    asked one (`snapquant.data.synthetic.kv_retrieval_example`).
    """
    count = token_counter(get_tokenizer(tokenizer))
    out = []
    for i in range(num_samples):
        rng = seed_rng("eval", "kv_retrieval", seed, length, i)
        depth = (i % 11) / 10
        ex = kv_retrieval_example(rng, length - ANSWER_RESERVE, count, depth=depth, n_shots=n_shots,
                                  digits=digits, distractors=distractors)
        out.append({"index": i, "length": length, **ex})
    return out


def kv_retrieval_docs(context_tokens: int | None = None, **kwargs: Any):
    if context_tokens is None:
        raise ConfigError("sq_kv_retrieval tasks need dataset_kwargs.context_tokens (the length in tokens)")
    return _dataset(kv_rows(int(context_tokens), _int(kwargs, "sq_seed", DEFAULT_SEED),
                            _int(kwargs, "num_samples", 100), _tokenizer_name(kwargs), **kv_knobs(kwargs)))


def kv_knobs(metadata: dict[str, Any]) -> dict[str, Any]:
    """`kv_rows` keyword arguments from task metadata, validated (errors name the key)."""
    return {"digits": _int(metadata, "kv_digits", KV_DIGITS),
            "distractors": _nonnegative_int(metadata, "kv_distractors", KV_DISTRACTORS)}


def process_exact_match(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(results[0].strip() == doc["answer"])}


# ------------------------------------------------------------------------------------ pass key

def passkey_rows(lengths: list[int], seed: int = DEFAULT_SEED, num_samples: int = 10,
                 tokenizer: str | None = None, haystack: str = "repeat", digits: int = PASSKEY_DIGITS,
                 distractors: int = PASSKEY_DISTRACTORS) -> list[dict]:
    """`num_samples` questions per (length, depth) pair, depths in PASSKEY_DEPTHS; keys of `digits` digits,
    `distractors` expired near-miss keys in each haystack (`snapquant.data.synthetic.passkey_example`)."""
    count = token_counter(get_tokenizer(tokenizer))
    lines = None
    if haystack == "code":
        lines = [ln + "\n" for r in load_heldout() for ln in r["text"].split("\n")]
    elif haystack != "repeat":
        raise ConfigError(f"haystack={haystack!r} is not valid; allowed values: repeat, code")
    out = []
    for length in lengths:
        for depth in PASSKEY_DEPTHS:
            for i in range(num_samples):
                rng = seed_rng("eval", "passkey", haystack, seed, length, depth, i)
                ex = passkey_example(rng, length - ANSWER_RESERVE, count, depth=depth, haystack=lines,
                                     digits=digits, distractors=distractors)
                out.append({"index": i, "length": length, **ex})
    # Interleave lengths and depths so that `--limit N` still samples all of them.
    random.Random(f"passkey-order/{seed}").shuffle(out)
    return out


def passkey_knobs(metadata: dict[str, Any]) -> dict[str, Any]:
    """`passkey_rows` difficulty keyword arguments from task metadata, validated (one-line errors naming the key)."""
    digits = metadata.get("passkey_digits", PASSKEY_DIGITS)
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= PASSKEY_MAX_DIGITS:
        raise ConfigError(f"task metadata passkey_digits={digits!r} must be an int in [1, {PASSKEY_MAX_DIGITS}]")
    distractors = _nonnegative_int(metadata, "passkey_distractors", PASSKEY_DISTRACTORS)
    near = 9 * digits - 1  # one-digit neighbours of a key (no leading zero)
    if distractors > near:
        raise ConfigError(f"task metadata passkey_distractors={distractors} exceeds the {near} near misses of a "
                          f"{digits}-digit key (raise passkey_digits)")
    return {"digits": digits, "distractors": distractors}


def passkey_docs(**kwargs: Any):
    return _dataset(passkey_rows(task_lengths(kwargs), _int(kwargs, "sq_seed", DEFAULT_SEED),
                                 _int(kwargs, "num_samples", 10), _tokenizer_name(kwargs),
                                 kwargs.get("haystack", "repeat"), **passkey_knobs(kwargs)))


def _by_length(doc_length: int, score: float) -> dict[str, float]:
    # RULER's convention: every declared length gets -1 (ignored by the aggregation) but this doc's.
    out = {str(n): -1.0 for n in METRIC_LENGTHS}
    out[str(doc_length)] = score
    return out


def process_passkey(doc: dict, results: list[str]) -> dict[str, float]:
    pred = results[0].strip().rstrip(".").strip()
    score = float(pred == doc["answer"])
    return {"exact_match": score, **_by_length(doc["length"], score)}


def aggregate_by_length(values: list[float]) -> float:
    kept = [v for v in values if v != -1]
    return sum(kept) / len(kept) if kept else -1.0


# ------------------------------------------------------------------------- RULER offline subset

def _seeded_ruler(fn, kwargs: dict[str, Any]):
    """Call a RULER generator with Python's and numpy's global RNGs seeded from `sq_seed`.

    RULER draws from the global RNGs, so its documents otherwise depend on whatever ran before in
    the process; seeding (and restoring the previous state after) makes them a function of the seed.
    """
    import numpy as np

    seed = _int(kwargs, "sq_seed", DEFAULT_SEED)
    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        return fn(**_ruler_tokenizer_kwargs(kwargs))
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _ruler_tokenizer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    kwargs["tokenizer"] = _tokenizer_name(kwargs) or default_tokenizer_path()
    kwargs.setdefault("max_seq_lengths", [4096])
    kwargs["max_seq_lengths"] = task_lengths(kwargs, default=(4096,))
    return kwargs


def _import_ruler(module: str):
    """Import a RULER module without its import-time `nltk.download('punkt_tab')`.

    Only the essay haystack uses punkt, and none of the subset wired here does; offline the download
    fails anyway (after a network attempt), so it is skipped when punkt_tab is not installed.
    """
    import importlib

    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
        return importlib.import_module(f"lm_eval.tasks.ruler.{module}")
    except LookupError:
        pass
    original = nltk.download
    nltk.download = lambda *a, **k: False
    try:
        return importlib.import_module(f"lm_eval.tasks.ruler.{module}")
    finally:
        nltk.download = original


def ruler_niah_single_1(**kwargs: Any):
    return _seeded_ruler(_import_ruler("niah_utils").niah_single_1, kwargs)


def ruler_niah_multikey_2(**kwargs: Any):
    return _seeded_ruler(_import_ruler("niah_utils").niah_multikey_2, kwargs)


def ruler_niah_multikey_3(**kwargs: Any):
    return _seeded_ruler(_import_ruler("niah_utils").niah_multikey_3, kwargs)


def ruler_cwe(**kwargs: Any):
    return _seeded_ruler(_import_ruler("cwe_utils").get_cw_dataset, kwargs)


def ruler_fwe(**kwargs: Any):
    return _seeded_ruler(_import_ruler("fwe_utils").fwe_download, kwargs)


def process_ruler(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER's own scoring (string_match_all: share of references found), keyed by length."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    return _by_length(doc["max_length"], string_match_all(postprocess_pred(results), [doc["outputs"]]))
