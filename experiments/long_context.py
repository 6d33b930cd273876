"""Long-context fidelity: decode KL and top-1 flip rate of windows at increasing cache depth, up to the model's context.

For each KV-cache config (presets or config files) and each depth d (`--depths`; default from the
model's max_position_embeddings C: powers of two from about 1/16 of the deepest window, 3C/4, and the
deepest window that fits, C - steps - 1: 256, 512, 1024, 2048, 3072, 4063 for the embedded model's
4096), every sequence is prefilled with its first d tokens as served (`prefill: bf16`: the model's own
attention on the fresh activations, the tokens stored in the config's format, its per-tensor /
per-channel scales and KIVI groups formed from those d tokens), then decoded `--steps` tokens step by
step (teacher forcing). Each step's next-token distribution is scored against the unpatched model at
the same position: KL(p_ref || p_quant) and whether the argmax flipped. One unpatched-equivalent
forward per sequence over the longest window gives the reference for every depth and the exact latents
that every depth's prefill stores (`snapquant.eval.fidelity.depth_window_metrics`; they equal a
d-token prefill's up to fp32 summation order, tested; `--prefill-per-depth` runs every prefill through
the patched model instead, slower).

Per (config, depth): mean KL, KL p99 and flip rate over the window's positions of every sequence, each
with a 95% percentile cluster-bootstrap interval over sequences (snapquant.analysis.uncertainty.
cluster_summary) and n; plus, per config, the paired change from the shallowest to the deepest window
(per-sequence differences: jackknife t interval, sign-flip permutation p).
The sequences are the held-out text (snapquant.analysis.text_sample): each inside one held-out file past
its header when enough files hold a whole sequence, else cut from the files concatenated (headers
skipped, EOS between files); `sequences.csv` says which, per sequence, and the table says how many files
hold a whole sequence.

Writes table.md/.csv, depth_change.csv, sequences.csv, top_positions.csv (each config's largest-KL
positions with their depth, file, token offset and context) and long_context.png/.pdf to
runs/long_context/ (the committed copy: --out results/long_context). CPU cost: one forward of the
longest window per sequence, then `steps` decode steps per config and depth, each reading the whole
cache (the reference backend on a CPU; about 30 minutes for 16 sequences, 32 steps and the default configs).

    python experiments/long_context.py [--model embedded|PATH] [--depths 256 1024 4063] [--steps 32]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
from _common import load_sample, parser, read_table, write

from snapquant.analysis.experiment_plots import plot_long_context
from snapquant.analysis.uncertainty import cluster_summary, paired_comparison
from snapquant.errors import ConfigError
from snapquant.eval.fidelity import DEPTH_WINDOW_STEPS, default_depths, depth_window_metrics
from snapquant.eval.model import checkpoint_mla_dims
from snapquant.patching import patched
from snapquant.presets import resolve_config

PRESETS = ("bf16", "snapmla", "per_tensor_fp8", "ds_v32", "fp8_kivi")
STATS = ("kl_mean", "kl_p99", "flip_rate")
TOP_K = 10


def model_context(model: str) -> int:
    """max_position_embeddings of `model`'s config.json (the embedded model's: 4096)."""
    if model == "embedded":
        from snapquant.embedded import EMBEDDED_PATH

        path = EMBEDDED_PATH
    else:
        path = Path(model)
    f = path / "config.json"
    if not f.is_file():
        raise ConfigError(f"--model={model!r}: no config.json in {path}")
    cfg = json.loads(f.read_text())
    n = cfg.get("text_config", cfg).get("max_position_embeddings")
    if not isinstance(n, int):
        raise ConfigError(f"--model={model!r}: config.json has no max_position_embeddings; pass --context")
    return n


def depth_rows(label: str, cfg, m: dict[str, np.ndarray], seconds: float, n_resamples: int) -> list[dict]:
    """One row per depth: each statistic of STATS with its cluster-bootstrap interval over sequences, and n."""
    rows = []
    for d in dict.fromkeys(m["depth"].tolist()):
        cols = m["depth"] == d
        est = cluster_summary({k: v[:, cols] for k, v in m.items() if k not in ("positions", "depth")},
                              n_resamples=n_resamples, statistics=STATS)
        pos = m["positions"][cols]
        row = {"config": label, "causal_consistent": cfg.causal_consistent, "prefill": cfg.prefill, "depth": int(d),
               "first_position": int(pos.min()), "last_position": int(pos.max()),
               "n_sequences": est[0].n_sequences, "n_positions": est[0].n_positions}
        for e in est:
            row.update({e.statistic: e.value, f"{e.statistic}_ci_low": e.ci_low, f"{e.statistic}_ci_high": e.ci_high})
        row["kl_max"] = float(m["kl"][:, cols].max())
        row["config_seconds"] = seconds
        rows.append(row)
    return rows


def depth_change(label: str, m: dict[str, np.ndarray], n_resamples: int) -> list[dict]:
    """Deepest minus shallowest window, per metric: paired over sequences (same sequences, other positions)."""
    lo, hi = int(m["depth"].min()), int(m["depth"].max())
    if lo == hi:
        return []
    out = []
    for metric, key in (("kl_mean", "kl"), ("flip_rate", "flip")):
        a, b = (m[key][:, m["depth"] == d].mean(axis=1) for d in (lo, hi))
        c = paired_comparison(a, b, metric=metric, n_positions=int((m["depth"] == hi).sum()) * a.size,
                              n_resamples=n_resamples)
        out.append({"config": label, "depth_a": lo, "depth_b": hi, "value_a": float(a.mean()),
                    "value_b": float(b.mean()), **c.to_dict()})
    return out


def top_positions(label: str, m: dict[str, np.ndarray], sample, tokenizer, k: int = TOP_K) -> list[dict]:
    """The `k` largest-KL positions of one config: their window, where in the text they are, the context."""
    ids = sample.input_ids
    order = np.argsort(m["kl"], axis=None)[::-1][:k]
    rows = []
    for flat in order:
        r, c = np.unravel_index(flat, m["kl"].shape)
        t = int(m["positions"][c])
        doc, off = sample.locate(int(r), t)
        rows.append({"config": label, "depth": int(m["depth"][c]), "row": int(r), "position": t,
                     "kl": float(m["kl"][r, c]), "flip": bool(m["flip"][r, c]), "document": doc, "token_offset": off,
                     "context": tokenizer.decode(ids[r, max(0, t - 24):t + 1]),
                     "next_token": tokenizer.decode(ids[r, t + 1:t + 2])})
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0], "long_context")
    p.set_defaults(seq_len=None)
    p.add_argument("--preset", "-p", action="append", default=None,
                   help=f"config to measure (preset or config file; repeat); default {', '.join(PRESETS)}")
    p.add_argument("--depths", type=int, nargs="+", default=None,
                   help="cache depths d (tokens prefilled before each window); default from the model's context "
                        "(the embedded model: 256 512 1024 2048 3072 4063)")
    p.add_argument("--steps", type=int, default=DEPTH_WINDOW_STEPS, help="decode steps per window")
    p.add_argument("--context", type=int, default=None,
                   help="the model's context (default its max_position_embeddings): the deepest window must fit")
    p.add_argument("--prefill-per-depth", action="store_true",
                   help="run every depth's prefill through the patched model (default: the first d exact latents "
                        "of one forward, appended as that prefill appends them; equal up to fp32 summation order)")
    p.add_argument("--batch", type=int, default=4,
                   help="sequences decoded together (a per-tensor dynamic scale frozen at the prefill spans the batch)")
    p.add_argument("--n-resamples", type=int, default=2000, help="bootstrap / permutation resamples")
    args = p.parse_args()
    if args.replot:
        print(plot_long_context(read_table(args.out, "table"), args.out))
        return
    t0 = time.perf_counter()
    try:
        configs = {c.label(): c for c in (resolve_config(x) for x in (args.preset or PRESETS))}
        context = args.context or model_context(args.model)
        r, d = checkpoint_mla_dims(args.model)
        for c in configs.values():
            try:
                c.check_dims(r, d)
            except ConfigError as e:
                raise ConfigError(f"--preset {c.label()}: {e} (model kv_lora_rank={r}, rope dim={d})") from None
        for name, v in (("--steps", args.steps), ("--batch", args.batch), ("--num-sequences", args.num_sequences)):
            if v < 1:
                raise ConfigError(f"{name}={v}: expected an integer >= 1")
        depths = sorted(set(args.depths)) if args.depths else default_depths(context, args.steps)
        seq_len = depths[-1] + args.steps + 1
        if depths[0] < 1 or seq_len > context:
            raise ConfigError(f"--depths {' '.join(map(str, depths))} with --steps {args.steps}: every depth must be "
                              f">= 1 and depth + steps + 1 <= {context} (the model's context)")
        model, tok, sample = load_sample(args, seq_len)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    ids = sample.input_ids
    docs = len({o.document for o in sample.origins})
    text_note = (f"{sample.documents_holding_a_row} of {sample.num_documents} held-out files hold a whole "
                 f"{seq_len}-token sequence past their header; ")
    text_note += ("each sequence lies inside one file past its header" if sample.method == "per-document" else
                  f"so the {len(ids)} sequences are cut at seeded non-overlapping offsets from the files concatenated "
                  "(headers skipped, EOS between files): a deep window's context spans several files")
    print(f"{len(ids)} sequences of {seq_len} tokens ({sample.method}, {docs} documents); {text_note}; depths "
          f"{depths}, {args.steps} steps; on {next(model.parameters()).device}", flush=True)
    seconds: dict[str, float] = dict.fromkeys(configs, 0.0)

    def progress(label: str, depth: int, s: float) -> None:
        seconds[label] += s
        print(f"  {label} depth {depth}: {s:.1f} s ({time.perf_counter() - t0:.0f} s in)", flush=True)

    parts = []
    for chunk in ids.split(args.batch):
        parts.append(depth_window_metrics(model, chunk, configs, depths, args.steps, patcher=patched,
                                          shared_prefill=not args.prefill_per_depth, on_window=progress))
    rows, changes, tops = [], [], []
    for label, cfg in configs.items():
        m = {k: np.concatenate([part[label][k] for part in parts]) for k in parts[0][label]
             if k not in ("positions", "depth")}
        m["positions"], m["depth"] = parts[0][label]["positions"], parts[0][label]["depth"]
        rows += depth_rows(label, cfg, m, round(seconds[label], 1), args.n_resamples)
        changes += depth_change(label, m, args.n_resamples)
        tops += top_positions(label, m, sample, tok)
    df = pd.DataFrame(rows)
    ch = pd.DataFrame(changes)
    from snapquant.atomic import atomic_write_text

    write(args.out, "table", df, f"Long-context fidelity: decode windows at depth, {args.model}",
          f"Per config and cache depth d: the sequences' first d tokens prefilled as served (prefill: bf16, the "
          f"tokens stored in the config's format), then {args.steps} teacher-forced decode steps; position t (the "
          f"prediction of token t+1 from tokens 0..t) runs from first_position = d to last_position. kl_mean: mean "
          "next-token KL(ref || quant) in nats against the unpatched model at the same positions; kl_p99: the 99th "
          "percentile of the window positions' KL (pooled over sequences); flip_rate: share of positions whose top-1 "
          "token differs; kl_max: the largest (no interval; top_positions.csv lists the largest with their context). "
          "`_ci_low`/`_ci_high`: 95% percentile cluster-bootstrap interval over sequences (n_sequences; n_positions "
          f"= n_sequences x steps). Text: {sample.source}; {text_note} (sequences.csv: file, token offset, line and "
          "every file a sequence spans). Deepest minus shallowest window, paired over sequences "
          "(depth_change.csv; jackknife t interval, sign-flip permutation p):\n\n"
          + _change_md(ch),
          {"model": args.model, "model_context": context, "depths": depths, "steps": args.steps, "seq_len": seq_len,
           "num_sequences": len(ids), "sampling": sample.method, "documents": docs,
           "source_documents": sample.num_documents, "documents_holding_a_sequence": sample.documents_holding_a_row,
           "text_seed": sample.seed, "prefill": "per depth" if args.prefill_per_depth else "shared exact latents",
           "n_resamples": args.n_resamples, "device": str(next(model.parameters()).device), "dtype": args.dtype,
           "seconds_per_config": {k: round(v, 1) for k, v in seconds.items()},
           "total_seconds": round(time.perf_counter() - t0, 1)})
    atomic_write_text(args.out / "depth_change.csv", ch.to_csv(index=False))
    atomic_write_text(args.out / "sequences.csv", pd.DataFrame(sample.records()).assign(
        source=sample.source, method=sample.method, seed=sample.seed).to_csv(index=False))
    atomic_write_text(args.out / "top_positions.csv", pd.DataFrame(tops).to_csv(index=False))
    plot_long_context(df, args.out)
    print((args.out / "table.md").read_text())
    print(f"total {time.perf_counter() - t0:.1f} s")


def _change_md(ch: pd.DataFrame) -> str:
    if ch.empty:
        return "(one depth: no change to report)\n"
    lines = ["| config | metric | depth a -> b | a | b | b - a [95% CI] | p | n seq / pos (b) |", "|---|---|---|---|---|---|---|---|"]
    for _, c in ch.iterrows():
        lines.append(f"| {c['config']} | {c['metric']} | {c['depth_a']} -> {c['depth_b']} | {c['value_a']:.4g} | "
                     f"{c['value_b']:.4g} | {c['delta']:.3g} [{c['ci_low']:.3g}, {c['ci_high']:.3g}] | "
                     f"{c['p_value']:.3g} | {c['n_sequences']} / {c['n_positions']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
