"""results/claims.md and the README's copy of it: written from the committed tables, never by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from snapquant.analysis import claims as C

ROOT = Path(__file__).resolve().parents[1]


def test_claims_file_and_readme_block_match_the_committed_tables():
    """A table regenerated without rerunning scripts/write_claims.py --readme fails here."""
    text = C.claims_file(ROOT)
    assert (ROOT / "results" / "claims.md").read_text() == text
    assert C.quoted_block((ROOT / "README.md").read_text()) == C.quoted_block(text)


def test_the_check_mode_of_the_script_agrees():
    res = subprocess.run([sys.executable, "scripts/write_claims.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr


def _pv_table(root: Path) -> None:
    rows = []
    for name, ratio, p in (("snapmla", 1.0, 1.0), ("snapmla_naive_pv", 2.0, 0.0123)):
        rows.append({"pipeline": name, "decode_kl_mean": 1e-3 * ratio, "decode_kl_mean_ci_low": 8e-4 * ratio,
                     "decode_kl_mean_ci_high": 1.2e-3 * ratio, "decode_kl_mean_n_positions": 2048,
                     "decode_kl_mean_n_sequences": 16, "kl_ratio_vs_snapmla": ratio,
                     "kl_ratio_vs_snapmla_ci_low": 0.75 * ratio, "kl_ratio_vs_snapmla_ci_high": 1.25 * ratio,
                     "kl_vs_snapmla_p": p, "decode_kl_max": 0.5 * ratio})
    (root / "results" / "pv_pipeline").mkdir(parents=True)
    pd.DataFrame(rows).to_csv(root / "results" / "pv_pipeline" / "table.csv", index=False)


def test_a_claim_carries_the_tables_effect_interval_p_and_n(tmp_path):
    _pv_table(tmp_path)
    claims, missing = C.collect(tmp_path)
    assert [c.topic for c in claims] == ["PV pipeline"]
    text = claims[0].text
    assert "naive FP8 P" in text and "ratio 2.00 [1.50, 2.50]" in text and "p = 0.012" in text
    assert "n = 16 sequences, 2048 positions" in text
    assert "granularity" in missing and "pv_pipeline" not in missing


def test_rope_vs_nope_count_comes_with_an_exact_sign_test(tmp_path):
    d = tmp_path / "results" / "rope_vs_nope"
    d.mkdir(parents=True)
    pd.DataFrame({"layer": range(6), "attn_err_fp8_only_nope": [1.0] * 6,
                  "attn_err_fp8_only_rope": [2.0, 2.0, 2.0, 2.0, 2.0, 0.5]}).to_csv(d / "table.csv", index=False)
    (claim,) = C.rope_vs_nope_claims(tmp_path)
    # P(X >= 5 or X <= 1), X ~ Binomial(6, 1/2) = 14/64
    assert "5 of 6 layers" in claim.text and "p = 0.22" in claim.text


def test_quoted_block_needs_both_markers():
    with pytest.raises(ValueError):
        C.quoted_block("no markers here")
    assert C.quoted_block(f"x\n{C.BEGIN}\n- a\n{C.END}\ny") == "- a\n"


def test_research_model_claims_state_each_paired_difference_and_the_task_floor(tmp_path):
    res = tmp_path / "results" / "research_model"
    res.mkdir(parents=True)
    pd.DataFrame([{"a": "bf16", "b": "latent_bf16_rope_fp8", "metric": "kl_mean", "delta": 3.8e-4, "ci_low": 1.1e-4,
                   "ci_high": 6.5e-4, "p_value": 0.0002, "n_sequences": 16, "n_positions": 1024},
                  {"a": "bf16", "b": "latent_bf16_rope_fp8", "metric": "flip_rate", "delta": 9.0, "ci_low": 8.0,
                   "ci_high": 10.0, "p_value": 0.5, "n_sequences": 16, "n_positions": 1024}]
                 ).to_csv(res / "comparisons_rope_vs_nope.csv", index=False)
    (res / "eval.json").write_text('{"models": {"research": {"tasks": {"a": {"score": 0.0, "n": 100}, '
                                   '"b": {"score": 0.08, "n": 100}}}}}')
    got = C.research_model_claims(tmp_path)
    assert len(got) == 2
    assert "the RoPE key in FP8, the latent in BF16: 0.00038 [0.00011, 0.00065] (p < 0.001; n = 16 sequences, " \
           "1024 positions)" in got[0].text and "9.0" not in got[0].text  # kl_mean only
    assert "none lies in [0.4, 0.9]" in got[1].text and "0-0.08 over 2 task settings (n = 100 each)" in got[1].text


def test_kernel_claims_give_each_ratio_against_flashmla_with_its_interval(tmp_path):
    g = tmp_path / "results" / "gpu_check"
    g.mkdir(parents=True)
    pd.DataFrame([{"op": "decode", "shape": "128x16x4096", "variant": "snapmla", "vs_flashmla": 0.78,
                   "vs_flashmla_lo": 0.77, "vs_flashmla_hi": 0.79, "runs": 25},
                  {"op": "decode", "shape": "128x16x4096", "variant": "flashmla", "vs_flashmla": 1.0,
                   "vs_flashmla_lo": 1.0, "vs_flashmla_hi": 1.0, "runs": 25}]).to_csv(g / "decode_h200.csv", index=False)
    (c,) = C.kernel_claims(tmp_path)
    assert "128x16x4096 0.78 [0.77, 0.79]" in c.text and ">= 25 timed runs" in c.text
    assert C.kernel_claims(tmp_path / "nowhere") == []
    # the anchor run's table, when present, is the one cited
    b = tmp_path / "results" / "bench"
    b.mkdir()
    pd.DataFrame([{"op": "decode", "shape": "128x16x4096", "variant": "snapmla", "vs_flashmla": 0.75,
                   "vs_flashmla_lo": 0.74, "vs_flashmla_hi": 0.76, "runs": 25}]).to_csv(b / "decode_anchor_h200.csv",
                                                                                      index=False)
    (c,) = C.kernel_claims(tmp_path)
    assert "128x16x4096 0.75 [0.74, 0.76]" in c.text and c.source == "results/bench/decode_anchor_h200.csv"


def test_research_task_claims_carry_exact_intervals_and_the_mcnemar_test(tmp_path):
    from scipy import stats

    res = tmp_path / "results" / "research_model"
    res.mkdir(parents=True)
    rows = [{"task": "mc", "config": "bf16", "score": 0.57, "delta": 0.0, "p_value": 1.0, "discordant": [0, 0], "n": 100},
            {"task": "mc", "config": "snapmla", "score": 0.50, "delta": -0.07, "p_value": 0.016, "discordant": [7, 0],
             "n": 100}]
    (res / "analyses.json").write_text(json.dumps({"parts": {"tasks": {"rows": rows}}}))
    (c,) = C.research_model_claims(tmp_path)
    ci = stats.binomtest(50, 100).proportion_ci(method="exact")
    assert f"snapmla 0.50 [{ci.low:.2f}, {ci.high:.2f}]" in c.text, c.text
    assert "only in BF16 / only under FP8: 7/0, exact McNemar p = 0.016" in c.text and "n = 100 documents" in c.text
