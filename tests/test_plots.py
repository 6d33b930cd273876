"""What the figures show: baselines as reference lines, visible zero-width intervals, robust colour
limits, one style per line, legends outside the panels, intervals wherever a table has them."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from snapquant.analysis import experiment_plots, plots, sensitivity_plots
from snapquant.analysis.plots import factor_styles, robust_limits
from snapquant.analysis.sensitivity import SensitivityReport
from snapquant.analysis.tables import SweepTable


@pytest.fixture
def figs(monkeypatch):
    """Keep the figures the plotting functions would save and close, to inspect their artists."""
    kept = []

    def keep(fig, out_dir, stem, points=None):
        fig.canvas.draw()  # lay out text and legends, as saving would
        kept.append(fig)
        return []

    for mod in (plots, sensitivity_plots, experiment_plots):
        monkeypatch.setattr(mod, "save_figure", keep)
    yield kept
    for f in kept:
        plots.plt.close(f)


def _line_style(line) -> tuple:
    from matplotlib.colors import to_hex

    return to_hex(line.get_color()), line.get_linestyle(), line.get_marker()


# ---------------------------------------------------------------------- helpers
def test_robust_limits_are_percentiles_and_flag_the_clipped_side():
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.normal(32, 2, 2000), [151.8, 159.8, np.inf, np.nan]])
    lo, hi, extend = robust_limits(v, (1, 99))
    finite = v[np.isfinite(v)]
    assert (lo, hi) == (np.percentile(finite, 1), np.percentile(finite, 99))
    assert extend == "both" and hi < 40
    lo, hi, extend = robust_limits(np.arange(10.0), (0, 100))
    assert (lo, hi, extend) == (0.0, 9.0, "neither")
    assert robust_limits([5.0, 5.0, np.inf], (1, 99))[2] == "max"
    with pytest.raises(ValueError, match="finite"):
        robust_limits([np.inf, np.nan])


@pytest.mark.parametrize("n_prim,n_sec", [(4, 4), (7, 1), (13, 5), (40, 8)])
def test_factor_styles_give_every_line_its_own_style(n_prim, n_sec):
    keys = [(f"d{i}", f"g{j}") for i in range(n_prim) for j in range(n_sec)]
    st = factor_styles(keys)
    combos = {(s["color"], s["ls"], s["marker"]) for s in st.values()}
    assert len(combos) == len(keys)
    if n_prim <= 10:  # within the palette: colour is the first factor, line + marker the second
        for (d, g), s in st.items():
            assert s["color"] == st[(d, "g0")]["color"]
            assert (s["ls"], s["marker"]) == (st[("d0", g)]["ls"], st[("d0", g)]["marker"])


def test_factor_styles_refuse_more_lines_than_styles():
    with pytest.raises(ValueError, match="distinct line styles"):
        factor_styles([(f"d{i}", "g") for i in range(10 * 32 + 1)])


# ---------------------------------------------------------------------- sensitivity figures
def _report(n_layers=3, r=16, d=4, dtypes=("fp8_e4m3", "fp8_e5m2", "int8", "int4"),
            grans=("per_tensor_dynamic", "per_channel", "per_token", "per_token_block"),
            schemes=("snapmla_kv_only", "rope_fp8_per_token", "per_tensor_fp8_dynamic")) -> SensitivityReport:
    rng = np.random.default_rng(0)
    ce, le, ae, cs = [], [], [], []
    for layer in range(n_layers):
        for part, n in (("nope", r), ("rope", d)):
            for c in range(n):
                cs.append({"layer": layer, "part": part, "channel": c, "absmax": rng.uniform(1, 9), "mean": 0.0,
                           "std": 1.0, "kurtosis": rng.normal(), "outlier_share": rng.uniform(0, 0.01)})
            for dt in dtypes:
                for g in grans:
                    sq = rng.normal(32, 2, n)
                    le.append({"layer": layer, "part": part, "dtype": dt, "granularity": g, "mse": 1e-3,
                               "sqnr_db": float(sq.mean()), "absmax": 5.0, "outlier_share": 0.0})
                    ce += [{"layer": layer, "part": part, "dtype": dt, "granularity": g, "channel": c,
                            "mse": 1e-3, "sqnr_db": s} for c, s in enumerate(sq)]
        for scheme in [f"{dt}/{g}" for dt in dtypes for g in grans] + list(schemes):
            for mode in ("nope", "rope", "both"):
                ae.append({"layer": layer, "scheme": scheme, "mode": mode, "rel_l2": rng.uniform(0.005, 0.05),
                           "max_token_rel": 0.1})
    ce = pd.DataFrame(ce)
    # a few near-exact channels, as the embedded model's RoPE has: 152 dB, 160 dB and one exact (+inf)
    hot = ce.index[(ce["dtype"] == "fp8_e4m3") & (ce["part"] == "rope") & (ce["granularity"] == "per_token")][:3]
    ce.loc[hot, "sqnr_db"] = [151.8, 159.8, np.inf]
    return SensitivityReport(pd.DataFrame(cs), ce, pd.DataFrame(le), pd.DataFrame(ae),
                             meta={"kv_lora_rank": r, "rope_dim": d})


def test_sqnr_heatmap_colour_limits_are_percentiles_with_an_extend_arrow(figs):
    rep = _report()
    sensitivity_plots.plot_error_heatmaps(rep, "unused", "fp8_e4m3")
    fig = figs[-1]
    vals = rep.channel_error.query("dtype == 'fp8_e4m3'")["sqnr_db"].to_numpy()
    finite = vals[np.isfinite(vals)]
    lo, hi = np.percentile(finite, [1, 99])
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 8  # 4 granularities x NoPE / RoPE
    for im in images:
        assert (im.norm.vmin, im.norm.vmax) == pytest.approx((lo, hi))
        assert not np.ma.getmaskarray(im.get_array()).any()  # the exact (+inf) channel is not a hole
    assert sum(int((im.get_array() > hi).sum()) for im in images) >= 3  # drawn in the "above" colour
    assert hi < 45  # the useful range sets the scale, not the 160 dB channels
    bars = [ax for ax in fig.axes if not ax.get_images() and ax.get_label() == "<colorbar>"]
    assert bars and all(cb._colorbar.extend == "both" for cb in bars)
    assert "above" in fig._suptitle.get_text()


def test_layer_lines_one_style_per_line_and_the_legend_covers_no_panel(figs):
    rep = _report()  # 16 dtype x granularity pairs + 3 presets = 19 lines, as the CLI's defaults give
    sensitivity_plots.plot_layer_lines(rep, "unused")
    fig = figs[-1]
    data_axes = [ax for ax in fig.axes if ax.has_data()]
    styles, labels = {}, set()
    for ax in data_axes:
        for line in ax.get_lines():
            if line.get_label().startswith("_"):
                continue
            labels.add(line.get_label())
            styles.setdefault(line.get_label(), _line_style(line))
            assert styles[line.get_label()] == _line_style(line)  # the same series looks the same everywhere
    assert len(labels) == 19 and len(set(styles.values())) >= len(labels)
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    assert len(legends) == 1 and len(legends[0].get_texts()) == 19
    box = legends[0].get_window_extent()
    for ax in data_axes:  # nothing of any panel (plot area or title) under the legend
        assert not box.overlaps(ax.get_window_extent()), ax.get_title()
        assert not box.overlaps(ax.title.get_window_extent()), ax.get_title()


# ---------------------------------------------------------------------- sweep figures
def _sweep_table(delta_zero: bool = True) -> SweepTable:
    cells = pd.DataFrame([
        {"label": "bf16", "is_baseline": True, "bytes_per_token": 576.0, "decode_kl_mean": 2.0e-12,
         "decode_kl_p99": 1e-11, "decode_top1_agree": 1.0},
        {"label": "snapmla", "is_baseline": False, "bytes_per_token": 324.0, "decode_kl_mean": 4.9e-4,
         "decode_kl_p99": 4e-3, "decode_top1_agree": 0.99},
        {"label": "per_tensor_fp8", "is_baseline": False, "bytes_per_token": 288.0, "decode_kl_mean": 2.6e-3,
         "decode_kl_p99": 2e-2, "decode_top1_agree": 0.96},
    ])
    long = pd.DataFrame([
        {"label": "bf16", "task": "t", "metric": "exact_match", "value": 0.5, "stderr": 0.1, "delta": math.nan,
         "ci_low": math.nan, "ci_high": math.nan, "p_value": math.nan, "significant": False, "n_paired": 0,
         "is_baseline": True},
        {"label": "snapmla", "task": "t", "metric": "exact_match", "value": 0.5, "stderr": 0.1, "delta": 0.0,
         "ci_low": 0.0, "ci_high": 0.0, "p_value": 1.0, "significant": False, "n_paired": 16, "is_baseline": False},
        {"label": "per_tensor_fp8", "task": "t", "metric": "exact_match", "value": 0.44, "stderr": 0.1,
         "delta": -0.0625, "ci_low": -0.1875, "ci_high": 0.0625, "p_value": 0.62, "significant": False,
         "n_paired": 16, "is_baseline": False},
    ])
    return SweepTable(long, cells, "bf16", 0.05)


def test_fidelity_baseline_is_a_reference_line_and_the_kl_axis_leaves_it_out(figs):
    plots.plot_fidelity_vs_bytes(_sweep_table(), "unused")
    kl_ax, top_ax = figs[-1].axes[:2]
    refs = [ln for ln in kl_ax.get_lines() if ln.get_gid() == "reference"]
    assert len(refs) == 1 and refs[0].get_ydata()[0] == pytest.approx(2e-12)
    points = [ln for ln in kl_ax.get_lines() if ln.get_gid() != "reference"]
    assert all(np.all(np.asarray(ln.get_ydata()) > 1e-6) for ln in points)  # no point for the baseline
    lo, hi = kl_ax.get_ylim()
    assert lo > 2e-12 and math.log10(hi / lo) < 3  # the axis spans the quantized cells, not 10 decades
    assert any("off scale" in t.get_text() and "bf16" in t.get_text() for t in kl_ax.texts)
    # top-1 agreement of the baseline (1.0) is on the axis, drawn as a line too
    top_refs = [ln for ln in top_ax.get_lines() if ln.get_gid() == "reference"]
    assert len(top_refs) == 1 and top_ax.get_ylim()[0] < 0.96 and top_ax.get_ylim()[1] >= 1.0


def test_task_deltas_make_a_zero_width_interval_visible(figs):
    plots.plot_task_deltas(_sweep_table(), "unused")
    ax = figs[-1].axes[0]
    exact = [t for t in ax.texts if t.get_gid() == "exact"]
    assert len(exact) == 1 and exact[0].get_text() == "0 (exact), n=16"
    caps = [c for c in ax.collections + ax.get_lines() if getattr(c, "get_marker", lambda: None)() == "|"]
    assert caps  # interval caps drawn for the non-degenerate interval


def test_accuracy_panel_names_the_zero_stderrs_it_cannot_draw(figs):
    tab = _sweep_table()
    tab.long["stderr"] = 0.0
    tab.long["n_samples"] = 8
    plots.plot_accuracy_vs_bytes(tab, "unused")
    texts = [t.get_text() for t in figs[-1].axes[0].texts if t.get_gid() == "exact"]
    assert texts == ["stderr 0: bf16 (n=8), snapmla (n=8), per_tensor_fp8 (n=8)"]


# ---------------------------------------------------------------------- experiment figures
def _pv_tables():
    pipes = ["snapmla", "snapmla_naive_pv", "snapmla_q_fp8", "snapmla_kv_only"]
    per_layer = pd.DataFrame([{"layer": layer, "pipeline": p, "out_rel_l2": 0.015 + 0.001 * i + 0.001 * layer,
                               "out_rel_l2_worst_row": 0.05, "lse_abs_err_max": 0.01}
                              for layer in range(6) for i, p in enumerate(pipes)])
    kl = np.array([4.9e-4, 1.07e-3, 3.7e-4, 3.5e-4])
    ratio = kl / kl[0]
    table = pd.DataFrame({"pipeline": pipes, "decode_kl_mean": kl, "decode_kl_mean_ci_low": kl * 0.8,
                          "decode_kl_mean_ci_high": kl * 1.25, "decode_kl_mean_n_positions": 764,
                          "kl_ratio_vs_snapmla": ratio, "kl_ratio_vs_snapmla_ci_low": ratio * 0.9,
                          "kl_ratio_vs_snapmla_ci_high": ratio * 1.1})
    return per_layer, table


def test_pv_pipeline_points_with_intervals_kl_from_zero_ratio_on_a_marked_log_axis(figs):
    per_layer, table = _pv_tables()
    experiment_plots.plot_pv_pipeline(per_layer, table, "unused")
    axes = figs[-1].axes
    assert not any(ax.patches for ax in axes)  # no bars
    assert all(ax.get_yscale() == "linear" for ax in axes[:2]) and axes[2].get_yscale() == "log"
    assert axes[1].get_ylim()[0] == 0 and "10^{-3}" in axes[1].get_ylabel()  # KL from 0, in units of 1e-3
    for ax, col, scale, rows in ((axes[1], "decode_kl_mean", 1e-3, table), (axes[2], "kl_ratio_vs_snapmla", 1.0,
                                                                             table.iloc[1:])):
        segs = [s for c in ax.collections for s in c.get_segments()]
        assert len(segs) == len(rows)  # one interval per pipeline (the ratio's reference row is the line at 1)
        got = sorted((float(s[:, 1].min()), float(s[:, 1].max())) for s in segs)
        want = sorted(zip(rows[f"{col}_ci_low"] / scale, rows[f"{col}_ci_high"] / scale, strict=True))
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert any(ln.get_gid() == "reference" and ln.get_ydata()[0] == 1.0 for ln in axes[2].get_lines())
    lo, hi = axes[2].get_ylim()
    assert lo < table["kl_ratio_vs_snapmla_ci_low"].min() and hi > table["kl_ratio_vs_snapmla_ci_high"].max()


def test_granularity_kl_and_top1_carry_the_tables_intervals(figs):
    grans = ("per_tensor_dynamic", "per_channel", "per_token", "per_token_block")
    rows = []
    for scope in ("latent", "both"):
        for i, g in enumerate(grans):
            r = {"scope": scope, "granularity": g, "nope_sqnr_db": 31.5 + i, "rope_sqnr_db": 31.0 + i}
            for m in ("prefill", "decode"):
                kl, t1 = 1e-3 * (i + 1), 0.99 - 0.01 * i
                r.update({f"{m}_kl_mean": kl, f"{m}_kl_mean_ci_low": kl * 0.7, f"{m}_kl_mean_ci_high": kl * 1.4,
                          f"{m}_top1_agree": t1, f"{m}_top1_agree_ci_low": t1 - 0.01,
                          f"{m}_top1_agree_ci_high": min(1.0, t1 + 0.01)})
            rows.append(r)
    experiment_plots.plot_granularity(pd.DataFrame(rows), grans, "unused")
    kl_ax, top_ax = figs[-1].axes[1:3]
    # 2 scopes x 2 modes x 4 granularities intervals on KL, 2 x 4 on top-1
    assert sum(len(c.get_segments()) for c in kl_ax.collections) == 16
    assert sum(len(c.get_segments()) for c in top_ax.collections) == 8
