"""Write results/claims.md from the committed results tables and, with --readme, the README's copy.

    python scripts/write_claims.py            # results/claims.md
    python scripts/write_claims.py --readme   # and the block between the claims markers in README.md
    python scripts/write_claims.py --check    # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from snapquant.analysis.claims import BEGIN, END, claims_file, quoted_block
from snapquant.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--readme", action="store_true", help="also rewrite the README's quoted block")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    args = p.parse_args()
    text = claims_file(ROOT)
    claims_md, readme = ROOT / "results" / "claims.md", ROOT / "README.md"
    block = quoted_block(text)
    stale = []
    if not claims_md.is_file() or claims_md.read_text() != text:
        stale.append(claims_md)
    rd = readme.read_text()
    try:
        if quoted_block(rd) != block:
            stale.append(readme)
    except ValueError:
        stale.append(readme)
    if args.check:
        for f in stale:
            print(f"{f.relative_to(ROOT)} is out of date: run python scripts/write_claims.py --readme", file=sys.stderr)
        return 1 if stale else 0
    atomic_write_text(claims_md, text)
    print(f"wrote {claims_md.relative_to(ROOT)}")
    if args.readme:
        i, j = rd.find(BEGIN), rd.find(END)
        if i == -1 or j == -1:
            print(f"error: README.md has no {BEGIN} ... {END} block", file=sys.stderr)
            return 2
        atomic_write_text(readme, rd[:i + len(BEGIN)] + "\n" + block + rd[j:])
        print("wrote README.md's claims block")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
