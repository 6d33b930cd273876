"""A corpus of every Python source and documentation file on the machine it is built on.

The research model is trained on the GPU machine from what that machine has: its standard library
and every installed package (`.py`, `.md`, `.rst`, `.txt` under the `sys.path` / `sysconfig`
roots and `/usr/lib/python3*`). Steps:

1. list candidate files (size filter; symlinked / nested roots visited once; this repository and
   `exclude` folders skipped);
2. held-out split: the shipped held-out code (`snapquant/eval/tasks/data/heldout_code.jsonl`, also the
   embedded model's, so the two models are measured on the same text) plus a sample of the
   machine's files chosen by a hash of their path (`heldout_fraction`, at most `heldout_bytes`);
3. every other file (read in parallel): normalised, quality-filtered, exact-deduplicated by content
   hash, and dropped when it is a near duplicate of a held-out file (`decontam`, word 5-gram Jaccard
   >= 0.5 or containment >= 0.8): the held-out set stays fixed and training loses its copies;
4. the kept files, shuffled with the seed, are tokenized with the given tokenizer up to
   `max_train_tokens` in whole chunks of files (the rest recorded as `excluded:token_budget`).

Output (`out_dir`): train.bin / val.bin (uint16, `load_corpus`-compatible, val = the shipped held-out
code), val_machine.bin (the sampled held-out files), manifest.jsonl.gz (every file: path, origin,
sha256, bytes, split, overlap), meta.json (counts, hashes, summary, decontamination statistics).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes
from .build import TOKEN_DTYPE, encode_documents, file_sha256
from .corpus import content_sha256, load_heldout, normalize_source
from .decontam import NearDuplicateIndex, Overlap, overlap_summary, shingles

EXTENSIONS = (".py", ".md", ".rst", ".txt")
MIN_BYTES = 200
MAX_BYTES = 300_000
MAX_LINE_CHARS = 1000
SKIP_DIRS = {"__pycache__", ".git", "node_modules", ".hg", ".svn"}
REPO = Path(__file__).resolve().parents[2]


def default_roots() -> list[Path]:
    """Every directory on sys.path, the sysconfig library paths and /usr/lib/python3*, outermost only."""
    cands: list[str] = [p for p in sys.path if p]
    cands += [v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib")]
    cands += [str(p) for p in Path("/usr/lib").glob("python3*")]
    cands += [str(p) for p in Path("/usr/local/lib").glob("python3*")]
    roots: list[Path] = []
    for c in cands:
        p = Path(c).resolve()
        if p.is_dir() and p not in roots:
            roots.append(p)
    # Nested roots (site-packages inside lib/python3.x) are walked once, from the outer one.
    roots.sort(key=lambda p: len(p.parts))
    outer: list[Path] = []
    for p in roots:
        if not any(p == o or o in p.parents for o in outer):
            outer.append(p)
    return outer


@dataclass(frozen=True)
class Candidate:
    path: str  # absolute, resolved
    origin: str  # "<root>|<first path component>" for the summary
    bytes: int


def list_candidates(roots: Iterable[Path], exclude: Iterable[Path] = ()) -> list[Candidate]:
    """Files with a corpus extension and a plausible size, each real file once, in a fixed order."""
    skip = [Path(e).resolve() for e in (REPO, *exclude)]
    seen: set[str] = set()
    out: list[Candidate] = []
    for root in roots:
        root = Path(root).resolve()
        if any(root == s or s in root.parents for s in skip):
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            d = Path(dirpath)
            dirnames[:] = sorted(n for n in dirnames if n not in SKIP_DIRS and (d / n).resolve() not in skip)
            for name in sorted(filenames):
                if not name.endswith(EXTENSIONS):
                    continue
                p = d / name
                try:
                    real = str(p.resolve())
                    size = p.stat().st_size
                except OSError:
                    continue
                if real in seen or not MIN_BYTES <= size <= MAX_BYTES:
                    continue
                seen.add(real)
                rel = p.relative_to(root).parts
                out.append(Candidate(real, f"{root}|{rel[0] if len(rel) > 1 else '.'}", size))
    return out


def read_text(path: str) -> tuple[str | None, str | None]:
    """(normalised text, None) or (None, reason it is rejected)."""
    try:
        text = normalize_source(Path(path).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None, "not_utf8"
    if "\x00" in text:
        return None, "binary"
    if max(map(len, text.split("\n"))) > MAX_LINE_CHARS:
        return None, "long_line"
    if len(text.split()) < 20:
        return None, "too_few_words"
    return text, None


# Data workers: the held-out index is built once per process (initializer), not pickled per task.
_INDEX: NearDuplicateIndex | None = None


def _init_worker(heldout_texts: list[str]) -> None:
    global _INDEX
    _INDEX = NearDuplicateIndex(heldout_texts)


def _scan_file(path: str) -> tuple[str, str | None, int, Overlap | None]:
    text, _reason = read_text(path)
    if text is None:
        return path, None, 0, None
    ov = _INDEX.overlap_shingles(shingles(text)) if _INDEX is not None else Overlap(-1, 0.0, 0.0)
    return path, content_sha256(text), len(text.encode("utf-8")), ov


def _heldout_sample(cands: list[Candidate], fraction: float, max_bytes: int, seed: int) -> list[Candidate]:
    """Files chosen by a hash of their path (stable across machines holding the same packages)."""
    keyed = sorted(((hashlib.sha256(f"heldout/{seed}/{c.path}".encode()).digest(), c) for c in cands
                    if 2_000 <= c.bytes <= 60_000), key=lambda kc: kc[0])
    limit = int(fraction * len(keyed))
    chosen, total = [], 0
    for _, c in keyed[:limit]:
        if total + c.bytes > max_bytes:
            break
        chosen.append(c)
        total += c.bytes
    return chosen


def build_machine_corpus(out_dir: Path | str, tokenizer_dir: Path | str, *, roots: Iterable[Path] | None = None,
                         exclude: Iterable[Path] = (), max_train_tokens: int = 200_000_000,
                         heldout_fraction: float = 0.01, heldout_bytes: int = 3_000_000, max_files: int = 0,
                         workers: int | None = None, seed: int = 0,
                         log: Callable[[str], None] = print) -> dict:
    """Build the corpus (see the module docstring); returns meta.json's content."""
    from .tokenizer import EOS_TOKEN, load_fast_tokenizer

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    roots = list(roots) if roots is not None else default_roots()
    cands = list_candidates(roots, exclude)
    if max_files:
        cands = random.Random(f"machine-corpus/{seed}").sample(cands, min(max_files, len(cands)))
        cands.sort(key=lambda c: c.path)
    log(f"{len(cands)} candidate files under {len(roots)} roots ({time.time() - t0:.0f}s)")

    shipped = load_heldout(include_dropped=True)  # as the research corpus was built: all of them held out
    sample = _heldout_sample(cands, heldout_fraction, heldout_bytes, seed)
    heldout_rows: list[dict] = []
    heldout_hashes = {r["sha256"] for r in shipped}
    for c in sample:
        text, _reason = read_text(c.path)
        if text is None:
            continue
        h = content_sha256(text)
        if h in heldout_hashes:
            continue
        heldout_hashes.add(h)
        heldout_rows.append({"path": c.path, "origin": c.origin, "sha256": h, "bytes": len(text.encode()), "text": text})
    heldout_texts = [r["text"] for r in shipped] + [r["text"] for r in heldout_rows]
    sample_paths = {c.path for c in sample}
    log(f"held-out: {len(shipped)} shipped + {len(heldout_rows)} sampled files ({time.time() - t0:.0f}s)")

    todo = [c for c in cands if c.path not in sample_paths]
    workers = workers or max(1, min(16, (os.cpu_count() or 2)))
    if workers > 1:
        with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(heldout_texts,)) as ex:
            scanned = list(ex.map(_scan_file, [c.path for c in todo], chunksize=64))
    else:
        _init_worker(heldout_texts)
        scanned = [_scan_file(c.path) for c in todo]
    log(f"scanned {len(scanned)} files ({time.time() - t0:.0f}s)")

    manifest: list[dict] = []
    seen: set[str] = set()
    kept: list[int] = []
    overlaps: list[Overlap] = []
    dropped_near: list[int] = []
    for r in shipped:
        manifest.append({"path": r["path"], "origin": "shipped:" + r["origin"], "sha256": r["sha256"],
                         "bytes": r["bytes"], "split": "heldout"})
    for r in heldout_rows:
        manifest.append({"path": r["path"], "origin": r["origin"], "sha256": r["sha256"], "bytes": r["bytes"],
                         "split": "heldout"})
    for c, (_, digest, nbytes, ov) in zip(todo, scanned, strict=True):
        row = {"path": c.path, "origin": c.origin, "sha256": digest, "bytes": nbytes or c.bytes}
        if digest is None:
            row["split"] = "excluded:unreadable_or_filtered"
        elif digest in heldout_hashes:
            row["split"] = "excluded:heldout_copy"
        elif digest in seen:
            row["split"] = "excluded:duplicate"
        else:
            seen.add(digest)
            overlaps.append(ov)
            if ov.is_near_duplicate():
                dropped_near.append(len(overlaps) - 1)
                row["split"] = "excluded:near_duplicate_of_heldout"
                row["overlap"] = {"heldout": _heldout_name(ov.heldout_index, shipped, heldout_rows),
                                  "jaccard": round(ov.jaccard, 3), "containment": round(ov.containment, 3)}
            else:
                row["split"] = "train"
                kept.append(len(manifest))
        manifest.append(row)
    decon = overlap_summary(overlaps, len(heldout_texts), dropped_near)
    decon["dropped_examples"] = [m for m in manifest if m["split"] == "excluded:near_duplicate_of_heldout"][:20]
    log(f"{len(kept)} training files; {len(dropped_near)} near duplicates of held-out files dropped "
        f"({time.time() - t0:.0f}s)")

    tok_dir = Path(tokenizer_dir)
    tok = load_fast_tokenizer(tok_dir)
    eos_id = tok.token_to_id(EOS_TOKEN)
    if eos_id is None:
        eos_id = int(json.loads((tok_dir / "tokenizer_config.json").read_text()).get("eos_token_id", 0))
    (out / "tokenizer").mkdir(exist_ok=True)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / "tokenizer" / f.name).write_bytes(f.read_bytes())

    order = list(kept)
    random.Random(f"machine-corpus-order/{seed}").shuffle(order)
    parts, total, used = [], 0, 0
    chunk = 2048
    for s in range(0, len(order), chunk):
        if total >= max_train_tokens:
            break
        idx = order[s:s + chunk]
        texts = [read_text(manifest[i]["path"])[0] or "" for i in idx]
        ids = encode_documents(tok, texts, eos_id, batch=chunk)
        parts.append(ids)
        total += ids.size
        used = s + len(idx)
    for i in order[used:]:
        manifest[i]["split"] = "excluded:token_budget"
    # The budget is applied at chunk granularity (whole files, at most one chunk over), so the
    # manifest's train files are exactly the files in train.bin.
    train = np.concatenate(parts) if parts else np.zeros(0, dtype=TOKEN_DTYPE)
    atomic_write_bytes(out / "train.bin", train.tobytes())
    atomic_write_bytes(out / "val.bin", encode_documents(tok, [r["text"] for r in shipped], eos_id).tobytes())
    val_m = encode_documents(tok, [r["text"] for r in heldout_rows], eos_id)
    atomic_write_bytes(out / "val_machine.bin", val_m.tobytes())
    with gzip.open(out / "heldout_machine.jsonl.gz", "wt", encoding="utf-8") as fh:
        for r in heldout_rows:
            fh.write(json.dumps(r) + "\n")
    lines = "".join(json.dumps(m) + "\n" for m in manifest).encode()
    atomic_write_bytes(out / "manifest.jsonl.gz", gzip.compress(lines, mtime=0))
    summary = machine_summary(manifest)
    train_bytes = sum(manifest[i]["bytes"] for i in order[:used])
    meta = {
        "format": "snapquant-corpus-v1", "dtype": "uint16", "source": "machine",
        "train_tokens": int(train.size), "val_tokens": int((out / "val.bin").stat().st_size // 2),
        "val_machine_tokens": int(val_m.size), "train_files": used, "train_bytes": int(train_bytes),
        "bytes_per_token": round(train_bytes / max(1, train.size), 4), "vocab_size": tok.get_vocab_size(),
        "eos_id": int(eos_id), "seed": seed, "max_train_tokens": max_train_tokens,
        "roots": [str(r) for r in roots], "extensions": list(EXTENSIONS),
        "filters": {"min_bytes": MIN_BYTES, "max_bytes": MAX_BYTES, "max_line_chars": MAX_LINE_CHARS},
        "manifest_sha256": hashlib.sha256(lines).hexdigest(), "manifest_files": len(manifest),
        "train_bin_sha256": file_sha256(out / "train.bin"),
        "tokenizer_sha256": file_sha256(out / "tokenizer" / "tokenizer.json"),
        "heldout": {"shipped_files": len(shipped), "sampled_files": len(heldout_rows),
                    "sampled_bytes": sum(r["bytes"] for r in heldout_rows),
                    "fraction": heldout_fraction, "max_bytes": heldout_bytes},
        "decontamination": decon, "summary": summary, "seconds": round(time.time() - t0, 1),
        "python": sys.version.split()[0],
    }
    atomic_write_bytes(out / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    log(f"train.bin {train.size / 1e6:.1f}M tokens from {used} files ({time.time() - t0:.0f}s)")
    return meta


def _heldout_name(i: int, shipped: list[dict], sampled: list[dict]) -> str:
    if i < 0:
        return ""
    return shipped[i]["path"] if i < len(shipped) else sampled[i - len(shipped)]["path"]


def machine_summary(manifest: list[dict], top: int = 25) -> dict:
    """Files and bytes per split, per extension (training files) and the largest training origins."""
    splits: dict = {}
    exts: dict = {}
    origins: dict = {}
    for m in manifest:
        s = splits.setdefault(m["split"], {"files": 0, "bytes": 0})
        s["files"] += 1
        s["bytes"] += m["bytes"]
        if m["split"] == "train":
            e = exts.setdefault(Path(m["path"]).suffix, {"files": 0, "bytes": 0})
            e["files"] += 1
            e["bytes"] += m["bytes"]
            o = origins.setdefault(m["origin"].split("|")[-1], {"files": 0, "bytes": 0})
            o["files"] += 1
            o["bytes"] += m["bytes"]
    big = dict(sorted(origins.items(), key=lambda kv: -kv[1]["bytes"])[:top])
    return {"splits": splits, "extensions": exts, "top_origins": big, "origins_total": len(origins)}

