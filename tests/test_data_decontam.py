"""Near-duplicate decontamination on synthetic texts with known overlaps."""

import random

from snapquant.data.decontam import (
    CONTAINMENT_THRESHOLD,
    JACCARD_THRESHOLD,
    NearDuplicateIndex,
    decontaminate,
    overlap_summary,
    shingles,
)


def _doc(rng: random.Random, n: int) -> str:
    words = [f"w{rng.randrange(5000)}" for _ in range(n)]
    return "\n".join(" ".join(words[i:i + 8]) for i in range(0, n, 8))


def test_shingles_are_stable_and_whitespace_insensitive():
    a = shingles("def f(x):\n    return x + 1\n")
    b = shingles("def   f(x):  return x\t+ 1")
    assert a.tolist() == b.tolist()  # crc32, not Python's salted hash: identical across processes


def test_near_duplicates_are_found_and_unrelated_texts_kept():
    rng = random.Random(0)
    held = [_doc(rng, 600) for _ in range(5)]
    near = held[2].split("\n")
    near[3] = "a changed line in the vendored copy"  # one edited line: Jaccard stays high
    pasted = _doc(rng, 300) + "\n" + held[4] + "\n" + _doc(rng, 300)  # held-out file inside a bigger one
    header = held[0][:200] + "\n" + _doc(rng, 600)  # a shared licence-header-sized prefix only
    train = [_doc(rng, 600), "\n".join(near), pasted, header, _doc(rng, 50)]
    drop, overlaps = decontaminate(train, held)
    assert drop == [1, 2]
    assert overlaps[1].heldout_index == 2 and overlaps[1].jaccard >= JACCARD_THRESHOLD
    assert overlaps[2].heldout_index == 4 and overlaps[2].containment >= CONTAINMENT_THRESHOLD
    assert overlaps[3].jaccard < 0.1 and overlaps[3].containment < 0.1
    s = overlap_summary(overlaps, len(held), drop)
    assert s["train_dropped"] == 2
    assert s["max_jaccard_kept"] < JACCARD_THRESHOLD and s["max_containment_kept"] < CONTAINMENT_THRESHOLD


def test_exact_jaccard_matches_set_arithmetic():
    rng = random.Random(1)
    a, b = _doc(rng, 400), _doc(rng, 400)
    mixed = "\n".join(a.split("\n")[:30] + b.split("\n")[30:])
    idx = NearDuplicateIndex([a])
    sa, sm = set(shingles(a).tolist()), set(shingles(mixed).tolist())
    ov = idx.overlap(mixed)
    assert abs(ov.jaccard - len(sa & sm) / len(sa | sm)) < 1e-12
    assert abs(ov.containment - len(sa & sm) / len(sa)) < 1e-12


def test_empty_inputs():
    assert NearDuplicateIndex([]).overlap("some text here").heldout_index == -1
    assert NearDuplicateIndex(["x y z"]).overlap("").jaccard == 0.0
