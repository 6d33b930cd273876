"""Calibrate the offline tasks' difficulty knobs on the embedded model (CPU, float32, unpatched).

Each SETTING is a task and its metadata knobs, `TASK[:key=value,...]`; every setting is scored on
its first N documents, optionally also with a quantized cache (`--compare PRESET`) on the same
documents to measure the discordance that sets the experiments' sample sizes. Writes
`calibration.json` (rows and the run that made them), `calibration.csv` and `calibration.md`
under --output-dir (default results/tasks).

    python scripts/calibrate_tasks.py --n 100 --compare per_tensor_fp8 \\
        sq_kv_retrieval_1k sq_code_completion
    python scripts/calibrate_tasks.py --n 40 sq_kv_retrieval_1k:kv_digits=10 sq_code_completion:completion_prefix=0
    python scripts/calibrate_tasks.py --n 100 sq_code_completion_mc:mc_choices=8,mc_distractors=other_files
    python scripts/calibrate_tasks.py --n 40 sq_passkey_code:max_seq_lengths=1024,passkey_distractors=2

A multiple-choice task (sq_code_completion_mc) is scored by loglikelihood (lm-eval's acc; --max-new-tokens
does not apply), by default read through the cache as serving reads it (`--loglikelihood decode`: each
context prefilled once, its choices teacher-forced one decode step at a time, so the --compare preset's
decode steps read its quantized cache); `--loglikelihood forward` is lm-eval's one forward pass per
choice, on which a `prefill: bf16` preset scores exactly what the unpatched model scores (discordance 0).

The files are rewritten after every setting (a partial table says how many settings it holds), so a long
run that is stopped keeps what it finished; `--resume` keeps the rows of --output-dir's calibration.json
that were scored with the same arguments (n, seed, compared preset, token cap, loglikelihood path, torch
threads) at a commit whose snapquant/ and this script equal the checkout's, and scores only the rest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from snapquant.atomic import atomic_write_csv, atomic_write_json, atomic_write_text
from snapquant.environment import environment
from snapquant.errors import ConfigError
from snapquant.eval import calibration
from snapquant.eval.tasks import sq_utils

MODEL = "embedded, float32, unpatched (what the bf16 preset runs: it quantizes nothing)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("settings", nargs="+", help="TASK or TASK:key=value,... (task metadata knobs)")
    p.add_argument("--n", type=int, default=100, help="documents per setting")
    p.add_argument("--compare", default=None, help="a preset scored on the same documents (discordance, MDE)")
    p.add_argument("--target-effect", type=float, default=0.05, help="drop the sample sizes are set for")
    p.add_argument("--seed", type=int, default=sq_utils.DEFAULT_SEED)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="cap on generated tokens (0: each task's own budget; a cap can cut answers)")
    p.add_argument("--loglikelihood", choices=("decode", "forward"), default="decode",
                   help="how a multiple-choice task's loglikelihoods are read (both models alike)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--output-dir", type=Path, default=Path("results/tasks"))
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of --output-dir's calibration.json scored with these arguments at the same "
                        "code (snapquant/ and this script unchanged since their commit); score the other settings")
    args = p.parse_args(argv)
    try:
        settings = [calibration.parse_setting(s) for s in args.settings]
        for s in settings:  # every setting checked before the model loads
            calibration.build(s, 1, args.seed)
        if args.compare:
            from snapquant.presets import resolve_config

            resolve_config(args.compare)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import torch

    from snapquant import load_embedded

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    env = environment()
    run = {"command": "python scripts/calibrate_tasks.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "wall_s": 0.0, "documents_per_setting": args.n,
           "max_new_tokens": args.max_new_tokens or "task's own", "seed": args.seed,
           **({"loglikelihood": args.loglikelihood} if any(s.task in calibration.MULTIPLE_CHOICE for s in settings)
              else {}),
           "target_effect": args.target_effect, "torch_threads": torch.get_num_threads(), "python": env["python"],
           "torch": env["packages"].get("torch"), "transformers": env["packages"].get("transformers"),
           "hardware": f"{env['hardware'].get('platform')}, {env['hardware'].get('cpu_count')} CPUs",
           "commit": env["git_commit"]}
    kept = resumable(args.output_dir / "calibration.json", run, args.compare) if args.resume else {}
    model, tok = load_embedded(dtype="float32")
    rows: list[dict] = []
    resumed_from: set[str] = set()
    for i, s in enumerate(settings):
        if (s.task, s.label()) in kept:
            row, commit = kept[(s.task, s.label())]
            rows.append(row)
            resumed_from.add(commit)
            print(f"{s.task} {s.label()}: kept from the earlier run at {commit[:7]} (--resume)")
        else:
            rows += [{**r, "commit": run["commit"]} for r in calibration.calibrate(
                model, tok, [s], args.n, compare=args.compare, target_effect=args.target_effect, seed=args.seed,
                batch_size=args.batch_size, max_new_tokens=args.max_new_tokens or None,
                loglikelihood=args.loglikelihood)]
        run["wall_s"] = round(time.perf_counter() - t0, 1)
        extra = {}
        if i + 1 < len(settings):
            extra["partial"] = f"{i + 1} of {len(settings)} settings (rerun with --resume to finish)"
        if resumed_from:
            extra["resumed"] = (f"rows kept from the runs at {', '.join(sorted(c[:7] for c in resumed_from))} "
                                "(snapquant/ and this script unchanged since)")
        write(args.output_dir, rows, {**run, **extra}, args.target_effect)
    wall = run["wall_s"]
    print(f"wrote {args.output_dir}/calibration.md and .csv in {wall:.0f} s")
    return 0


def write(out: Path, rows: list[dict], run: dict, target_effect: float) -> None:
    """calibration.json, .csv and .md under `out` (each atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "calibration.json", {"model": MODEL, "run": run, "rows": rows})
    atomic_write_csv(out / "calibration.csv", pd.DataFrame(rows, columns=calibration.CSV_COLUMNS), index=False)
    atomic_write_text(out / "calibration.md", calibration.to_markdown(rows, {"model": MODEL, "device": "cpu", **run},
                                                                      target_effect))


