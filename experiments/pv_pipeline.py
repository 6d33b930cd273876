"""The decode pipeline: scale-fused FP8 P vs naive FP8 P vs BF16 P, and BF16 vs FP8 query.

Two levels, on the model's own activations:
1. kernel level: every layer's captured absorbed queries run through the exact reference decode
   (`mla_decode_reference`, the oracle of the Triton kernels) over the SnapMLA FP8 cache, once per
   pipeline, against float64 attention on the UNQUANTIZED cache: output relative L2 (latent space)
   and LSE error, mean over layers;
2. model level: next-token KL / top-1 / perplexity change in step-by-step decode (snapquant.patch),
   with 95% cluster-bootstrap intervals over sequences, and each pipeline's KL as a paired ratio to
   scale-fused snapmla's on the same positions, with the sign-flip p-value over sequences of the
   difference (snapquant.analysis.uncertainty).
Writes table.md/.csv, per_layer.csv and pv_pipeline.png/.pdf to runs/pv_pipeline/ (the committed
copy: --out results/pv_pipeline).

    python experiments/pv_pipeline.py [--model embedded|PATH] [--out results/pv_pipeline]
"""

from __future__ import annotations

import pandas as pd
import torch
from _common import load, parser, read_table, write

from snapquant import PRESETS, absorb_query, attention_fp64, mla_decode_reference, quantize_kv, split_kv_b
from snapquant.analysis.capture import capture_mla
from snapquant.analysis.experiment_plots import plot_pv_pipeline
from snapquant.analysis.uncertainty import compare_fidelity
from snapquant.atomic import atomic_write_text
from snapquant.eval.fidelity import fidelity_metrics, fidelity_reference
from snapquant.patching import patched

PIPELINES = {  # name -> (preset, query, P)
    "snapmla": ("snapmla", "fp8 q", "fp8 P, scale-fused"),
    "snapmla_naive_pv": ("snapmla_naive_pv", "fp8 q", "fp8 P, naive"),
    "snapmla_q_fp8": ("snapmla_q_fp8", "fp8 q", "bf16 P"),
    "snapmla_kv_only": ("snapmla_kv_only", "bf16 q", "bf16 P"),
}


@torch.no_grad()
def kernel_level(model, ids) -> pd.DataFrame:
    rows = []
    for cap in capture_mla(model, ids):
        m = cap.module
        H, dn, dv = m.num_heads, m.qk_nope_head_dim, m.v_head_dim
        w_uk, _ = split_kv_b(m.kv_b_proj.weight.float(), H, dn, dv)
        q = cap.query.float().transpose(1, 2)  # [B, S, H, dn + dr]
        q_abs = absorb_query(q[..., :dn], q[..., dn:], w_uk)  # [B, S, H, r + dr]
        ref_out, ref_lse = attention_fp64(q_abs, cap.latent, cap.rope, softmax_scale=cap.scaling)
        for name, (preset, _, _) in PIPELINES.items():
            kv = quantize_kv(cap.latent, cap.rope, PRESETS[preset])
            out, lse = mla_decode_reference(q_abs, kv, softmax_scale=cap.scaling)
            err = (out.double() - ref_out)
            rows.append({"layer": cap.layer_idx, "pipeline": name,
                         "out_rel_l2": float(err.norm() / ref_out.norm()),
                         "out_rel_l2_worst_row": float((err.norm(dim=-1) / ref_out.norm(dim=-1)).max()),
                         "lse_abs_err_max": float((lse.double() - ref_lse).abs().max())})
    return pd.DataFrame(rows)


def main() -> None:
    p = parser(__doc__.splitlines()[0], "pv_pipeline")
    p.add_argument("--prompt-len", type=int, default=64)
    args = p.parse_args()
    if args.replot:
        print(plot_pv_pipeline(read_table(args.out, "per_layer"), read_table(args.out, "table"), args.out))
        return
    model, _, ids = load(args)
    per_layer = kernel_level(model, ids)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "per_layer.csv", per_layer.to_csv(index=False))
    ref = fidelity_reference(model, ids)
    fids = {name: fidelity_metrics(model, ref, PRESETS[preset], modes=("decode",), prompt_len=args.prompt_len,
                                   patcher=patched)["decode"]
            for name, (preset, _, _) in PIPELINES.items()}
    rows = []
    for name, (_, q, pv) in PIPELINES.items():
        k, fid = per_layer[per_layer.pipeline == name], fids[name]
        kl, flip = fid["summary"]["kl_mean"], fid["summary"]["flip_rate"]
        cmp = compare_fidelity(fids["snapmla"]["per_sequence"], fid["per_sequence"])
        rows.append({"pipeline": name, "query": q, "P": pv, "out_rel_l2": k["out_rel_l2"].mean(),
                     "out_rel_l2_worst_row": k["out_rel_l2_worst_row"].max(), "lse_abs_err_max": k["lse_abs_err_max"].max(),
                     "decode_kl_mean": fid["kl_mean"], "decode_kl_mean_ci_low": kl["ci_low"],
                     "decode_kl_mean_ci_high": kl["ci_high"], "decode_kl_mean_n_positions": fid["n_positions"],
                     "decode_kl_mean_n_sequences": fid["n_sequences"],
                     "kl_ratio_vs_snapmla": cmp.kl_ratio.ratio, "kl_ratio_vs_snapmla_ci_low": cmp.kl_ratio.ci_low,
                     "kl_ratio_vs_snapmla_ci_high": cmp.kl_ratio.ci_high, "kl_vs_snapmla_p": cmp.kl.p_value,
                     "decode_kl_p99": fid["kl_p99"], "decode_kl_max": fid["kl_max"],
                     "top1_agree": fid["top1_agree"], "top1_agree_ci_low": 1.0 - flip["ci_high"],
                     "top1_agree_ci_high": 1.0 - flip["ci_low"], "ppl_rel_delta": fid["ppl_rel_delta"]})
        print(rows[-1])
    df = pd.DataFrame(rows)
    write(args.out, "table", df, f"PV pipeline and query precision: {args.model}",
          "All rows share SnapMLA's cache (FP8 e4m3 latent, fp32 per-token scale, pre-scaled BF16 RoPE). "
          "Kernel level (exact reference decode of every layer's captured queries vs float64 attention on the "
          "unquantized cache): output relative L2 (mean over layers), worst query row, max LSE error. "
          "Model level: step-by-step decode vs the unquantized model; `_ci_low`/`_ci_high`: 95% percentile "
          "intervals of a cluster bootstrap over sequences (whole sequences resampled, n_sequences / n_positions "
          "given; top-1 agreement's is the flip rate's, mirrored); kl_ratio_vs_snapmla: mean KL over scale-fused "
          "snapmla's on the same positions, paired (the same sequences drawn for both); kl_vs_snapmla_p: two-sided "
          "sign-flip permutation p-value over sequences of the KL difference. decode_kl_max: the largest single "
          "position; a ratio carried by one position shows there, not in the mean's interval.",
          {"prompt_len": args.prompt_len, "seq_len": args.seq_len, "num_sequences": args.num_sequences})
    plot_pv_pipeline(per_layer, df, args.out)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
