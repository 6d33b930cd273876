"""Granularity ablation: per-tensor vs per-channel vs per-token vs per-token-block FP8 scales.

For each granularity, with the RoPE key kept in BF16 ("latent") or quantized the same way ("both"):
quantization SQNR of the cached latent / RoPE (mean over layers), and model-level fidelity vs the
unquantized model (next-token KL, top-1 agreement, perplexity) with quantized prefill and in
step-by-step decode. Query and P stay BF16 so only the cache layout varies.
Writes results/granularity_ablation/: table.md/.csv and granularity.png/.pdf.

    python experiments/granularity_ablation.py [--model embedded|PATH]
"""

from __future__ import annotations

import math

import pandas as pd
from _common import load, parser, write

from snapquant import KVQuantConfig, bytes_per_token
from snapquant.analysis.plots import plt, save_figure
from snapquant.analysis.sensitivity import sensitivity_report
from snapquant.eval.fidelity import fidelity_metrics, fidelity_reference
from snapquant.patching import patched

GRANS = ("per_tensor_dynamic", "per_channel", "per_token", "per_token_block")


def main() -> None:
    p = parser(__doc__.splitlines()[0], "granularity_ablation")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    args = p.parse_args()
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
            fid = fidelity_metrics(model, ref, cfg, prompt_len=args.prompt_len, patcher=patched)
            rows.append({"scope": scope, "granularity": g, "bytes_per_token": bytes_per_token(cfg, r, d),
                         "causal_consistent": cfg.causal_consistent,
                         "nope_sqnr_db": sq[("nope", g)], "rope_sqnr_db": sq[("rope", g)] if scope == "both" else math.inf,
                         **{f"{m}_{k}": fid[m][k] for m in ("prefill", "decode")
                            for k in ("kl_mean", "kl_p99", "top1_agree", "ppl_rel_delta")}})
            print(rows[-1])
    df = pd.DataFrame(rows)
    write(args.out, "table", df, f"Granularity ablation (FP8 e4m3): {args.model}",
          "scope=latent: only the NoPE latent in FP8 (RoPE BF16); both: RoPE in FP8 with the same granularity. "
          "SQNR: mean over layers. KL / top-1 / relative perplexity change vs the unquantized model, with every "
          "position attending to the quantized cache (prefill) and in token-by-token decode after a BF16 prompt. "
          "Per-tensor and per-channel dynamic scales are not causal-consistent: their prefill numbers are not what "
          "decode sees.", {**rep.meta, "prompt_len": args.prompt_len})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    x = range(len(GRANS))
    for scope, mk in (("latent", "o"), ("both", "s")):
        s = df[df.scope == scope].set_index("granularity").loc[list(GRANS)]
        axes[0].plot(x, s["nope_sqnr_db"] if scope == "latent" else s["rope_sqnr_db"], marker=mk,
                     label="NoPE latent" if scope == "latent" else "RoPE key")
        axes[1].plot(x, s["decode_kl_mean"], marker=mk, label=f"{scope}: decode")
        axes[1].plot(x, s["prefill_kl_mean"], marker=mk, ls="--", label=f"{scope}: prefill")
        axes[2].plot(x, s["decode_top1_agree"], marker=mk, label=f"{scope}: decode")
    axes[0].set(ylabel="SQNR (dB)", title="FP8 quantization SQNR")
    axes[1].set(ylabel="KL (nats)", yscale="log", title="next-token KL vs unquantized")
    axes[2].set(ylabel="top-1 agreement", title="top-1 agreement (decode)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels([g.replace("per_", "").replace("_dynamic", "") for g in GRANS], fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, args.out, "granularity")
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
