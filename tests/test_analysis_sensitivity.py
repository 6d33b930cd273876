"""Per-channel sensitivity: capture without patching, statistics, quantization and attention errors, figures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from snapquant import PRESETS, ShapeError, quantize_kv
from snapquant.analysis.capture import capture_mla
from snapquant.analysis.sensitivity import (
    attention_output,
    channel_statistics,
    part_config,
    sensitivity_report,
)
from snapquant.quant import quantize_part


@pytest.fixture(scope="module")
def model():
    from snapquant.models.tiny import tiny_model

    torch.manual_seed(0)
    return tiny_model("deepseek_v3")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(2))


def test_channel_statistics_match_numpy():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 6, generator=g) * torch.tensor([1, 2, 3, 4, 5, 6.0]) + 0.5
    x[:, 5] = torch.distributions.StudentT(3).sample((500,)) * 2  # heavy tail
    x[7, 2] = 80.0  # one outlier
    s = channel_statistics(x, outlier_sigma=6.0)
    xn = x.double().numpy()
    np.testing.assert_allclose(s["absmax"].numpy(), np.abs(xn).max(0))
    np.testing.assert_allclose(s["mean"].numpy(), xn.mean(0), rtol=1e-12)
    np.testing.assert_allclose(s["std"].numpy(), xn.std(0), rtol=1e-12)
    np.testing.assert_allclose(s["kurtosis"].numpy(), stats.kurtosis(xn, axis=0, fisher=True, bias=True), rtol=1e-9)
    rms = np.sqrt((xn**2).mean())
    np.testing.assert_allclose(s["outlier_share"].numpy(), (np.abs(xn) > 6 * rms).mean(0))
    assert s["outlier_share"][2] > 0 and s["kurtosis"][5] > s["kurtosis"][0]


def test_capture_leaves_the_model_unchanged_and_reads_every_layer(model, ids):
    ref = model(ids).logits
    caps = capture_mla(model, ids)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
    assert [c.layer_idx for c in caps] == [0, 1]
    for c in caps:
        assert c.latent.shape == (2, 40, 32) and c.rope.shape == (2, 40, 8) and c.query.shape == (2, 4, 40, 24)
    # the latent is the post-layernorm kv_a output: recompute layer 0's from the embeddings
    attn = model.model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    lat = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(h)[..., :32])
    torch.testing.assert_close(caps[0].latent, lat, rtol=1e-6, atol=1e-6)


def test_attention_recomputation_reproduces_the_module_output(model, ids):
    outs = {}
    hooks = [lay.self_attn.register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(i, o[0]))
             for i, lay in enumerate(model.model.layers)]
    try:
        caps = capture_mla(model, ids)
    finally:
        for h in hooks:
            h.remove()
    for c in caps:
        ref = attention_output(c, c.latent, c.rope)
        torch.testing.assert_close(ref, outs[c.layer_idx].double(), rtol=1e-5, atol=1e-6)


def test_report_numbers_match_direct_quantization(model, ids):
    rep = sensitivity_report(model, ids, dtypes=("fp8_e4m3", "int4", "bf16"), granularities=("per_token", "per_channel"),
                             schemes=("snapmla_kv_only",))
    caps = capture_mla(model, ids)
    le = rep.layer_error.set_index(["layer", "part", "dtype", "granularity"])
    for c in caps:
        for part, x in (("nope", c.latent), ("rope", c.rope)):
            xq = quantize_part(x, part_config("fp8_e4m3", "per_token", 8), part).dequantize(torch.float64)
            err = (xq - x.double()).pow(2)
            sq = 10 * torch.log10(x.double().pow(2).sum() / err.sum())
            assert le.loc[(c.layer_idx, part, "fp8_e4m3", "per_token"), "sqnr_db"] == pytest.approx(float(sq), rel=1e-9)
            assert le.loc[(c.layer_idx, part, "fp8_e4m3", "per_token"), "mse"] == pytest.approx(float(err.mean()), rel=1e-9)
        # attention error of SnapMLA's cache with only the latent quantized, recomputed directly
        lat_q, _ = quantize_kv(c.latent, c.rope, PRESETS["snapmla_kv_only"]).dequantize(torch.float64)
        ref = attention_output(c, c.latent, c.rope)
        want = float((attention_output(c, lat_q, c.rope) - ref).norm() / ref.norm())
        ae = rep.attn_error
        got = ae[(ae.layer == c.layer_idx) & (ae.scheme == "snapmla_kv_only") & (ae["mode"] == "nope")]["rel_l2"]
        assert float(got.iloc[0]) == pytest.approx(want, rel=1e-9)
    # per-channel rows: 32 latent + 8 rope channels x 2 layers x (2 + 2 + 1) dtype/granularity pairs
    assert len(rep.channel_error) == (32 + 8) * 2 * 5
    assert set(rep.layer_error[rep.layer_error.dtype == "bf16"]["granularity"]) == {"none"}
    bits = rep.layer_error.groupby("dtype")["sqnr_db"].mean()
    assert bits["bf16"] > bits["fp8_e4m3"] > bits["int4"]
    # more bits, less attention error; "both" is at least as bad as the worse single part
    ae = rep.attn_error.groupby(["scheme", "mode"])["rel_l2"].mean()
    assert ae[("int4/per_token", "both")] > ae[("fp8_e4m3/per_token", "both")] > ae[("bf16/none", "both")]


def test_report_save_and_plots(model, ids, tmp_path):
    from snapquant.analysis.sensitivity_plots import plot_sensitivity

    rep = sensitivity_report(model, ids[:, :16], dtypes=("fp8_e4m3",), granularities=("per_token", "per_tensor_dynamic"),
                             schemes=())
    files = rep.save(tmp_path)
    assert {p.name for p in files.values()} == {"channel_stats.csv", "channel_error.csv", "layer_error.csv",
                                                "attn_error.csv", "summary.md"}
    assert "Quantization SQNR" in files["summary"].read_text()
    paths = plot_sensitivity(rep, tmp_path)
    names = {p.name for p in paths}
    assert {"channel_heatmaps.png", "channel_heatmaps.pdf", "layer_lines.png", "sqnr_heatmaps_fp8_e4m3.pdf"} <= names
    assert all(p.stat().st_size > 3000 for p in paths)


def test_non_mla_model_is_rejected_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ShapeError, match="LlamaForCausalLM has no MLA attention"):
        capture_mla(m, torch.zeros(1, 4, dtype=torch.long))


def test_sensitivity_cli_on_a_checkpoint(tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from snapquant.cli import app
    from snapquant.embedded import EMBEDDED_PATH, TINY_ARCH, embedded_config

    if not (EMBEDDED_PATH / "tokenizer.json").is_file():
        pytest.skip("no embedded tokenizer in this checkout")
    ck = tmp_path / "ck"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(embedded_config(TINY_ARCH)).save_pretrained(ck)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (EMBEDDED_PATH / f).is_file():
            shutil.copy(EMBEDDED_PATH / f, ck / f)
    out = tmp_path / "sens"
    r = CliRunner().invoke(app, ["sensitivity", "--model", str(ck), "--seq-len", "32", "--num-sequences", "2",
                                 "--dtype", "fp8_e4m3", "--granularity", "per_token", "--scheme", "snapmla",
                                 "--device", "cpu", "--no-plots", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Quantization SQNR" in r.stdout and (out / "layer_error.csv").exists()
    import pandas as pd

    le = pd.read_csv(out / "layer_error.csv")
    assert len(le) == 2 * 2 and set(le["part"]) == {"nope", "rope"}  # 2 layers x 2 parts, one pair
    r = CliRunner().invoke(app, ["sensitivity", "--model", str(ck), "--granularity", "per_row", "--device", "cpu"])
    assert r.exit_code == 2 and "per_token" in r.output
