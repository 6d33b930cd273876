"""Granularity ablation: per-tensor vs per-channel vs per-token vs per-token-block FP8 scales.

For each granularity, with the RoPE key kept in BF16 ("latent") or quantized the same way ("both"):
quantization SQNR of the cached latent / RoPE (mean over layers), and model-level fidelity vs the
unquantized model (next-token KL, top-1 agreement, perplexity) with quantized prefill and in
step-by-step decode, with 95% cluster-bootstrap intervals over sequences for KL and top-1
(snapquant.analysis.uncertainty). Query and P stay BF16 so only the cache layout varies.

Granularity and scale policy are separate axes: per-tensor and whole-sequence per-channel scales are
frozen at the prefill by the cache (later tokens beyond them saturate), per-token scales are computed
per token, and per-channel scales can also be recomputed over each completed group of `--token-group`
tokens (KIVI; the rest waits in 16 bits), which never clips a later token. The per-channel rows of
both policies isolate what freezing costs from what the granularity costs.
Writes table.md/.csv and granularity.png/.pdf to runs/granularity_ablation/ (the committed copy:
--out results/granularity_ablation).

    python experiments/granularity_ablation.py [--model embedded|PATH] [--out results/granularity_ablation]
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch
from _common import load, parser, read_table, write

from snapquant import KVQuantConfig, bytes_per_token
from snapquant.analysis.capture import capture_mla
from snapquant.analysis.experiment_plots import plot_granularity
from snapquant.analysis.sensitivity import sensitivity_report, sqnr_db
from snapquant.analysis.uncertainty import compare_fidelity
from snapquant.eval.fidelity import fidelity_metrics, fidelity_reference
from snapquant.patching import patched
from snapquant.quant.quantizer import quantize_part

GRANS = ("per_tensor_dynamic", "per_channel", "per_token", "per_token_block")
POLICY = {"per_tensor_dynamic": "frozen at prefill", "per_channel": "frozen at prefill", "per_token": "per token",
          "per_token_block": "per token"}


def _variants(token_group: int) -> list[tuple[str, int | None, str]]:
    """(granularity, token_group, scale policy) rows, the grouped per-channel one beside the frozen one."""
    rows = []
    for g in GRANS:
        rows.append((g, None, POLICY[g]))
        if g == "per_channel":
            rows.append((g, token_group, f"per group of {token_group} tokens"))
    return rows


def _variant_name(g: str, group: int | None) -> str:
    return g if group is None else f"{g}/g{group}"


def _grouped_sqnr(model, ids, dtype: str, token_group: int) -> dict[str, float]:
    """Mean over layers of each part's SQNR with per-channel scales over groups of `token_group` tokens."""
    out = {}
    caps = capture_mla(model, ids)
    cfg = KVQuantConfig(nope_dtype=dtype, rope_dtype=dtype, nope_granularity="per_channel",
                        rope_granularity="per_channel", token_group=token_group, rope_prescale=False,
                        query="bf16", pv="bf16")
    for part in ("nope", "rope"):
        vals = []
        for cap in caps:
            x = cap.latent if part == "nope" else cap.rope
            err = (quantize_part(x, cfg, part).dequantize(torch.float64) - x.double()).pow(2).sum()
            vals.append(float(sqnr_db(x.double().pow(2).sum(), err)))
        out[part] = sum(vals) / len(vals)
    return out


def _plot(df: pd.DataFrame, out: Path) -> list[Path]:
    """One point per variant (granularity, and the grouped per-channel policy when the table has it)."""
    if "variant" not in df:  # a table written before the scale-policy rows
        return plot_granularity(df, GRANS, out)
    names = tuple(dict.fromkeys(df["variant"]))
    return plot_granularity(df.assign(granularity=df["variant"]), names, out)


