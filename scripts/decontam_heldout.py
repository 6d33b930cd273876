"""Drop the embedded model's held-out files that overlap its training files; record why, in the card.

The embedded model is trained already, so the training set stays as it is and the held-out set
shrinks: every held-out file (kept or dropped earlier) is compared with every training file of the
shipped manifest (`snapquant/assets/embedded/corpus_manifest.jsonl`), whose texts are read from
this machine's standard library and pinned packages and accepted only when their sha256 matches
the manifest. A held-out file is contaminated when `decontam.HeldoutOverlap.reasons` names a
threshold it crosses (word 5-gram Jaccard >= 0.5, containment >= 0.8, or a verbatim passage of
>= 50 words shared with one training file).

Writes (idempotent: rerunning it gives the same files):
- `snapquant/eval/tasks/data/heldout_code.jsonl`: the clean files, what evaluation reads;
- `snapquant/assets/embedded/heldout_dropped.jsonl`: the dropped files, still excluded from training;
- `snapquant/assets/embedded/heldout_decontam.json`: per-file overlaps, thresholds, summary;
- `snapquant/assets/embedded/heldout_overlap_sketch.json`: per training file its 5-gram count and
  the 5-grams it shares with the held-out files, from which the CI test recomputes every number;
- the "Held-out decontamination" section of `snapquant/assets/embedded/README.md`.

`--score` also measures bits per byte of the bf16 model on the kept and the dropped files (CPU).

    python scripts/decontam_heldout.py [--score]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from snapquant.atomic import atomic_write_json, atomic_write_text
from snapquant.data.corpus import (
    DROPPED_HELDOUT_FILE,
    HELDOUT_FILE,
    content_sha256,
    load_heldout,
    normalize_source,
    source_path,
)
from snapquant.data.decontam import (
    CARD_BEGIN,
    CARD_END,
    TrainingSketch,
    heldout_card_lines,
    heldout_overlaps,
    heldout_summary,
)
from snapquant.embedded import EMBEDDED_PATH

MANIFEST = EMBEDDED_PATH / "corpus_manifest.jsonl"
RECORD = EMBEDDED_PATH / "heldout_decontam.json"
SKETCH = EMBEDDED_PATH / "heldout_overlap_sketch.json"
CARD = EMBEDDED_PATH / "README.md"


def training_texts(manifest: list[dict]) -> tuple[list[tuple[str, str]], list[str]]:
    """(origin:path, text) of every training entry found here with its manifest sha256; names not found."""
    found, missing = [], []
    for e in manifest:
        if e["split"] != "train":
            continue
        name = f"{e['origin']}:{e['path']}"
        p = source_path(e["origin"], e["path"])
        try:
            text = normalize_source(p.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            missing.append(name)
            continue
        if content_sha256(text) != e["sha256"]:
            missing.append(name)
            continue
        found.append((name, text))
    return found, missing


def score(rows: list[dict]) -> dict:
    """bf16 bits per byte and token perplexity of the embedded model on these files (direct harness)."""
    import torch

    from snapquant.embedded import load_embedded
    from snapquant.eval.tasks.direct import score_code_ppl

    model, tok = load_embedded(dtype=torch.float32)
    out = score_code_ppl(model, tok, texts=[r["text"] for r in rows])
    return {"files": len(rows), "bits_per_byte": out["bits_per_byte"], "token_perplexity": out["token_perplexity"]}


def write_card_section(record: dict, card: Path = CARD) -> None:
    text = card.read_text(encoding="utf-8")
    section = "\n".join(heldout_card_lines(record))
    if CARD_BEGIN in text and CARD_END in text:
        head, rest = text.split(CARD_BEGIN, 1)
        text = head + section + rest.split(CARD_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(card, text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--score", action="store_true", help="also score kept vs dropped files with the bf16 model")
    args = ap.parse_args(argv)
    t0 = time.time()
    manifest_text = MANIFEST.read_text(encoding="utf-8")
    manifest = [json.loads(line) for line in manifest_text.splitlines() if line.strip()]
    heldout = sorted(load_heldout(include_dropped=True), key=lambda r: r["path"])
    listed = {e["sha256"] for e in manifest if e["split"] == "heldout"}
    if {r["sha256"] for r in heldout} != listed:
        raise SystemExit(f"the held-out files ({len(heldout)}) are not the manifest's held-out split ({len(listed)})")
    train, missing = training_texts(manifest)
    n_train = sum(e["split"] == "train" for e in manifest)
    if missing:
        raise SystemExit(f"{len(missing)} of {n_train} training files are not on this machine with their manifest "
                         f"sha256 (first: {missing[0]}); the check needs all of them")
    print(f"{len(train)} training files, {len(heldout)} held-out files ({time.time() - t0:.0f}s)", flush=True)
    sketch = TrainingSketch.build(train, [r["text"] for r in heldout])
    overlaps = heldout_overlaps([(r["path"], r["text"]) for r in heldout], sketch)
    print(f"overlaps computed ({time.time() - t0:.0f}s)", flush=True)

    kept_rows, dropped_rows, files = [], [], []
    for r, ov in zip(heldout, overlaps, strict=True):
        reasons = ov.reasons()
        files.append({**ov.to_dict(), "sha256": r["sha256"], "bytes": r["bytes"],
                      "status": "dropped" if reasons else "kept", "reasons": reasons})
        row = {k: r[k] for k in ("path", "origin", "sha256", "bytes", "text")}
        (dropped_rows if reasons else kept_rows).append(row)
    sketch_json = json.dumps(sketch.to_json(), separators=(",", ":")) + "\n"
    record = {
        "format": "snapquant-heldout-decontam-v1",
        "written_by": "scripts/decontam_heldout.py",
        "manifest_sha256": hashlib.sha256(manifest_text.encode("utf-8")).hexdigest(),
        "training_files": n_train,
        "summary": heldout_summary(overlaps),
        "files": files,
        "sketch": SKETCH.name,
        "sketch_sha256": hashlib.sha256(sketch_json.encode("utf-8")).hexdigest(),
    }
    # Scores written by a training run that predates this check were measured on every held-out file.
    state_file = EMBEDDED_PATH / "training_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    record["scores_predate_check"] = bool(state.get("bf16_scores")) and "heldout_files_scored" not in state
    previous = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    if args.score:
        record["scores"] = {"kept": score(kept_rows), "dropped": score(dropped_rows) if dropped_rows else None}
    elif previous.get("scores") and previous.get("files") == files:
        record["scores"] = previous["scores"]  # same split: earlier scores still describe it

    atomic_write_text(HELDOUT_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept_rows))
    atomic_write_text(DROPPED_HELDOUT_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in dropped_rows))
    atomic_write_text(SKETCH, sketch_json)
    atomic_write_json(RECORD, record, indent=1)
    write_card_section(record)
    for f in files:
        if f["status"] == "dropped":
            print(f"dropped {f['path']}: {'; '.join(f['reasons'])}")
    s = record["summary"]
    print(f"kept {s['kept']} of {s['heldout_files_checked']} held-out files; max remaining: "
          + ", ".join(f"{k} {v['value']}" for k, v in s["max_remaining"].items()), file=sys.stderr)


if __name__ == "__main__":
    main()
