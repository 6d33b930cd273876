"""Synthetic long-context documents: key-value lookups written as Python, and pass keys.

One generator per format serves both the trainer and the evaluation tasks, so training documents
and task prompts share their format exactly. They never share instances: every generator takes a
`random.Random`, and callers seed it from disjoint namespaces (`seed_rng("train", ...)` in the
trainer, `seed_rng("eval", ...)` in the tasks); `tests/test_data_synthetic.py` checks the disjointness.

Lengths are in tokens of whatever tokenizer the caller measures with (`count_tokens`), so the same
task can be built for any model.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from ..errors import ConfigError

CountTokens = Callable[[str], int]

# Key vocabulary: short, common, lower-case words (written for this project). Keys are two words,
# so many keys share one word with others and a lookup must match the whole key.
WORDS: tuple[str, ...] = tuple("""
able acid aged amber apple arch arrow ash aspen atlas aunt autumn badge baker bamboo banjo barn
basin beach beam bell berry birch black blade bloom blue board bolt bone brass bread brick bridge
bright brook brown brush cabin cable camel candle canyon cargo carpet castle cedar cell chalk
charm cherry chess cider civic clay cliff clock cloud clover coast cobalt comet coral cotton crane
creek crisp crow crystal cider dawn delta desert dew dingo dock dune dusk eagle east echo elder
elm ember fable falcon fern ferry field finch flame flint flute fog forest fossil fox frost garden
garnet gate gecko ginger glade glass globe gold grain granite grape gravel green grove gull harbor
hazel heron hill honey horn husky iris iron island ivory jade jasper jelly jungle kelp kettle kite
lake lantern larch lark lava lemon lily linen lion lotus lunar maple marble marsh meadow mesa
mint mist moon moss moth north novel oak oasis ocean olive onyx opal orbit orchid otter owl
paddle palm panda paper pearl pebble pepper pine plain planet plum polar pond poppy prairie quail
quartz quiet rain raven reed ridge river robin rocky rose ruby rust saddle sage salt sand satin
scarlet shadow shell silver slate snow solar south spark spruce star stone storm sugar summit
sun swan tango teal thistle thunder tiger timber topaz torch tulip tundra umber valley velvet
violet walnut wave west wheat willow wind winter wolf wren yarrow yellow zephyr zinc
""".split())

TABLE_NAMES = ("REGISTRY", "CONFIG", "CODES", "LOOKUP", "SETTINGS", "INDEX", "TOKENS", "MAPPING",
               "CATALOG", "TABLE")
FUNC_NAMES = ("lookup", "get_value", "resolve", "fetch", "find_code", "read_entry")

# Classic pass-key filler (Mohtashami & Jaggi, 2023), used as-is so results compare with the literature.
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about the pass key at the end.")
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def seed_rng(namespace: str, *parts: object) -> random.Random:
    """A `random.Random` seeded from a string: stable across machines and Python versions."""
    if namespace not in ("train", "eval"):
        raise ConfigError(f"namespace={namespace!r} is not valid; allowed values: train, eval")
    return random.Random("/".join(["snapquant-synthetic", namespace, *map(str, parts)]))


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _check_budget(target_tokens: int, minimum: int, what: str) -> None:
    if not isinstance(target_tokens, int) or target_tokens < minimum:
        raise ConfigError(f"target_tokens={target_tokens!r} is too small for a {what} document (min {minimum})")


# ----------------------------------------------------------------------------- key-value lookups

def _kv_parts(rng: random.Random) -> tuple[str, str, str]:
    table = rng.choice(TABLE_NAMES)
    func = rng.choice(FUNC_NAMES)
    header = (f'"""Generated {table.lower()} of named codes; use {func}() to read an entry."""\n\n'
              f"{table} = {{\n")
    footer = f"}}\n\n\ndef {func}(name):\n    return {table}[name]\n\n\n"
    return header, footer, func


def _entry(key: str, value: str) -> str:
    return f'    "{key}": "{value}",\n'


def _build_table(rng: random.Random, budget: int, count_tokens: CountTokens, digits: int,
                 fixed: int, min_entries: int) -> tuple[list[str], list[str], list[int]]:
    """Draw distinct keys and their values until the entry lines fill `budget - fixed` tokens."""
    keys: list[str] = []
    values: list[str] = []
    costs: list[int] = []
    used: set[str] = set()
    room = budget - fixed
    while True:
        key = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"
        if key in used:
            continue
        value = _number(rng, digits)
        cost = count_tokens(_entry(key, value))
        if room - cost < 0 and len(keys) >= min_entries:
            break
        used.add(key)
        keys.append(key)
        values.append(value)
        costs.append(cost)
        room -= cost
        if len(keys) > 100_000:
            raise ConfigError("count_tokens returns 0 for non-empty text; cannot size the document")
    return keys, values, costs


def _fit(render: Callable[[int], str], n: int, count_tokens: CountTokens, budget: int, minimum: int) -> int:
    """Largest n' <= n whose rendering fits `budget` tokens (entry counts are nearly additive)."""
    while n > minimum and (excess := count_tokens(render(n)) - budget) > 0:
        n = max(minimum, n - max(1, excess // 16))
    if count_tokens(render(max(n, minimum))) > budget:
        raise ConfigError(f"cannot fit a document into {budget} tokens")
    return max(n, minimum)


def near_miss_keys(key: str, rng: random.Random) -> list[str]:
    """Every key sharing exactly one word, or both words swapped, with `key`, in a seeded order.

    These are the keys a lookup can confuse with `key`: same first word (`amber_fox` ->
    `amber_fern`), same second word (`cedar_fox`), or the same two words in the other order
    (`fox_amber`). None equals `key`.
    """
    first, second = key.split("_")
    words = [w for w in dict.fromkeys(WORDS) if w not in (first, second)]  # WORDS repeats a few words
    out = [f"{first}_{w}" for w in words] + [f"{w}_{second}" for w in words]
    rng.shuffle(out)
    if first != second:  # the swapped key, early in the list so that a few distractors include it
        out.insert(rng.randrange(min(4, len(out)) + 1), f"{second}_{first}")
    return out


def kv_retrieval_example(rng: random.Random, target_tokens: int, count_tokens: CountTokens,
                         depth: float | None = None, n_shots: int = 2, digits: int = 7,
                         distractors: int = 0) -> dict:
    """One lookup question over a Python dict filling about `target_tokens` (prompt + answer).

    The prompt ends with `assert FUNC("KEY") == "` and the answer is the value (digits only): the
    closing quote ends generation. `depth` in [0, 1] places the queried entry in the table (0 = first);
    `n_shots` solved lookups of other keys precede the question. `distractors` other entries (at
    most all of them, and the ~500 keys `near_miss_keys` gives) get near-miss keys of the asked one (`near_miss_keys`), at seeded positions,
    so the lookup must match both words of the key in order; shots never ask a distractor.
    """
    _check_budget(target_tokens, 64, "key-value")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ConfigError(f"depth={depth!r} must lie in [0, 1]")
    for name, value, low in (("n_shots", n_shots, 0), ("digits", digits, 1), ("distractors", distractors, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{name}={value!r} must be an int >= {low}")
    header, footer, func = _kv_parts(rng)
    n_min = n_shots + 1
    # Reserve room for the shots and the question with a generous estimate, then fit exactly.
    probe = f'assert {func}("{WORDS[0]}_{WORDS[1]}") == "{"9" * digits}"\n'
    fixed = count_tokens(header + footer) + (n_shots + 1) * count_tokens(probe) + 2
    keys, values, _ = _build_table(rng, target_tokens, count_tokens, digits, fixed, n_min)
    if depth is None:
        depth = rng.random()
    n = len(keys)

    def pick(n_entries: int) -> tuple[int, list[int], list[str]]:
        q = round(depth * (n_entries - 1))
        others = [i for i in range(n_entries) if i != q]
        # Seeded from the instance, not from `rng`: re-rendering while fitting must not move the shots.
        aux = random.Random(hash_seed(keys[0], values[0], n_entries))
        near = set(aux.sample(others, min(distractors, len(others))))
        shots = aux.sample([i for i in others if i not in near] or others, n_shots)
        names = list(keys[:n_entries])
        if near:
            taken = set(names)
            fresh = [k for k in near_miss_keys(keys[q], aux) if k not in taken]
            for i, k in zip(sorted(near), fresh, strict=False):  # capped by the near-miss keys left
                names[i] = k
        return q, shots, names

    def render(n_entries: int, with_answer: bool = True) -> str:
        q, shots, names = pick(n_entries)
        body = "".join(_entry(names[i], values[i]) for i in range(n_entries))
        solved = "".join(f'assert {func}("{names[i]}") == "{values[i]}"\n' for i in shots)
        tail = f'assert {func}("{names[q]}") == "' + (values[q] + '"' if with_answer else "")
        return header + body + footer + solved + tail

    n = _fit(render, n, count_tokens, target_tokens, n_min)
    q, _, names = pick(n)
    near = [k for i, k in enumerate(names) if i != q and k != keys[i]]
    return {"prompt": render(n, with_answer=False), "answer": values[q], "key": names[q],
            "n_entries": n, "depth": q / max(1, n - 1), "distractor_keys": near}


def hash_seed(*parts: object) -> str:
    """A deterministic seed string for auxiliary choices that must not consume the main rng."""
    return "/".join(map(str, parts))


def kv_training_document(rng: random.Random, target_tokens: int, count_tokens: CountTokens,
                         n_queries: int | None = None, digits: int | None = None) -> str:
    """A full lookup document for training: the table, the helper and several answered asserts.

    Queried keys are drawn uniformly over the table, so retrieval is taught at every distance. The
    document fits `target_tokens` (as measured by `count_tokens`), so a packer that reserves that
    much never cuts off the asserts, which carry all of the retrieval signal.
    """
    _check_budget(target_tokens, 64, "key-value")
    n_queries = n_queries if n_queries is not None else rng.randint(1, 8)
    digits = digits if digits is not None else rng.choice((5, 6, 7, 7, 7, 8))
    header, footer, func = _kv_parts(rng)
    probe = f'assert {func}("{WORDS[0]}_{WORDS[1]}") == "{"9" * digits}"\n'
    frame = count_tokens(header + footer)
    # Asserts may take at most half of what the frame leaves, so short documents still hold a table.
    n_queries = max(1, min(n_queries, (target_tokens - frame) // (2 * count_tokens(probe) + 4)))
    fixed = frame + n_queries * count_tokens(probe) + 1
    keys, values, _ = _build_table(rng, target_tokens, count_tokens, digits, fixed, 1)
    # Queries as relative positions, so trimming the table to fit keeps all of them.
    asks = [rng.random() for _ in range(n_queries)]

    def render(n_entries: int) -> str:
        body = "".join(_entry(keys[i], values[i]) for i in range(n_entries))
        picked = [min(n_entries - 1, int(a * n_entries)) for a in asks]
        tail = "".join(f'assert {func}("{keys[i]}") == "{values[i]}"\n' for i in picked)
        return header + body + footer + tail

    return render(_fit(render, len(keys), count_tokens, target_tokens, 1))


# ----------------------------------------------------------------------------------- pass keys

def _passkey_needle(key: str, code: bool) -> str:
    if code:
        return f"PASS_KEY = {key}  # the pass key: remember it\n"
    return f" The pass key is {key}. Remember it. {key} is the pass key."


def passkey_example(rng: random.Random, target_tokens: int, count_tokens: CountTokens, depth: float,
                    haystack: Sequence[str] | None = None, digits: int = 5, distractors: int = 0) -> dict:
    """A pass-key question: the key sits at relative `depth` of a haystack of about `target_tokens`.

    `haystack=None` gives the classic repeated-sentence filler; a sequence of code lines (each
    ending in '\\n') gives the code variant, where the needle is an assignment and the question an
    assert. The answer is the key's digits. `distractors` adds that many expired keys at seeded
    depths, each a near miss of the key (`near_miss_numbers`: one digit changed) and labelled as old
    ("The old pass key was ..." / `OLD_PASS_KEY = ...`), so the answer must be the right one of several
    almost equal numbers; with 0 the document is the one this function always gave for the seed.
    """
    _check_budget(target_tokens, 64, "pass-key")
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"depth={depth!r} must lie in [0, 1]")
    if isinstance(distractors, bool) or not isinstance(distractors, int) or distractors < 0:
        raise ConfigError(f"distractors={distractors!r} must be an int >= 0")
    key = _number(rng, digits)
    code = haystack is not None
    if code:
        if not haystack:
            raise ConfigError("haystack is empty: give code lines or None for the classic filler")
        start = rng.randrange(len(haystack))
        lines = [haystack[(start + i) % len(haystack)] for i in range(len(haystack))]
        intro = "# A pass key is hidden somewhere in this file. Find it and remember it.\n"
        question = "\n# What is the pass key?\nassert PASS_KEY =="
        unit_cost = max(1, sum(count_tokens(x) for x in lines[:50]) // min(50, len(lines)))
    else:
        lines = [" " + PASSKEY_FILLER] * (target_tokens + 1)
        intro = PASSKEY_INTRO
        question = "\n" + PASSKEY_QUESTION
        unit_cost = max(1, count_tokens(" " + PASSKEY_FILLER))
    needle = _passkey_needle(key, code)
    # Drawn after everything the distractor-free document draws, so distractors=0 keeps its documents.
    decoys = near_miss_numbers(key, rng, distractors) if distractors else []
    decoy_depths = [rng.random() for _ in decoys]
    decoy_text = [_passkey_decoy(d, code) for d in decoys]
    fixed = count_tokens(intro + question + needle + "".join(decoy_text)) + count_tokens(" " + key) + 2
    if decoys and fixed + unit_cost > target_tokens:
        raise ConfigError(f"pass key: {len(decoys)} distractor keys of {digits} digits take {fixed} of the "
                          f"{target_tokens}-token budget; lower distractors (task metadata passkey_distractors) "
                          "or raise the length")
    n = max(1, (target_tokens - fixed) // unit_cost)
    n = min(n, len(lines))

    def render(n_units: int, with_answer: bool = False) -> str:
        inserts = sorted([(round(depth * n_units), 0, needle)]
                         + [(round(d * n_units), 1 + j, t) for j, (d, t) in enumerate(zip(decoy_depths, decoy_text,
                                                                                             strict=True))])
        hay, parts, prev = lines[:n_units], [intro], 0
        for at, _, text in inserts:
            parts += [*hay[prev:at], text]
            prev = at
        text = "".join([*parts, *hay[prev:n_units], question])
        # No trailing space in the prompt: the answer's leading space belongs to its first token.
        return text + (" " + key if with_answer else "")

    n = _fit(lambda m: render(m, True), n, count_tokens, target_tokens, 1)
    return {"prompt": render(n), "answer": key, "depth": depth, "n_units": n,
            "haystack": "code" if code else "repeat", "distractor_keys": decoys}


def near_miss_numbers(key: str, rng: random.Random, count: int) -> list[str]:
    """`count` distinct numbers of `key`'s length, each differing from it in exactly one digit (no leading
    zero), in a seeded order; ConfigError when the key has fewer such neighbours (9 per digit)."""
    pool = [key[:i] + c + key[i + 1:] for i in range(len(key)) for c in "0123456789"
            if c != key[i] and not (i == 0 and c == "0")]
    if count > len(pool):
        raise ConfigError(f"distractors={count} exceeds the {len(pool)} near misses of a {len(key)}-digit key")
    return rng.sample(pool, count)


def _passkey_decoy(value: str, code: bool) -> str:
    if code:
        return f"OLD_PASS_KEY = {value}  # expired: not the pass key\n"
    return f" The old pass key was {value}. It has expired."


def passkey_training_document(rng: random.Random, target_tokens: int, count_tokens: CountTokens,
                              haystack: Sequence[str] | None = None) -> str:
    """A pass-key document with its answer, the needle at a uniformly random depth."""
    # Two tokens of room for the closing ".\n" / "\n" after the answer.
    ex = passkey_example(rng, target_tokens - 2, count_tokens, depth=rng.random(), haystack=haystack,
                         digits=rng.choice((4, 5, 5, 6, 7)))
    end = "\n" if haystack is not None else ".\n"
    return ex["prompt"] + " " + ex["answer"] + end
