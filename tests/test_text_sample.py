"""The fidelity text sampler: headers skipped, rows spread over documents, origins exact, errors clear."""

from __future__ import annotations

import ast
import json
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest

from snapquant.analysis.text_sample import PER_DOCUMENT, STREAM, header_end, sample_sequences
from snapquant.errors import ConfigError


class CharTokenizer:
    """One token per character (id = code point + 1, EOS = 0): offsets in tokens are offsets in characters."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [ord(c) + 1 for c in text]}

    def decode(self, ids):
        return "".join(chr(int(i) - 1) for i in ids if int(i))


SYNTHETIC = [
    # (source, the first line of its body)
    ("#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\n# Copyright 2001 Someone\n# Licensed under X\n\n"
     '"""Module docstring.\n\nMore words.\n"""\n\n# a comment after it\n\nimport os\n', "import os\n"),
    ('"""One-line docstring."""\nfrom __future__ import annotations\n', "from __future__ import annotations\n"),
    ("'single quotes docstring'\n\n\nx = 1\n", "x = 1\n"),
    ("import sys\n\"\"\"not a docstring: code comes first\"\"\"\n", "import sys\n"),
    ("# licence only\n\n# vim: set ts=4:\ndef f():\n    '''a function docstring is code'''\n", "def f():\n"),
    ("__doc__ = 'an assignment is code'\n", "__doc__ = 'an assignment is code'\n"),
]


@pytest.mark.parametrize(("text", "first"), SYNTHETIC)
def test_header_end_on_synthetic_sources(text, first):
    h = header_end(text)
    assert text[h:].startswith(first) and text[h:].splitlines(keepends=True)[0] == first


def test_header_end_edge_cases():
    assert header_end("# only a comment\n\n") == len("# only a comment\n\n")  # all header
    assert header_end('"""only a docstring"""\n') == len('"""only a docstring"""\n')
    assert header_end("") == 0
    prose = "# A title\n\nSome prose that is not Python: it does not parse.\n"
    assert header_end(prose) == 0  # not code: a '#' heading is content


def _heldout():
    from snapquant.data.corpus import load_heldout

    return load_heldout()


def test_header_end_on_every_held_out_file():
    """The header holds no code and the body starts with code, on every shipped held-out file."""
    for row in _heldout():
        text = row["text"]
        h = header_end(text)
        head, body = text[:h], text[h:]
        assert h == 0 or text[h - 1] == "\n", row["path"]  # a line boundary
        stmts = ast.parse(head).body
        assert len(stmts) <= 1 and all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in stmts), \
            row["path"]  # nothing but the docstring (comments are not statements)
        first = body.lstrip("\n").splitlines()[0]
        assert first.strip() and not first.lstrip().startswith("#"), row["path"]
        tree = ast.parse(body)
        assert tree.body and not (isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)
                                  and isinstance(tree.body[0].value.value, str)), row["path"]


@pytest.mark.parametrize(("path", "first"), [
    ("email/errors.py", "class MessageError(Exception):"),  # copyright comments, then the docstring
    ("lib2to3/fixes/fix_dict.py", "from .. import pytree"),  # licence comments before the docstring
    ("turtledemo/fractalcurves.py", "from turtle import *"),  # shebang
    ("html/parser.py", "import re"),  # docstring, then a comment block
    ("ensurepip/__init__.py", "import collections"),  # no header at all
])
def test_header_end_on_known_held_out_files(path, first):
    row = next(r for r in _heldout() if r["path"] == path)
    assert row["text"][header_end(row["text"]):].startswith(first)


def _jsonl(tmp_path, docs, name="docs.jsonl"):
    f = tmp_path / name
    f.write_text("".join(json.dumps({"path": n, "text": t}) + "\n" for n, t in docs))
    return f


def _code(i: int, lines: int) -> str:
    return f"# licence of file {i}\n" + "".join(f"v{i}_{j} = {j}\n" for j in range(lines))


def test_rows_are_the_recorded_slices_of_the_documents_past_their_headers(tmp_path):
    docs = [(f"f{i}.py", _code(i, 20 + 7 * i)) for i in range(6)]
    s = sample_sequences(CharTokenizer(), _jsonl(tmp_path, docs), 40, 9, seed=3)
    assert s.method == PER_DOCUMENT and s.input_ids.shape == (9, 40)
    texts = dict(docs)
    for o, row in zip(s.origins, s.input_ids, strict=True):
        text = texts[o.document]
        body = text[header_end(text):]
        assert CharTokenizer().decode(row) == body[o.token_offset:o.token_offset + 40]
        assert o.line == text.count("\n", 0, header_end(text) + o.token_offset) + 1
        assert o.spans == f"{o.document}[{o.token_offset}:{o.token_offset + 40}]"
        assert s.locate(o.row, 5) == (o.document, o.token_offset + 5)
    # round-robin: 9 rows over 6 documents -> every document one, three give a second, none a third
    counts = Counter(o.document for o in s.origins)
    assert len(counts) == 6 and sorted(counts.values()) == [1, 1, 1, 2, 2, 2]
    for name in counts:  # a document's rows never overlap
        offs = sorted(o.token_offset for o in s.origins if o.document == name)
        assert all(b - a >= 40 for a, b in pairwise(offs))


def test_sampling_is_deterministic_and_the_seed_moves_it(tmp_path):
    src = _jsonl(tmp_path, [(f"f{i}.py", _code(i, 60)) for i in range(30)])
    a, b = (sample_sequences(CharTokenizer(), src, 64, 16, seed=0) for _ in range(2))
    c = sample_sequences(CharTokenizer(), src, 64, 16, seed=1)
    assert a.input_ids.equal(b.input_ids) and a.records() == b.records()
    assert not a.input_ids.equal(c.input_ids)
    assert len({o.document for o in a.origins}) == 16  # fewer rows than documents: one each
    assert {o.document for o in a.origins} != {o.document for o in c.origins}  # which documents is seeded too


def test_held_out_default_spreads_over_files_past_their_headers():
    from snapquant.embedded import EMBEDDED_PATH, load_tokenizer
    from snapquant.eval.fidelity import fidelity_sample

    if not (EMBEDDED_PATH / "tokenizer.json").is_file():
        pytest.skip("no embedded tokenizer in this checkout")
    tok = load_tokenizer()
    s = fidelity_sample(tok, None, 128, 16)
    assert s.method == PER_DOCUMENT and s.source == "snapquant/eval/tasks/data/heldout_code.jsonl"
    assert len({o.document for o in s.origins}) == 16  # 16 of the 22 files, one row each
    texts = {r["path"]: r["text"] for r in _heldout()}
    for o, row in zip(s.origins, s.input_ids, strict=True):
        text = texts[o.document]
        h = header_end(text)
        body_ids = tok(text[h:], add_special_tokens=False)["input_ids"]
        assert row.tolist() == body_ids[o.token_offset:o.token_offset + 128]  # the body, never the header
        line_start = text.rfind("\n", 0, h + len(tok.decode(body_ids[:o.token_offset]))) + 1
        assert text[:line_start].count("\n") + 1 == o.line and line_start >= h


def test_short_documents_fall_back_to_the_stream_and_record_every_span(tmp_path):
    docs = [(f"s{i}.py", _code(i, 3)) for i in range(12)]  # each body ~30 characters < seq_len
    s = sample_sequences(CharTokenizer(), _jsonl(tmp_path, docs), 50, 4, seed=0)
    assert s.method == STREAM
    texts = dict(docs)
    for o, row in zip(s.origins, s.input_ids, strict=True):
        assert " | " in o.spans  # a 50-token row spans several 30-token documents
        for col in range(50):
            tok = int(row[col])
            name, off = s.locate(o.row, col)
            body = texts[name][header_end(texts[name]):]
            assert (tok == 0 and off == len(body)) or chr(tok - 1) == body[off]  # EOS ends its document


def test_a_single_text_file_gives_non_overlapping_windows(tmp_path):
    f = tmp_path / "prose.txt"
    f.write_text("".join(f"Sentence number {i} of plain prose.\n" for i in range(100)))
    s = sample_sequences(CharTokenizer(), f, 100, 5, seed=0)
    assert s.method == PER_DOCUMENT and {o.document for o in s.origins} == {"prose.txt"}
    offs = sorted(o.token_offset for o in s.origins)
    assert all(b - a >= 100 for a, b in pairwise(offs))
    assert CharTokenizer().decode(s.input_ids[0]) in f.read_text()


def test_too_short_source_is_one_clear_error(tmp_path):
    src = _jsonl(tmp_path, [("a.py", _code(0, 5)), ("b.py", _code(1, 5))])
    with pytest.raises(ConfigError) as e:
        sample_sequences(CharTokenizer(), src, 64, 4)
    msg = str(e.value)
    assert "\n" not in msg and str(src) in msg and "seq_len=64" in msg and "4 sequences" in msg
    n_tokens = sum(len(t) - header_end(t) + 1 for t in (_code(0, 5), _code(1, 5)))  # + one EOS each
    assert f"hold {n_tokens} tokens" in msg and f"enough for {n_tokens // 64}" in msg


def test_sweep_validation_reports_a_too_short_source_before_the_model_loads(tmp_path):
    from snapquant.embedded import EMBEDDED_PATH, has_weights
    from snapquant.sweep.evaluate import LmEvalEvaluator
    from snapquant.sweep.grid import expand
    from snapquant.sweep.schema import SweepSpec

    if not has_weights(EMBEDDED_PATH):
        pytest.skip("no embedded weights in this checkout")
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n" * 20)
    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"model: embedded\ntasks: [sq_code_completion]\npresets: [bf16, snapmla]\nfidelity: {{source: {short}, seq_len: 64}}\n")
    spec = SweepSpec.from_yaml(cfg)

    def no_model(*a, **k):
        raise AssertionError("the model must not load")

    ev = LmEvalEvaluator(model_loader=no_model)
    errs = ev.validate(spec, expand(spec).cells)
    assert any(e.startswith("fidelity: ") and "cannot give 16 sequences of seq_len=64" in e for e in errs), errs


def test_binned_means_value_is_the_pooled_mean_and_degenerate_bins_are_explicit():
    from snapquant.analysis.uncertainty import binned_means

    rng = np.random.default_rng(0)
    v = rng.exponential(size=(5, 40))
    pos = np.arange(10, 50)
    est = binned_means(v, pos, [10, 16, 32, 50, 64])
    assert [(e.lo, e.hi) for e in est] == [(10, 16), (16, 32), (32, 50)]  # [50, 64) has no positions
    for e in est:
        cols = (pos >= e.lo) & (pos < e.hi)
        assert e.value == pytest.approx(v[:, cols].mean(), rel=1e-12)
        assert e.n_sequences == 5 and e.n_positions == 5 * cols.sum()
        assert e.ci_low < e.value < e.ci_high
    flat = binned_means(np.zeros((4, 8)), np.arange(8), [0, 8])[0]
    assert (flat.value, flat.ci_low, flat.ci_high) == (0.0, 0.0, 0.0)
    one = binned_means(v[:1], pos, [10, 50])[0]
    assert np.isnan(one.ci_low) and np.isnan(one.ci_high)
    with pytest.raises(ValueError):
        binned_means(v, pos[:-1], [10, 50])


def test_binned_means_interval_covers_the_true_mean():
    """Coverage of the 95% cluster-bootstrap CI on sequences whose positions share a sequence effect:
    percentile intervals of a mean of 16 clusters cover about 93% (slightly anti-conservative); 400
    draws put the binomial sd near 1.3 points, so [0.88, 0.99] fails only for a broken interval."""
    from snapquant.analysis.uncertainty import binned_means

    rng = np.random.default_rng(1)
    hits = 0
    for i in range(400):
        effect = rng.normal(size=(16, 1))  # per-sequence level: positions of one sequence are correlated
        v = 1.0 + effect + 0.5 * rng.normal(size=(16, 30))
        e = binned_means(v, np.arange(30), [0, 30], n_resamples=999, seed=i)[0]
        hits += e.ci_low <= 1.0 <= e.ci_high
    assert 0.88 <= hits / 400 <= 0.99