def main() -> None:
    p = parser(__doc__.splitlines()[0], "granularity_ablation")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--token-group", type=int, default=64, help="tokens per per-channel scale group (KIVI)")
    args = p.parse_args()
    if args.replot:
        print(_plot(read_table(args.out, "table"), args.out))
        return
    model, _, ids = load(args)
    rep = sensitivity_report(model, ids, dtypes=("fp8_e4m3",), granularities=GRANS, schemes=(),
                             block_size=args.block_size, attention=False, model_name=args.model)
    sq = rep.layer_error.groupby(["part", "granularity"])["sqnr_db"].mean()
    grouped_sq = _grouped_sqnr(model, ids, "fp8_e4m3", args.token_group)
    ref = fidelity_reference(model, ids)
    r, d = rep.meta["kv_lora_rank"], rep.meta["rope_dim"]
    rows, per_token, seqs = [], {}, {}
    # per_token first in each scope: every other variant is compared with it on the same positions
    order = sorted(_variants(args.token_group), key=lambda v: v[0] != "per_token")
    for scope in ("latent", "both"):
        for g, group, policy in order:
            # only knobs these formats read: RoPE's granularity when RoPE is quantized, blocks when blocked
            knobs = {"rope_granularity": g} if scope == "both" else {}
            if g == "per_token_block":
                knobs["block_size"] = math.gcd(args.block_size, r, d)
            if group is not None:
                knobs["token_group"] = group
            cfg = KVQuantConfig(nope_dtype="fp8_e4m3", nope_granularity=g, rope_dtype="fp8_e4m3" if scope == "both" else "bf16",
                                rope_prescale=False, query="bf16", pv="bf16",
                                name=f"{scope}:{_variant_name(g, group)}", **knobs)
            fid = fidelity_metrics(model, ref, cfg, prompt_len=args.prompt_len, patcher=patched)
            cis = {}
            for m in ("prefill", "decode"):
                kl, flip = fid[m]["summary"]["kl_mean"], fid[m]["summary"]["flip_rate"]
                cis.update({f"{m}_kl_mean_ci_low": kl["ci_low"], f"{m}_kl_mean_ci_high": kl["ci_high"],
                            # top-1 agreement = 1 - flip rate: the flip rate's interval, mirrored
                            f"{m}_top1_agree_ci_low": 1.0 - flip["ci_high"],
                            f"{m}_top1_agree_ci_high": 1.0 - flip["ci_low"],
                            f"{m}_n_positions": fid[m]["n_positions"], f"{m}_n_sequences": fid[m]["n_sequences"]})
                seqs[(scope, _variant_name(g, group), m)] = fid[m]["per_sequence"]
                if g == "per_token":
                    per_token[(scope, m)] = fid[m]["per_sequence"]
                # paired with per-token scales (SnapMLA's granularity) on the same positions: the KL ratio
                # with its cluster-bootstrap interval and the sign-flip p-value of the KL difference
                cmp = compare_fidelity(per_token[(scope, m)], fid[m]["per_sequence"])
                cis.update({f"{m}_kl_ratio_vs_per_token": cmp.kl_ratio.ratio,
                            f"{m}_kl_ratio_vs_per_token_ci_low": cmp.kl_ratio.ci_low,
                            f"{m}_kl_ratio_vs_per_token_ci_high": cmp.kl_ratio.ci_high,
                            f"{m}_kl_vs_per_token_p": cmp.kl.p_value})
            nope_sq = grouped_sq["nope"] if group else sq[("nope", g)]
            rope_sq = (grouped_sq["rope"] if group else sq[("rope", g)]) if scope == "both" else math.inf
            rows.append({"scope": scope, "granularity": g, "scale_policy": policy, "variant": _variant_name(g, group),
                         "bytes_per_token": bytes_per_token(cfg, r, d), "causal_consistent": cfg.causal_consistent,
                         "nope_sqnr_db": nope_sq, "rope_sqnr_db": rope_sq,
                         **{f"{m}_{k}": fid[m][k] for m in ("prefill", "decode")
                            for k in ("kl_mean", "kl_p99", "top1_agree", "ppl_rel_delta")}, **cis})
            print(rows[-1])
    # the scale policy alone: per-channel scales frozen at prefill vs recomputed per token group, paired
    grouped = _variant_name("per_channel", args.token_group)
    for row in rows:
        if row["variant"] == "per_channel":
            for m in ("prefill", "decode"):
                cmp = compare_fidelity(seqs[(row["scope"], grouped, m)], seqs[(row["scope"], "per_channel", m)])
                row.update({f"{m}_kl_ratio_frozen_vs_grouped": cmp.kl_ratio.ratio,
                            f"{m}_kl_ratio_frozen_vs_grouped_ci_low": cmp.kl_ratio.ci_low,
                            f"{m}_kl_ratio_frozen_vs_grouped_ci_high": cmp.kl_ratio.ci_high,
                            f"{m}_kl_frozen_vs_grouped_p": cmp.kl.p_value})
    df = pd.DataFrame(rows)
    write(args.out, "table", df, f"Granularity ablation (FP8 e4m3): {args.model}",
          "scope=latent: only the NoPE latent in FP8 (RoPE BF16); both: RoPE in FP8 with the same granularity. "
          "scale_policy: 'frozen at prefill' = computed from the prompt by the cache, then fixed (later tokens "
          f"beyond it saturate); 'per group of {args.token_group} tokens' = per-channel scales recomputed over each "
          "completed group, the rest kept in 16 bits (KIVI); 'per token' = every token its own. "
          "SQNR: mean over layers, each sequence quantized whole (scales see the whole sequence, no freezing). "
          "KL / top-1 / relative perplexity change vs the unquantized model, with every "
          "position attending to the quantized cache (prefill) and in token-by-token decode after a BF16 prompt. "
          "Per-tensor and per-channel scales are not causal-consistent: their prefill numbers are not what "
          "decode sees. `_ci_low`/`_ci_high`: 95% percentile intervals of a cluster bootstrap over sequences "
          "(whole sequences resampled; n_sequences and n_positions given). `_kl_ratio_vs_per_token`: mean KL over "
          "the per-token variant's of the same scope on the same positions (paired cluster bootstrap, 95% "
          "percentile interval); `_kl_vs_per_token_p`: two-sided sign-flip permutation p-value over sequences of "
          "the KL difference. `_kl_ratio_frozen_vs_grouped` (per-channel rows): the same comparison of the frozen "
          "per-channel scales with the per-group ones, the scale policy alone.",
          {**rep.meta, "prompt_len": args.prompt_len, "token_group": args.token_group})
    _plot(df, args.out)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
