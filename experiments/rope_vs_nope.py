"""RoPE vs NoPE sensitivity (SnapMLA's motivation for keeping RoPE in 16 bits), on any MLA model.

Per layer and channel: statistics of the cached latent and RoPE key; their FP8 quantization error
(per-token and per-tensor scales); the attention-output error when only one part is quantized.
Writes table.md/.csv (per layer), the sensitivity CSVs, heatmaps and lines to runs/rope_vs_nope/
(the committed copy: --out results/rope_vs_nope).

    python experiments/rope_vs_nope.py [--model embedded|PATH] [--seq-len 256 --num-sequences 4]
"""

from __future__ import annotations

import pandas as pd
from _common import load, parser, read_table, write

from snapquant.analysis.experiment_plots import plot_rope_vs_nope
from snapquant.analysis.sensitivity import SensitivityReport, sensitivity_report
from snapquant.analysis.sensitivity_plots import plot_sensitivity


def main() -> None:
    args = parser(__doc__.splitlines()[0], "rope_vs_nope").parse_args()
    if args.replot:
        tables = {n: read_table(args.out, n) for n in ("channel_stats", "channel_error", "layer_error", "attn_error")}
        meta = {"kv_lora_rank": int(tables["channel_stats"].query("part == 'nope'")["channel"].max()) + 1,
                "rope_dim": int(tables["channel_stats"].query("part == 'rope'")["channel"].max()) + 1}
        print(plot_sensitivity(SensitivityReport(**tables, meta=meta), args.out))
        print(plot_rope_vs_nope(read_table(args.out, "table"), args.out))
        return
    model, _, ids = load(args)
    rep = sensitivity_report(model, ids, dtypes=("fp8_e4m3", "fp8_e5m2", "int8"),
                             granularities=("per_tensor_dynamic", "per_token"),
                             schemes=("snapmla_kv_only", "rope_fp8_per_token", "per_tensor_fp8_dynamic"),
                             model_name=args.model)
    rep.save(args.out)
    plot_sensitivity(rep, args.out)
    le, ae = rep.layer_error, rep.attn_error
    rows = []
    for layer in sorted(le["layer"].unique()):
        r = {"layer": int(layer)}
        for part in ("nope", "rope"):
            sel = le[(le.layer == layer) & (le.part == part)]
            r[f"{part}_absmax"] = float(sel["absmax"].iloc[0])
            r[f"{part}_outlier_share"] = float(sel["outlier_share"].iloc[0])
            for g in ("per_token", "per_tensor_dynamic"):
                s = sel[(sel.dtype == "fp8_e4m3") & (sel.granularity == g)]
                r[f"{part}_fp8_{g}_mse"] = float(s["mse"].iloc[0])
        for mode in ("nope", "rope"):
            s = ae[(ae.layer == layer) & (ae.scheme == "fp8_e4m3/per_token") & (ae["mode"] == mode)]
            r[f"attn_err_fp8_only_{mode}"] = float(s["rel_l2"].iloc[0])
        r["attn_err_snapmla_cache"] = float(ae[(ae.layer == layer) & (ae.scheme == "snapmla_kv_only")
                                               & (ae["mode"] == "both")]["rel_l2"].iloc[0])
        rows.append(r)
    df = pd.DataFrame(rows)
    write(args.out, "table", df, f"RoPE vs NoPE sensitivity: {args.model}",
          "Per layer: absmax and outlier share (|x| > 6 RMS) of the cached NoPE latent and RoPE key; MSE under "
          "FP8 e4m3 with per-token and per-tensor scales; relative L2 error of the layer's attention output "
          "with only the NoPE latent or only the RoPE key in FP8 per-token, and with SnapMLA's cache "
          "(FP8 latent, BF16 RoPE pre-divided by the latent scale).", rep.meta)
    plot_rope_vs_nope(df, args.out)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
