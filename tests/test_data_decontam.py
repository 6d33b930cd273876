"""Near-duplicate decontamination on synthetic texts with known overlaps, and the shipped held-out check."""

import hashlib
import json
import random

import numpy as np
import pytest

from snapquant.data.corpus import content_sha256, load_heldout, normalize_source, source_path
from snapquant.data.decontam import (
    CONTAINMENT_THRESHOLD,
    JACCARD_THRESHOLD,
    SHARED_WORDS_THRESHOLD,
    NearDuplicateIndex,
    TrainingSketch,
    decontaminate,
    heldout_card_lines,
    heldout_overlaps,
    heldout_summary,
    overlap_summary,
    shingles,
)
from snapquant.embedded import EMBEDDED_PATH


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


# ---------------------------------------------------------------------- held-out side
def test_heldout_overlaps_from_the_sketch_are_exact():
    rng = random.Random(2)
    train = [(f"t{i}", _doc(rng, 500)) for i in range(6)]
    held = [("h0", _doc(rng, 400)), ("h1", train[3][1][:1500] + "\n" + _doc(rng, 300))]
    sketch = TrainingSketch.build(train, [t for _, t in held])
    again = TrainingSketch.from_json(json.loads(json.dumps(sketch.to_json())))
    for ov in (heldout_overlaps(held, sketch), heldout_overlaps(held, again)):
        # Reference: full sets of every pair, no sketch.
        for (path, text), o in zip(held, ov, strict=True):
            sh = set(shingles(text).tolist())
            ref = [(len(sh & set(shingles(t).tolist())), set(shingles(t).tolist()), name) for name, t in train]
            jac = max(i / len(sh | st) for i, st, _ in ref)
            cont = max(i / len(sh) for i, _, _ in ref)
            assert o.path == path and abs(o.jaccard - jac) < 1e-12 and abs(o.containment - cont) < 1e-12
    o1 = heldout_overlaps(held, sketch)[1]
    assert o1.containment_with == "t3" and o1.shared_with == "t3" and o1.shared_words >= 150
    with pytest.raises(ValueError, match="not built against"):
        heldout_overlaps([("other", _doc(rng, 100))], sketch)


def test_shared_passage_flags_a_licence_header_that_jaccard_misses():
    rng = random.Random(3)
    header = " ".join(f"L{rng.randrange(10_000)}" for _ in range(120))  # a 120-word licence text
    held_text = header + "\n" + _doc(rng, 2000)
    train = [("sibling.py", header + "\n" + _doc(rng, 2000)), ("idioms.py", held_text.split("\n")[40] + _doc(rng, 500))]
    o = heldout_overlaps([("module.py", held_text)], TrainingSketch.build(train, [held_text]))[0]
    assert o.jaccard < 0.1 and o.containment < 0.1  # far below the near-duplicate thresholds
    assert o.shared_words == 120 and o.shared_with == "sibling.py"
    assert o.is_contaminated() and "120-word passage" in o.reasons()[0]
    assert not o.is_contaminated(shared_words=121)
    assert SHARED_WORDS_THRESHOLD == 50


def _record() -> dict:
    return json.loads((EMBEDDED_PATH / "heldout_decontam.json").read_text())


def _manifest() -> list[dict]:
    return [json.loads(x) for x in (EMBEDDED_PATH / "corpus_manifest.jsonl").read_text().splitlines() if x.strip()]


def _sketch() -> TrainingSketch:
    return TrainingSketch.from_json(json.loads((EMBEDDED_PATH / _record()["sketch"]).read_text()))


def test_shipped_heldout_set_passes_the_check():
    """Every held-out file evaluation reads is below all thresholds against every training file.

    The training texts are not shipped; the sketch (each training file's 5-gram count and the
    5-grams it shares with the held-out files) gives the exact similarities, and it lists exactly
    the manifest's training files. `test_sketch_matches_the_training_files_found_here` checks it
    against the training texts themselves wherever this machine has them.
    """
    manifest, record, sketch = _manifest(), _record(), _sketch()
    train = [f"{e['origin']}:{e['path']}" for e in manifest if e["split"] == "train"]
    assert sketch.names == train and record["training_files"] == len(train)
    raw = (EMBEDDED_PATH / "corpus_manifest.jsonl").read_bytes()
    assert record["manifest_sha256"] == hashlib.sha256(raw).hexdigest()
    sketch_text = (EMBEDDED_PATH / record["sketch"]).read_text()
    assert record["sketch_sha256"] == hashlib.sha256(sketch_text.encode()).hexdigest()

    clean = load_heldout()
    overlaps = heldout_overlaps([(r["path"], r["text"]) for r in clean], sketch)
    dirty = {o.path: o.reasons() for o in overlaps if o.is_contaminated()}
    assert not dirty, dirty
    assert max(o.jaccard for o in overlaps) < JACCARD_THRESHOLD
    assert max(o.containment for o in overlaps) < CONTAINMENT_THRESHOLD
    assert max(o.shared_words for o in overlaps) < SHARED_WORDS_THRESHOLD

    # Kept + dropped are the manifest's held-out split (so rebuilt corpora still exclude all of them),
    # every dropped file crosses a threshold, and the record's numbers are what the sketch gives.
    every = load_heldout(include_dropped=True)
    assert {r["sha256"] for r in every} == {e["sha256"] for e in manifest if e["split"] == "heldout"}
    assert len(every) == len({r["sha256"] for r in every}) == len(clean) + record["summary"]["dropped"]
    all_overlaps = heldout_overlaps([(r["path"], r["text"]) for r in every], sketch)
    assert heldout_summary(all_overlaps) == record["summary"]
    by_path = {f["path"]: f for f in record["files"]}
    for o in all_overlaps:
        f = by_path[o.path]
        assert {k: f[k] for k in o.to_dict()} == o.to_dict()
        assert (f["status"] == "dropped") == o.is_contaminated() == (o.path not in {r["path"] for r in clean})
    assert {"distutils/version.py", "distutils/command/build_clib.py", "asyncore.py"} <= {
        f["path"] for f in record["files"] if f["status"] == "dropped"}


def test_model_card_quotes_the_decontamination_record():
    card = (EMBEDDED_PATH / "README.md").read_text()
    section = "\n".join(heldout_card_lines(_record()))
    assert section in card
    assert "| distutils/version.py | 0.789 | 0.879 | 635 |" in section


def test_sketch_matches_the_training_files_found_here():
    """Where this machine has a training file with its manifest sha256, the sketch's entry is its own."""
    sketch = _sketch()
    every = [r["text"] for r in load_heldout(include_dropped=True)]
    union = np.unique(np.concatenate([shingles(t) for t in every]))
    record = _record()
    named = {f[k] for f in record["files"] for k in ("jaccard_with", "containment_with", "shared_with") if f[k]}
    entries = [e for e in _manifest() if e["split"] == "train"]
    sample = [e for e in entries if f"{e['origin']}:{e['path']}" in named]
    sample += random.Random(0).sample(entries, 40)
    index = {n: i for i, n in enumerate(sketch.names)}
    checked = 0
    for e in sample:
        try:
            text = normalize_source(source_path(e["origin"], e["path"]).read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if content_sha256(text) != e["sha256"]:
            continue  # another Python / package version here: not the file that was trained on
        i = index[f"{e['origin']}:{e['path']}"]
        s = shingles(text)
        assert sketch.sizes[i] == s.size
        assert sketch.shared[i].tolist() == s[np.isin(s, union)].tolist()
        checked += 1
    if not checked:
        pytest.skip("none of the sampled training files is on this machine with its manifest sha256")
