"""Long-context fidelity: next-token KL and top-1 flip rate against position, up to the model's context.

For each KV-cache config (presets or config files), against the unpatched model on the same
tokens (teacher forcing): per position t (the prediction of token t+1 from tokens 0..t), the
KL(p_ref || p_quant) and whether the argmax token flipped; then, per position bin (log2-spaced
from 16, or `--bin-width` wide), their mean over every sequence's positions in the bin, with a 95%
percentile cluster-bootstrap interval over sequences (snapquant.analysis.uncertainty.binned_means).

How each config is run (the `mode` column):
- `prefill`: causal-consistent configs (a token's stored value never depends on later tokens, e.g.
  per-token scales) give exactly what step-by-step decode gives in one quantized prefill (tested in
  tests/test_fidelity.py); every position from 0 is scored, as if decode began at the first token;
- `decode`: configs whose scales depend on other tokens (per-tensor / per-channel scales frozen at
  the prefill, KIVI groups) differ between the two, so they run true step-by-step decode after a
  prompt of `--prompt-len` tokens prefilled as the config says (BF16 by default, as served); only
  positions from the prompt on are scored. `--mode decode` runs every config this way.
The sequences are the held-out text by default (snapquant.analysis.text_sample): each row inside one
held-out file past its header when enough files hold a whole row, else rows of the concatenated files
(headers skipped, EOS between them); `sequences.csv` says which, per row.

Writes table.md/.csv, sequences.csv, top_positions.csv (each config's largest-KL positions with their
file, token offset and context) and long_context.png/.pdf to runs/long_context/ (the committed copy:
--out results/long_context). CPU cost grows with length squared (prefill) and per step (decode): the
default on CPU is 4 sequences of min(context, 1024) tokens, on CUDA 16 of the model's context.

    python experiments/long_context.py [--model embedded|PATH] [--max-len N] [--out results/long_context]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _common import load_sample, parser, read_table, write

from snapquant.analysis.experiment_plots import plot_long_context
from snapquant.analysis.uncertainty import binned_means, position_metrics
from snapquant.errors import ConfigError
from snapquant.eval.fidelity import fidelity_reference, prefill_logprobs
from snapquant.eval.model import checkpoint_mla_dims
from snapquant.models.stepping import decode_steps
from snapquant.patching import patched
from snapquant.presets import resolve_config

PRESETS = ("bf16", "snapmla", "per_tensor_fp8", "ds_v32", "fp8_kivi")
CPU_DEFAULTS = {"num_sequences": 4, "max_len": 1024}
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
        raise ConfigError(f"--model={model!r}: config.json has no max_position_embeddings; pass --max-len")
    return n


def bin_edges(first: int, stop: int, width: int | None) -> list[int]:
    """[first, ..., stop]: `width`-wide bins, or log2 edges 16, 32, 64, ... (fine where context is short)."""
    if width:
        inner = list(range((first // width + 1) * width, stop, width))
    else:
        inner, e = [], 16
        while e < stop:
            if e > first:
                inner.append(e)
            e *= 2
    return [first, *inner, stop]


@torch.no_grad()
def measure(model, ids: torch.Tensor, cfg, mode: str, prompt_len: int, batch: int) -> dict[str, np.ndarray]:
    """Per-position KL and flip ([N, P] float64) of `cfg` against the unpatched model, and their positions [P]."""
    kl, flip = [], []
    T = ids.shape[1]
    for chunk in ids.split(batch):
        ref = fidelity_reference(model, chunk).logprobs  # [B, T, V]: position t predicts token t + 1
        if mode == "prefill":
            with patched(model, cfg.replace(prefill="quantized")):
                lp = prefill_logprobs(model, chunk)
            m = position_metrics(ref[:, :-1], lp[:, :-1], chunk[:, 1:])
            kl.append(m["kl"])
            flip.append(m["flip"])
            continue
        steps_kl, steps_flip = [], []
        with patched(model, cfg):
            device = next(model.parameters()).device
            for i, out in enumerate(decode_steps(model, chunk.to(device), prompt_len)):
                if not i:  # the prefill's output: the prompt is not scored
                    continue
                t = prompt_len + i - 1  # this step consumed token t and predicts token t + 1
                q = torch.log_softmax(out.logits[:, -1:].float(), -1).cpu()
                m = position_metrics(ref[:, t:t + 1], q, chunk[:, t + 1:t + 2])
                steps_kl.append(m["kl"])
                steps_flip.append(m["flip"])
        kl.append(np.concatenate(steps_kl, axis=1))
        flip.append(np.concatenate(steps_flip, axis=1))
    first = 0 if mode == "prefill" else prompt_len
    return {"kl": np.concatenate(kl), "flip": np.concatenate(flip), "positions": np.arange(first, T - 1)}


def bin_rows(label: str, mode: str, causal: bool, m: dict[str, np.ndarray], edges: list[int], seconds: float,
             n_resamples: int) -> list[dict]:
    kl = binned_means(m["kl"], m["positions"], edges, n_resamples=n_resamples)
    flip = binned_means(m["flip"], m["positions"], edges, n_resamples=n_resamples)
    return [{"config": label, "mode": mode, "causal_consistent": causal, "bin_lo": k.lo, "bin_hi": k.hi,
             "n_sequences": k.n_sequences, "n_positions": k.n_positions,
             "kl_mean": k.value, "kl_mean_ci_low": k.ci_low, "kl_mean_ci_high": k.ci_high,
             "flip_rate": f.value, "flip_rate_ci_low": f.ci_low, "flip_rate_ci_high": f.ci_high,
             "config_seconds": seconds} for k, f in zip(kl, flip, strict=True)]


def top_positions(label: str, m: dict[str, np.ndarray], sample, tokenizer, k: int = TOP_K) -> list[dict]:
    """The `k` largest-KL positions of one config: where in the text they are, and the context before them."""
    ids = sample.input_ids
    order = np.argsort(m["kl"], axis=None)[::-1][:k]
    rows = []
    for flat in order:
        r, c = np.unravel_index(flat, m["kl"].shape)
        t = int(m["positions"][c])
        doc, off = sample.locate(int(r), t)
        rows.append({"config": label, "row": int(r), "position": t, "kl": float(m["kl"][r, c]),
                     "flip": bool(m["flip"][r, c]), "document": doc, "token_offset": off,
                     "context": tokenizer.decode(ids[r, max(0, t - 24):t + 1]),
                     "next_token": tokenizer.decode(ids[r, t + 1:t + 2])})
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0], "long_context")
    p.set_defaults(seq_len=None, num_sequences=None)
    p.add_argument("--preset", "-p", action="append", default=None,
                   help=f"config to measure (preset or config file; repeat); default {', '.join(PRESETS)}")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per sequence (--seq-len is the same); default the model's max_position_embeddings "
                        f"(on CPU at most {CPU_DEFAULTS['max_len']})")
    p.add_argument("--mode", choices=("auto", "decode"), default="auto",
                   help="auto: quantized prefill for causal-consistent configs, true decode for the rest; "
                        "decode: true decode for every config")
    p.add_argument("--prompt-len", type=int, default=64, help="decode mode: tokens prefilled before stepping")
    p.add_argument("--bin-width", type=int, default=None, help="equal-width position bins (default: log2-spaced)")
    p.add_argument("--batch", type=int, default=4, help="sequences per forward pass")
    p.add_argument("--n-resamples", type=int, default=2000, help="bootstrap resamples per bin")
    args = p.parse_args()
    if args.replot:
        print(plot_long_context(read_table(args.out, "table"), args.out))
        return
    t0 = time.perf_counter()
    try:
        configs = [resolve_config(c) for c in (args.preset or PRESETS)]
        context = model_context(args.model)
        r, d = checkpoint_mla_dims(args.model)
        for c in configs:
            try:
                c.check_dims(r, d)
            except ConfigError as e:
                raise ConfigError(f"--preset {c.label()}: {e} (model kv_lora_rank={r}, rope dim={d})") from None
        cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
        max_len = args.max_len or args.seq_len or (min(context, CPU_DEFAULTS["max_len"]) if cpu else context)
        args.num_sequences = args.num_sequences or (CPU_DEFAULTS["num_sequences"] if cpu else 16)
        if not 3 <= max_len <= context:
            raise ConfigError(f"--max-len={max_len}: expected an integer in [3, {context}] (the model's context)")
        if any(args.mode == "decode" or not c.causal_consistent for c in configs) and \
                not 1 <= args.prompt_len <= max_len - 2:
            raise ConfigError(f"--prompt-len={args.prompt_len}: expected an integer in [1, {max_len - 2}]")
        for name, v in (("--batch", args.batch), ("--num-sequences", args.num_sequences)):
            if v < 1:
                raise ConfigError(f"{name}={v}: expected an integer >= 1")
        model, tok, sample = load_sample(args, max_len)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    ids = sample.input_ids
    print(f"{len(ids)} sequences of {max_len} tokens ({sample.method}, {len({o.document for o in sample.origins})} "
          f"documents) on {next(model.parameters()).device}", flush=True)
    rows, tops, seconds = [], [], {}
    for cfg in configs:
        mode = "prefill" if args.mode == "auto" and cfg.causal_consistent else "decode"
        t = time.perf_counter()
        m = measure(model, ids, cfg, mode, args.prompt_len, args.batch)
        seconds[cfg.label()] = round(time.perf_counter() - t, 1)
        first = int(m["positions"][0])
        rows += bin_rows(cfg.label(), mode, cfg.causal_consistent, m, bin_edges(first, max_len - 1, args.bin_width),
                         seconds[cfg.label()], args.n_resamples)
        tops += top_positions(cfg.label(), m, sample, tok)
        print(f"{cfg.label()}: {mode}, {seconds[cfg.label()]} s", flush=True)
    df = pd.DataFrame(rows)
    decode_from = f"{args.prompt_len}"
    write(args.out, "table", df, f"Long-context fidelity vs position: {args.model}",
          "Per position bin [bin_lo, bin_hi) of t (the prediction of token t+1 from tokens 0..t): mean next-token "
          "KL(ref || quant) in nats and top-1 flip rate against the unpatched model, over every sequence's "
          "positions in the bin; `_ci_low`/`_ci_high`: 95% percentile cluster-bootstrap interval over sequences "
          f"(n_sequences; with few sequences these intervals are narrower than they should be). mode=prefill: "
          "causal-consistent config, one quantized prefill, which equals step-by-step decode exactly, scored from "
          f"position 0; mode=decode: true step-by-step decode after a {decode_from}-token prompt prefilled as the "
          "config says (BF16 by default), because the config's scales depend on other tokens (frozen at the prefill, "
          f"or KIVI groups) and a prefill would not show what decode sees. Text: {sample.source}, "
          + ("each sequence inside one file past its header" if sample.method == "per-document" else
             "sequences cut from the files concatenated (headers skipped, EOS between them): too few files hold a "
             "whole sequence") + " (sequences.csv: file, token offset, line; top_positions.csv: each config's "
          f"{TOP_K} largest-KL positions with their context).",
          {"model": args.model, "model_context": context, "max_len": max_len, "num_sequences": len(ids),
           "sampling": sample.method, "documents": len({o.document for o in sample.origins}),
           "text_seed": sample.seed, "prompt_len": args.prompt_len, "mode": args.mode,
           "bins": "log2" if not args.bin_width else f"width {args.bin_width}", "n_resamples": args.n_resamples,
           "device": str(next(model.parameters()).device), "dtype": args.dtype, "seconds_per_config": seconds,
           "total_seconds": round(time.perf_counter() - t0, 1)})
    from snapquant.atomic import atomic_write_text

    atomic_write_text(args.out / "sequences.csv", pd.DataFrame(sample.records()).assign(
        source=sample.source, method=sample.method, seed=sample.seed).to_csv(index=False))
    atomic_write_text(args.out / "top_positions.csv", pd.DataFrame(tops).to_csv(index=False))
    plot_long_context(df, args.out)
    print((args.out / "table.md").read_text())
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
