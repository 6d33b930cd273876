"""Model-level fidelity metrics: exact metric math, decode alignment, and behaviour on a patched tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from snapquant import PRESETS, ConfigError, ShapeError
from snapquant.eval.fidelity import (
    compare_logprobs,
    decode_logprobs,
    fidelity_metrics,
    fidelity_reference,
    prefill_logprobs,
)


@pytest.fixture(scope="module")
def model():
    from snapquant.models.tiny import tiny_model

    torch.manual_seed(0)
    return tiny_model("deepseek_v3")


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 256, (2, 24), generator=g)


def test_compare_logprobs_matches_direct_float64_formulas():
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(50, 30, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.log_softmax(ref + 0.3 * torch.randn(50, 30, generator=g, dtype=torch.float64), -1)
    tgt = torch.randint(0, 30, (50,), generator=g)
    out = compare_logprobs(ref.float(), q.float(), tgt)
    kl = torch.nn.functional.kl_div(q, ref, log_target=True, reduction="none").sum(-1)
    assert out["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-5)
    assert out["kl_max"] == pytest.approx(float(kl.max()), rel=1e-5)
    assert out["kl_p99"] == pytest.approx(float(torch.quantile(kl, 0.99)), rel=1e-5)
    assert out["top1_agree"] == float((ref.argmax(-1) == q.argmax(-1)).double().mean())
    ppl_r = math.exp(float(-ref.gather(1, tgt[:, None]).mean()))
    ppl_q = math.exp(float(-q.gather(1, tgt[:, None]).mean()))
    assert out["ppl_ref"] == pytest.approx(ppl_r, rel=1e-5) and out["ppl_delta"] == pytest.approx(ppl_q - ppl_r, rel=1e-4)
    same = compare_logprobs(ref.float(), ref.float(), tgt)
    assert same["kl_max"] == 0 and same["top1_agree"] == 1 and same["ppl_delta"] == 0
    with pytest.raises(ShapeError):
        compare_logprobs(ref, q[:10], tgt)


def test_decode_steps_align_with_teacher_forced_prefill(model, ids):
    ref = fidelity_reference(model, ids)
    d = decode_logprobs(model, ids, prompt_len=8)
    assert d.shape == (2, 24 - 8 - 1, 256)
    # step t consumed token t: its prediction is the full forward's position t
    torch.testing.assert_close(d, ref.logprobs[:, 8:23], atol=2e-5, rtol=0)
    with pytest.raises(ConfigError, match="prompt_len"):
        decode_logprobs(model, ids, prompt_len=23)


def test_identity_config_has_zero_fidelity_loss(model, ids):
    from snapquant.patching import patched

    ref = fidelity_reference(model, ids)
    out = fidelity_metrics(model, ref, PRESETS["bf16"], prompt_len=8, patcher=patched)
    for mode in ("prefill", "decode"):
        assert out[mode]["kl_max"] < 1e-9 and out[mode]["top1_agree"] == 1.0
        assert abs(out[mode]["ppl_rel_delta"]) < 1e-6
    assert out["decode"]["n_positions"] == 2 * 15 and out["prefill"]["n_positions"] == 2 * 23


@pytest.mark.parametrize("name", ["snapmla", "per_tensor_fp8_dynamic"])
def test_quantized_prefill_equals_decode_exactly_when_causal_consistent(model, ids, name):
    """docs/numerics.md, "Why per-token matters": with per-token scales a teacher-forced quantized prefill IS
    step-by-step decode."""
    from snapquant.patching import patched

    cfg = PRESETS[name].replace(prefill="quantized")
    with patched(model, cfg):
        p = prefill_logprobs(model, ids)
        d = decode_logprobs(model, ids, prompt_len=8)
    diff = float((p[:, 8:23] - d).abs().max())
    if cfg.causal_consistent:
        assert diff < 1e-4
    else:  # dynamic per-tensor / per-channel scales drift as tokens arrive
        assert diff > 1e-3


def test_quantized_cache_moves_distributions_and_more_bits_move_them_less(model, ids):
    from snapquant.patching import patched

    ref = fidelity_reference(model, ids)
    fp8 = PRESETS["snapmla_kv_only"]
    int4 = fp8.replace(nope_dtype="int4")  # same per-token layout, 4 instead of 8 bits
    kl = [fidelity_metrics(model, ref, c, modes=("decode",), prompt_len=8, patcher=patched)["decode"]["kl_mean"]
          for c in (fp8, int4)]
    assert 0 < kl[0] < kl[1] / 10


def test_fidelity_cli(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from snapquant.cli import app
    from snapquant.embedded import EMBEDDED_PATH, TINY_ARCH, embedded_config

    if not (EMBEDDED_PATH / "tokenizer.json").is_file():
        pytest.skip("no embedded tokenizer in this checkout")
    import shutil

    from transformers import AutoModelForCausalLM

    ck = tmp_path / "ck"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(embedded_config(TINY_ARCH)).save_pretrained(ck)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (EMBEDDED_PATH / f).is_file():
            shutil.copy(EMBEDDED_PATH / f, ck / f)
    r = CliRunner().invoke(app, ["fidelity", "--model", str(ck), "-p", "bf16", "-p", "snapmla", "--seq-len", "20",
                                 "--num-sequences", "2", "--prompt-len", "8", "--device", "cpu",
                                 "--out", str(tmp_path / "f")])
    assert r.exit_code == 0, r.output
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("| snapmla | decode | 2 / 22 |"))  # 2 x (20 - 8 - 1)
    assert row.count("[") == 6  # every statistic with its interval (the max's included)
    import pandas as pd

    df = pd.read_csv(tmp_path / "f" / "fidelity.csv")
    assert {"kl_mean_ci_low", "top1_agree_ci_high", "share_kl_gt_0.1", "n_sequences"} <= set(df.columns)
    assert (df["kl_mean_ci_low"] <= df["kl_mean"]).all() and (df["top1_agree"] <= df["top1_agree_ci_high"]).all()
    r = CliRunner().invoke(app, ["fidelity", "--model", str(ck), "-p", "snapmal"])
    assert r.exit_code == 2 and "snapmla" in r.output


def test_kept_positions_are_the_values_behind_the_means_and_intervals(model, ids):
    import numpy as np

    from snapquant.patching import patched

    ref = fidelity_reference(model, ids)
    out = fidelity_metrics(model, ref, PRESETS["per_tensor_fp8"], prompt_len=8, patcher=patched, keep_positions=True,
                           n_resamples=200)
    for mode, n_pos, first in (("prefill", 23, 0), ("decode", 24 - 8 - 1, 8)):
        res = out[mode]
        pos = res["positions"]
        kl, flip = pos["kl"], pos["flip"]
        assert kl.shape == flip.shape == pos["ref_top1"].shape == (2, n_pos) and kl.dtype == np.float64
        assert kl.mean() == pytest.approx(res["kl_mean"], rel=1e-12) and kl.max() == res["kl_max"]
        assert 1 - flip.mean() == res["top1_agree"] and set(np.unique(flip)) <= {0.0, 1.0}
        assert (flip == (pos["ref_top1"] != pos["quant_top1"])).all()
        # position j predicts token first + j + 1: the reference's top-1 there is the reference's argmax
        np.testing.assert_array_equal(pos["ref_top1"], ref.logprobs[:, first:first + n_pos].argmax(-1).numpy())
        assert res["first_position"] == first and res["n_sequences"] == 2 and res["n_positions"] == 2 * n_pos
        s = res["summary"]
        assert s["kl_mean"]["value"] == pytest.approx(res["kl_mean"], rel=1e-12)
        assert s["kl_mean"]["ci_low"] <= s["kl_mean"]["value"] <= s["kl_mean"]["ci_high"]
        assert s["flip_rate"]["value"] == pytest.approx(1 - res["top1_agree"], abs=1e-15)
        assert res["per_sequence"]["kl_sum"] == pytest.approx(kl.sum(1).tolist(), rel=1e-12)
        assert res["per_sequence"]["n_positions"] == [n_pos, n_pos]
    plain = fidelity_metrics(model, ref, PRESETS["per_tensor_fp8"], modes=("decode",), prompt_len=8, patcher=patched,
                             n_resamples=200)
    assert "positions" not in plain["decode"]  # cell JSONs hold the per-sequence sums, not the positions
    assert plain["tokens_sha256"] == out["tokens_sha256"] and len(plain["tokens_sha256"]) == 16


def test_default_depths_reach_the_context():
    from snapquant.eval.fidelity import default_depths

    assert default_depths(4096, 32) == [256, 512, 1024, 2048, 3072, 4063]
    assert default_depths(4096, 16)[-1] == 4079 and default_depths(1024, 32) == [64, 128, 256, 512, 768, 991]
    with pytest.raises(ConfigError):
        default_depths(8, 8)


def test_depth_windows_shared_latents_equal_a_prefill_per_depth_and_the_reference_is_unpatched(model):
    """The shared exact latents, appended in one go, give each depth's windows what a real d-token bf16 prefill
    gives (per-token, frozen dynamic per-tensor and KIVI-grouped scales alike), up to fp32 summation order;
    the reference is the unpatched model's log-probs at the window positions, bit for bit."""
    from snapquant.eval.fidelity import _identity_config, depth_window_metrics
    from snapquant.patching import patched

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 256, (3, 40), generator=g)
    cfgs = {"snapmla": PRESETS["snapmla"], "dyn": PRESETS["per_tensor_fp8_dynamic"],
            "kivi": PRESETS["fp8_kivi"].replace(token_group=4)}
    depths, steps = [5, 12, 30], 6
    shared = depth_window_metrics(model, ids, cfgs, depths, steps, patcher=patched)
    own = depth_window_metrics(model, ids, cfgs, depths, steps, patcher=patched, shared_prefill=False)
    ref = fidelity_reference(model, ids).logprobs
    cols = [d + j for d in depths for j in range(steps)]
    for label in cfgs:
        s, o = shared[label], own[label]
        assert s["kl"].shape == (3, len(depths) * steps) and list(s["positions"]) == cols
        assert list(s["depth"]) == [d for d in depths for _ in range(steps)]
        assert s["kl"].min() > 0 and float(s["kl"].mean()) > 1e-8  # the quantized cache is read
        # fp32 summation order moves single positions' KL by < 0.2% (a scale from other tokens would move far more)
        np.testing.assert_allclose(s["kl"], o["kl"], rtol=2e-3, atol=1e-12)
        assert float(s["kl"].mean()) == pytest.approx(float(o["kl"].mean()), rel=1e-4)
        assert (s["flip"] == o["flip"]).all()
        np.testing.assert_array_equal(s["ref_top1"], ref[:, cols].argmax(-1).numpy())
    # the reference forward runs the identity config: bit-identical to the unpatched model
    with patched(model, _identity_config()):
        same = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    assert torch.equal(same, ref)
    with pytest.raises(ConfigError, match="depths"):
        depth_window_metrics(model, ids, cfgs, [35], steps, patcher=patched)
