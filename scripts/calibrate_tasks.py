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
"""

from __future__ import annotations

import argparse
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
    model, tok = load_embedded(dtype="float32")
    rows = calibration.calibrate(model, tok, settings, args.n, compare=args.compare,
                                 target_effect=args.target_effect, seed=args.seed, batch_size=args.batch_size,
                                 max_new_tokens=args.max_new_tokens or None, loglikelihood=args.loglikelihood)
    wall = time.perf_counter() - t0
    env = environment()
    run = {"command": "python scripts/calibrate_tasks.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "wall_s": round(wall, 1), "documents_per_setting": args.n,
           "max_new_tokens": args.max_new_tokens or "task's own", "seed": args.seed,
           **({"loglikelihood": args.loglikelihood} if any(s.task in calibration.MULTIPLE_CHOICE for s in settings)
              else {}),
           "torch_threads": torch.get_num_threads(), "python": env["python"],
           "torch": env["packages"].get("torch"), "transformers": env["packages"].get("transformers"),
           "hardware": f"{env['hardware'].get('platform')}, {env['hardware'].get('cpu_count')} CPUs",
           "commit": env["git_commit"]}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.output_dir / "calibration.json", {"model": MODEL, "run": run, "rows": rows})
    atomic_write_csv(args.output_dir / "calibration.csv", pd.DataFrame(rows, columns=calibration.CSV_COLUMNS),
                     index=False)
    meta = {"model": MODEL, "device": "cpu", **run}
    atomic_write_text(args.output_dir / "calibration.md", calibration.to_markdown(rows, meta, args.target_effect))
    print(f"wrote {args.output_dir}/calibration.md and .csv in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
