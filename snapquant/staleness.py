"""Which committed results are older than the code that produces them (`scripts/reproduce.py --stale`).

A results file records the commit it was produced at (`environment.git_commit()`: `"git_commit"` or
`"commit"` in JSON, `git_commit <sha>` / `commit <sha>` in Markdown and logs). A figure or table that
records none takes the commit another file of the same job records (one run wrote them together); when no
file of the job records one, the commit that last committed the file stands in for it: the result cannot
be newer than that, so a stale verdict still holds (the report says which source each commit came from).

A result is stale when a commit after its recorded one touches its job's code: the script and the paths
the job declares (`Job.code_paths`). Only git is read; nothing is run.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TEXT_COMMIT = re.compile(r"""\b(?:git_commit|commit)[\s"':=|`]*([0-9a-f]{7,40})\b""")
_KEYS = ("git_commit", "commit")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def _json_commits(value: Any) -> list[str]:
    if isinstance(value, dict):
        found = [v for k, v in value.items() if k in _KEYS and isinstance(v, str)]
        return found + [c for v in value.values() for c in _json_commits(v)]
    if isinstance(value, list):
        return [c for v in value for c in _json_commits(v)]
    return []


def recorded_commit(path: Path) -> str | None:
    """The commit `path` says it was produced at (the first one it names), or None."""
    if path.suffix in (".png", ".pdf"):
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    docs: list[Any] = []
    if path.suffix == ".json":
        try:
            docs = [json.loads(text)]
        except ValueError:
            docs = []
    elif path.suffix == ".jsonl":
        for line in text.splitlines():
            try:
                docs.append(json.loads(line))
            except ValueError:
                continue
    for doc in docs:
        for c in _json_commits(doc):
            if re.fullmatch(r"[0-9a-f]{7,40}", c):
                return c
    m = _TEXT_COMMIT.search(text)
    return m.group(1) if m else None


@dataclass(frozen=True)
class Verdict:
    """One job's committed files that share a recorded commit, and whether code changed since."""

    job: Any  # snapquant.reproduce.Job
    files: tuple[str, ...]
    commit: str | None  # full sha, None when git does not know the recorded one
    source: str  # where the commit comes from: "recorded by n of m files", the file's own commit, or unknown
    later: int  # commits after `commit` that touch the job's code
    newest: str  # "<sha> <date> <subject>" of the newest of them, "" when none

    @property
    def stale(self) -> bool:
        return self.later > 0 or self.commit is None

    def line(self) -> str:
        names = [Path(f).name for f in self.files]
        files = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        if self.commit is None:
            return f"  UNKNOWN {self.job.folder}: {files}: {self.source}, not in this repository's history"
        head = f"{self.commit[:7]} ({self.source})"
        if not self.later:
            return f"  current {self.job.folder}: {files} @ {head}"
        return (f"  STALE   {self.job.folder}: {files} @ {head}: {self.later} later commit(s) touch its code, "
                f"newest {self.newest}")


def stale_report(jobs: tuple, claimed_by: Callable[[str], list], committed: list[str], root: Path) -> list[Verdict]:
    """One Verdict per (job, commit) among the `committed` results files (paths relative to `root`);
    `claimed_by(path)` names the jobs that write a file (`snapquant.reproduce.claimed_by`)."""
    by_job: dict[int, list[str]] = {}
    for f in committed:
        for job in claimed_by(f):
            by_job.setdefault(jobs.index(job), []).append(f)
    out = []
    for i, files in sorted(by_job.items()):
        job = jobs[i]
        own = {f: recorded_commit(root / f) for f in files}
        job_commit = next((c for c in own.values() if c), None)
        groups: dict[str | None, list[str]] = {}
        sources: dict[str | None, str] = {}
        for f, c in own.items():
            sha = c or job_commit or _git(root, "log", "-1", "--format=%H", "--", f) or None
            groups.setdefault(sha, []).append(f)
            if c or job_commit:
                sources[sha] = f"recorded by {sum(1 for x in own.values() if x == sha)} of {len(files)} files"
            else:
                sources[sha] = "none recorded: the file's own commit"
        for sha, group in groups.items():
            source = sources[sha]
            full = None
            if sha:
                try:
                    full = _git(root, "rev-parse", "--verify", "--quiet", f"{sha}^{{commit}}")
                except subprocess.CalledProcessError:
                    full = None
            if full is None:
                out.append(Verdict(job, tuple(group), None, f"unknown commit {sha}", 0, ""))
                continue
            paths = [p for p in job.code_paths if (root / p).exists()]
            later = int(_git(root, "rev-list", "--count", f"{full}..HEAD", "--", *paths) or 0) if paths else 0
            newest = _git(root, "log", "-1", "--format=%h %ad %s", "--date=short", f"{full}..HEAD", "--", *paths) \
                if later else ""
            out.append(Verdict(job, tuple(group), full, source, later, newest[:110]))
    return out