# What a kept row must share with this run (besides the code): the arguments that change a score.
SAME = ("documents_per_setting", "max_new_tokens", "seed", "loglikelihood", "target_effect", "torch_threads")


def resumable(path: Path, run: dict, compare: str | None) -> dict[tuple[str, str], tuple[dict, str]]:
    """(task, knobs label) -> (row, commit) of the rows in `path` that this run may keep: scored with the
    same arguments (SAME, the compared preset) at a commit from which snapquant/ and this script have not
    changed in the checkout (`git diff --quiet COMMIT -- ...`, uncommitted edits included)."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    prev = old.get("run") or {}
    commit = prev.get("commit")
    if not commit or any(prev.get(k) != run.get(k) for k in SAME if k in run or k in prev):
        print(f"--resume: {path} was scored with other arguments; scoring every setting")
        return {}
    if not code_unchanged(commit):
        print(f"--resume: the code changed since {commit[:7]} (or it is unknown here); scoring every setting")
        return {}
    return {(r["task"], r["knobs"]): (r, r.get("commit") or commit) for r in old.get("rows", [])
            if (r.get("compare") or None) == compare}



def code_unchanged(commit: str) -> bool:
    """snapquant/ and this script in the checkout (uncommitted edits included) equal those at `commit`;
    False also when git or the commit is not there."""
    root = Path(__file__).resolve().parents[1]
    try:
        return subprocess.run(["git", "diff", "--quiet", commit, "--", "snapquant", "scripts/calibrate_tasks.py"],
                              cwd=root, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False

if __name__ == "__main__":
    sys.exit(main())
