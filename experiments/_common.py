"""Shared plumbing of the experiment scripts: arguments, model and text loading, writing tables."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]

OUTPUTS = """outputs: by default every table and figure goes to runs/{name}/ (relative to the working directory;
runs/ is ignored by git), so a trial run never touches the committed results. The committed tables
and figures in results/{name}/ are rewritten only when asked for by name: --out results/{name}
(from the repository root). --replot redraws the figures from the tables already in --out."""


def parser(description: str, name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, epilog=OUTPUTS.format(name=name),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded", help="'embedded' or a Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="float32", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--text", default=None, help=".txt / .jsonl text (default: the held-out code)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--num-sequences", type=int, default=16,
                   help="sequences drawn one per document round-robin, each past the document's header")
    p.add_argument("--out", type=Path, default=Path("runs") / name,
                   help=f"output directory (default: runs/{name}, ignored by git; the committed results: "
                        f"--out results/{name})")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the figures from the tables already in --out (no model run)")
    return p


def read_table(out: Path, stem: str) -> pd.DataFrame:
    """A table an earlier run wrote to `out` (for --replot); exits with one line if it is missing."""
    f = out / f"{stem}.csv"
    if not f.is_file():
        print(f"error: --replot needs {f}; run the experiment with --out {out} first", file=sys.stderr)
        raise SystemExit(2)
    return pd.read_csv(f)


def load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """-> (model, tokenizer, input_ids [N, T])."""
    model, tok, sample = load_sample(args)
    return model, tok, sample.input_ids


def load_sample(args: argparse.Namespace, seq_len: int | None = None) -> tuple[Any, Any, Any]:
    """-> (model, tokenizer, TextSample of `seq_len` (default --seq-len) tokens); the text is drawn
    before the model loads, so a source too short for the sequences fails first."""
    from snapquant.eval.fidelity import fidelity_sample
    from snapquant.eval.model import load_model, load_tokenizer

    sample = fidelity_sample(load_tokenizer(args.model), args.text, seq_len or args.seq_len, args.num_sequences)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    return model, tok, sample


def md_table(df: pd.DataFrame, floatfmt: str = ".4g") -> str:
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(format(v, floatfmt) if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def write(out: Path, stem: str, df: pd.DataFrame, title: str, notes: str = "", meta: dict | None = None) -> None:
    """table `stem`.md (with title, notes and run metadata) and `stem`.csv, written atomically."""
    from snapquant.atomic import atomic_write_text
    from snapquant.environment import environment

    out.mkdir(parents=True, exist_ok=True)
    info = {"written": time.strftime("%Y-%m-%d %H:%M:%S"), **(meta or {})}
    env = environment()
    info["torch"] = env["packages"]["torch"]
    info["transformers"] = env["packages"]["transformers"]
    info["git_commit"] = env["git_commit"]  # what `scripts/reproduce.py --stale` compares with the code
    info["hardware"] = (env["hardware"]["gpus"][0]["name"] if env["hardware"]["gpus"]
                        else f"CPU x{env['hardware']['cpu_count']}")
    text = f"# {title}\n\n{notes.strip()}\n\n{md_table(df)}\n```\n{json.dumps(info, indent=1)}\n```\n"
    atomic_write_text(out / f"{stem}.md", text)
    atomic_write_text(out / f"{stem}.csv", df.to_csv(index=False))
