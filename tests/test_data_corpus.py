"""Corpus selection, held-out exclusion, the shipped manifest, and a small end-to-end build."""

import hashlib
import json

import numpy as np
import pytest

from snapquant.data import build as build_mod
from snapquant.data.corpus import (
    SourceFile,
    content_sha256,
    load_heldout,
    package_roots,
    split_corpus,
)
from snapquant.data.tokenizer import EOS_TOKEN, load_fast_tokenizer
from snapquant.embedded import EMBEDDED_PATH
from snapquant.errors import ConfigError

CODE = "def f(x):\n    '''Double x.'''\n    return 2 * x\n\n\n" + "\n".join(f"Y{i} = f({i})" for i in range(40)) + "\n"


def _file(tmp_path, name, text, origin="stdlib"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    raw = p.read_bytes()
    return SourceFile(name, origin, hashlib.sha256(raw).hexdigest(), len(raw), str(p))


def test_heldout_files_are_intact_and_sized():
    rows = load_heldout()
    assert 20 <= len(rows) <= 60
    assert 200_000 <= sum(r["bytes"] for r in rows) <= 500_000
    assert len({r["path"] for r in rows}) == len(rows)
    for r in rows:
        assert content_sha256(r["text"]) == r["sha256"]
        assert "test" not in r["path"]
        compile(r["text"], r["path"], "exec")


def test_split_excludes_heldout_duplicates_and_junk(tmp_path):
    files = [
        _file(tmp_path, "a.py", CODE),
        _file(tmp_path, "held.py", CODE.replace("Y", "Z")),
        _file(tmp_path, "vendored_copy.py", CODE),  # same text as a.py under another path
        _file(tmp_path, "tiny.py", "x = 1\n"),
        _file(tmp_path, "py2.py", CODE + "print 'hello'\n"),
        _file(tmp_path, "blob.py", CODE + "D = '" + "x" * 2000 + "'\n"),
    ]
    manifest, texts = split_corpus(files, {content_sha256(CODE.replace("Y", "Z"))})
    splits = {e.path: e.split for e in manifest}
    assert splits == {"a.py": "train", "held.py": "heldout", "vendored_copy.py": "excluded:duplicate",
                      "tiny.py": "excluded:too_small", "py2.py": "excluded:syntax",
                      "blob.py": "excluded:long_line"}
    assert list(texts.values()) == [CODE]


def test_pinned_version_mismatch_is_an_error():
    with pytest.raises(ConfigError, match="pytest"):
        package_roots({"pytest": ("_pytest", "0.0.1")})
    with pytest.raises(ConfigError, match="not installed"):
        package_roots({"surely-not-a-package-xyz": ("xyz", "1.0")})


def test_shipped_manifest_never_trains_on_heldout():
    manifest_path = EMBEDDED_PATH / "corpus_manifest.jsonl"
    meta = json.loads((EMBEDDED_PATH / "corpus_meta.json").read_text())
    text = manifest_path.read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest() == meta["manifest_sha256"]
    entries = [json.loads(line) for line in text.splitlines()]
    # Decontamination dropped some held-out files from evaluation; training still never saw them.
    held = {r["sha256"] for r in load_heldout(include_dropped=True)}
    assert {r["sha256"] for r in load_heldout()} < held
    train = [e for e in entries if e["split"] == "train"]
    assert len(train) == meta["train_files"]
    assert not held & {e["sha256"] for e in train}
    assert held == {e["sha256"] for e in entries if e["split"] == "heldout"}
    assert sum(e["bytes"] for e in train) == meta["train_bytes"]
    assert meta["tokenizer_sha256"] == build_mod.file_sha256(EMBEDDED_PATH / "tokenizer.json")


def test_build_corpus_end_to_end(tmp_path, monkeypatch):
    files = [_file(tmp_path, f"m{i}.py", CODE.replace("Y", f"V{i}_")) for i in range(12)]
    monkeypatch.setattr(build_mod, "iter_source_files", lambda *a, **k: iter(files))
    meta = build_mod.build_corpus(tmp_path / "corpus", vocab_size=400, max_train_tokens=2000, log=lambda m: None)
    train, val, meta2 = build_mod.load_corpus(tmp_path / "corpus", verify=True)
    assert meta == meta2 and train.size == meta["train_tokens"] <= 2000
    assert meta["train_files"] < 12  # the token budget cut whole files
    manifest = [json.loads(x) for x in (tmp_path / "corpus" / "manifest.jsonl").read_text().splitlines()]
    assert sum(e["split"] == "excluded:token_budget" for e in manifest) == 12 - meta["train_files"]
    tok = load_fast_tokenizer(tmp_path / "corpus" / "tokenizer")
    eos = tok.token_to_id(EOS_TOKEN)
    docs = tok.decode(train.tolist(), skip_special_tokens=False).split(EOS_TOKEN)
    assert docs[-1] == "" and all(d in {f.read() for f in files} for d in docs[:-1])
    assert int(np.sum(train == eos)) == meta["train_files"]
    assert val.size > 1000
    raw = train.tobytes()
    (tmp_path / "corpus" / "train.bin").write_bytes(bytes([raw[0] ^ 1]) + raw[1:])
    with pytest.raises(ConfigError, match="sha256"):
        build_mod.load_corpus(tmp_path / "corpus", verify=True)
