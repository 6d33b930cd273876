"""Build the tokenized training corpus: manifest, tokenizer, `train.bin` (uint16) and `meta.json`.

Run once here (`python scripts/train_embedded_model.py build-data`); the training machine only
reads the result, carried as an ignored folder (`build/corpus`).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes, atomic_write_json
from ..errors import ConfigError
from .corpus import (
    iter_source_files,
    load_heldout,
    manifest_summary,
    split_corpus,
    write_manifest,
)
from .tokenizer import EOS_TOKEN, build_bpe, save_hf_tokenizer

TOKEN_DTYPE = np.uint16  # vocab sizes up to 65535


def file_sha256(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def encode_documents(tok, texts: list[str], eos_id: int, batch: int = 256) -> np.ndarray:
    """Encode texts and join them, each followed by EOS, into one uint16 array."""
    if tok.get_vocab_size() > np.iinfo(TOKEN_DTYPE).max:
        raise ConfigError(f"vocab_size={tok.get_vocab_size()} does not fit uint16 token storage")
    parts: list[np.ndarray] = []
    eos = np.array([eos_id], dtype=TOKEN_DTYPE)
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i:i + batch], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=TOKEN_DTYPE))
            parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=TOKEN_DTYPE)


def build_corpus(out_dir: Path | str, vocab_size: int = 8192, max_train_tokens: int = 18_000_000,
                 tokenizer_train_bytes: int = 40_000_000, include_packages: bool = True,
                 strict_versions: bool = True, seed: int = 0, log=print) -> dict:
    """Build everything the trainer needs into `out_dir`; returns the meta dict (also meta.json).

    Files are shuffled with `seed` before the token budget is applied, so a budget cut drops a
    random (recorded) subset rather than whole packages.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # With the files decontamination dropped: they stay out of training (and in val.bin), so a
    # rebuild reproduces the shipped manifest and corpus.
    heldout = load_heldout(include_dropped=True)
    heldout_hashes = {r["sha256"] for r in heldout}
    manifest, train_texts = split_corpus(iter_source_files(include_packages, strict_versions), heldout_hashes)
    missing = heldout_hashes - {e.sha256 for e in manifest if e.split == "heldout"}
    if missing:
        # A held-out file no longer in the stdlib is fine (still excluded); say so for the record.
        log(f"note: {len(missing)} held-out files were not found among the sources")
    train_idx = [i for i, e in enumerate(manifest) if e.split == "train"]
    random.Random(f"corpus-order/{seed}").shuffle(train_idx)
    log(f"scanned {len(manifest)} files, {len(train_idx)} for training ({time.time() - t0:.0f}s)")

    texts = [train_texts[i] for i in train_idx]
    tok_texts, acc = [], 0
    for t in texts:
        if acc >= tokenizer_train_bytes:
            break
        tok_texts.append(t)
        acc += len(t)
    tok = build_bpe(tok_texts, vocab_size=vocab_size)
    tok_dir = save_hf_tokenizer(tok, out / "tokenizer")
    eos_id = tok.token_to_id(EOS_TOKEN)
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained on {acc / 1e6:.1f} MB ({time.time() - t0:.0f}s)")

    ids = encode_documents(tok, texts, eos_id)
    # Apply the budget at document granularity and record who was cut.
    kept = len(texts)
    if ids.size > max_train_tokens:
        lengths = [len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False)]
        cum = np.cumsum(lengths)
        kept = int(np.searchsorted(cum, max_train_tokens, side="right"))
        ids = ids[: int(cum[kept - 1])]
        for i in train_idx[kept:]:
            manifest[i] = replace(manifest[i], split="excluded:token_budget")
    atomic_write_bytes(out / "train.bin", ids.tobytes())

    val_ids = encode_documents(tok, [r["text"] for r in heldout], eos_id)
    atomic_write_bytes(out / "val.bin", val_ids.tobytes())
    manifest_sha = write_manifest(manifest, out / "manifest.jsonl")
    train_bytes = sum(manifest[i].bytes for i in train_idx[:kept])
    meta = {
        "format": "snapquant-corpus-v1",
        "dtype": "uint16",
        "train_tokens": int(ids.size),
        "val_tokens": int(val_ids.size),
        "train_files": kept,
        "train_bytes": int(train_bytes),
        "bytes_per_token": round(train_bytes / max(1, ids.size), 4),
        "vocab_size": tok.get_vocab_size(),
        "eos_id": int(eos_id),
        "seed": seed,
        "max_train_tokens": max_train_tokens,
        "include_packages": include_packages,
        "manifest_sha256": manifest_sha,
        "train_bin_sha256": file_sha256(out / "train.bin"),
        "tokenizer_sha256": file_sha256(tok_dir / "tokenizer.json"),
        "summary": manifest_summary(manifest),
        "heldout_files": len(heldout),
    }
    atomic_write_json(out / "meta.json", meta, indent=2)
    log(f"train.bin: {ids.size / 1e6:.2f}M tokens, {train_bytes / ids.size:.2f} bytes/token "
        f"({time.time() - t0:.0f}s)")
    return meta


def load_corpus(corpus_dir: Path | str, verify: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    """Memory-map train.bin and val.bin; check the format (and, optionally, the hash)."""
    d = Path(corpus_dir)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: build the corpus first (build-data)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != "snapquant-corpus-v1":
        raise ConfigError(f"{meta_path}: format={meta.get('format')!r}, expected 'snapquant-corpus-v1'")
    if verify and file_sha256(d / "train.bin") != meta["train_bin_sha256"]:
        raise ConfigError(f"{d / 'train.bin'}: sha256 does not match meta.json (corrupt or partial copy)")
    train = np.memmap(d / "train.bin", dtype=TOKEN_DTYPE, mode="r")
    val = np.fromfile(d / "val.bin", dtype=TOKEN_DTYPE)
    if train.size != meta["train_tokens"]:
        raise ConfigError(f"{d / 'train.bin'} has {train.size} tokens, meta.json says {meta['train_tokens']}")
    return train, val, meta
