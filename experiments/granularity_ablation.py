"""Granularity ablation: per-tensor vs per-channel vs per-token vs per-token-block FP8 scales.

For each granularity, with the RoPE key kept in BF16 ("latent") or quantized the same way ("both"):
quantization SQNR of the cached latent / RoPE (mean over layers), and model-level fidelity vs the
unquantized model (next-token KL, top-1 agreement, perplexity) with quantized prefill and in
step-by-step decode, with 95% block-bootstrap intervals over positions for KL and top-1
(snapquant.analysis.intervals). Query and P stay BF16 so only the cache layout varies.
Writes table.md/.csv and granularity.png/.pdf to runs/granularity_ablation/ (the committed copy:
--out results/granularity_ablation).

    python experiments/granularity_ablation.py [--model embedded|PATH] [--out results/granularity_ablation]
"""

from __future__ import annotations

import math

import pandas as pd
from _common import load, parser, read_table, write

from snapquant import KVQuantConfig, bytes_per_token
from snapquant.analysis.experiment_plots import plot_granularity
from snapquant.analysis.intervals import DEFAULT_BLOCK, block_mean_ci
from snapquant.analysis.sensitivity import sensitivity_report
from snapquant.eval.fidelity import fidelity_metrics, fidelity_reference
from snapquant.patching import patched

GRANS = ("per_tensor_dynamic", "per_channel", "per_token", "per_token_block")


def main() -> None:
    p = parser(__doc__.splitlines()[0], "granularity_ablation")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="positions per bootstrap block")
    args = p.parse_args()
    if args.replot:
        print(plot_granularity(read_table(args.out, "table"), GRANS, args.out))
        return
    model, _, ids = load(args)
    rep = sensitivity_report(model, ids, dtypes=("fp8_e4m3",), granularities=GRANS, schemes=(),
                             block_size=args.block_size, attention=False, model_name=args.model)
    sq = rep.layer_error.groupby(["part", "granularity"])["sqnr_db"].mean()
    ref = fidelity_reference(model, ids)
    r, d = rep.meta["kv_lora_rank"], rep.meta["rope_dim"]
    rows = []
    for scope in ("latent", "both"):
        for g in GRANS:
            # only knobs these formats read: RoPE's granularity when RoPE is quantized, blocks when blocked
            knobs = {"rope_granularity": g} if scope == "both" else {}
            if g == "per_token_block":
                knobs["block_size"] = math.gcd(args.block_size, r, d)
            cfg = KVQuantConfig(nope_dtype="fp8_e4m3", nope_granularity=g, rope_dtype="fp8_e4m3" if scope == "both" else "bf16",
                                rope_prescale=False, query="bf16", pv="bf16", name=f"{scope}:{g}", **knobs)
            fid = fidelity_metrics(model, ref, cfg, prompt_len=args.prompt_len, patcher=patched, keep_positions=True)
            cis = {}
            for m in ("prefill", "decode"):
                for k, pos in (("kl_mean", "kl_positions"), ("top1_agree", "top1_positions")):
                    iv = block_mean_ci(fid[m][pos], args.block)
                    cis.update({f"{m}_{k}_ci_low": iv.low, f"{m}_{k}_ci_high": iv.high})
                cis[f"{m}_n_positions"] = fid[m]["n_positions"]
            rows.append({"scope": scope, "granularity": g, "bytes_per_token": bytes_per_token(cfg, r, d),
                         "causal_consistent": cfg.causal_consistent,
                         "nope_sqnr_db": sq[("nope", g)], "rope_sqnr_db": sq[("rope", g)] if scope == "both" else math.inf,
                         **{f"{m}_{k}": fid[m][k] for m in ("prefill", "decode")
                            for k in ("kl_mean", "kl_p99", "top1_agree", "ppl_rel_delta")}, **cis})
            print(rows[-1])
    df = pd.DataFrame(rows)
    write(args.out, "table", df, f"Granularity ablation (FP8 e4m3): {args.model}",
          "scope=latent: only the NoPE latent in FP8 (RoPE BF16); both: RoPE in FP8 with the same granularity. "
          "SQNR: mean over layers. KL / top-1 / relative perplexity change vs the unquantized model, with every "
          "position attending to the quantized cache (prefill) and in token-by-token decode after a BF16 prompt. "
          "Per-tensor and per-channel dynamic scales are not causal-consistent: their prefill numbers are not what "
          "decode sees. `_ci_low`/`_ci_high`: 95% BCa intervals of a block bootstrap over positions "
          f"({args.block} consecutive positions per block; n_positions given).",
          {**rep.meta, "prompt_len": args.prompt_len, "block": args.block})
    plot_granularity(df, GRANS, args.out)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
