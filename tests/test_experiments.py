"""Default outputs: the experiment scripts and `snapquant sensitivity` never write the committed
results/ unless told to (their default is the git-ignored runs/); committed experiment tables can be
re-plotted without the model."""

from __future__ import annotations

import runpy
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if not p.stem.startswith("_"))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _run(monkeypatch, name: str, *args: str) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    runpy.run_path(str(ROOT / "experiments" / f"{name}.py"), run_name="__main__")


def _snapshot(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()}


def test_every_experiment_documents_where_it_writes(monkeypatch, capsys):
    assert set(EXPERIMENTS) == {"granularity_ablation", "long_context", "memory_throughput", "pv_pipeline",
                                "rope_vs_nope"}
    for name in EXPERIMENTS:
        with pytest.raises(SystemExit) as e:
            _run(monkeypatch, name, "--help")
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert f"runs/{name}" in text and "ignored by git" in text and f"--out results/{name}" in text, name
        assert "--replot" in text


def test_a_run_with_default_options_writes_under_runs_not_results(monkeypatch, tmp_path, tiny_ckpt):
    # run from a scratch working directory, as from the repository root: the default is runs/<name>
    monkeypatch.chdir(tmp_path)
    before = _snapshot(ROOT / "results")
    _run(monkeypatch, "memory_throughput", "--model", str(tiny_ckpt), "--device", "cpu", "--contexts", "8",
         "--batch", "1", "--steps", "1")
    out = tmp_path / "runs" / "memory_throughput"
    assert {"memory.csv", "memory.md", "throughput.csv", "memory_throughput.png", "memory_throughput.pdf"} <= {
        p.name for p in out.iterdir()}
    assert not (tmp_path / "results").exists()
    assert _snapshot(ROOT / "results") == before


def test_runs_is_ignored_by_git():
    import subprocess

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("runs/pv_pipeline/table.csv", "runs/sensitivity/summary.md"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True)
        assert r.returncode == 0, f"{path} must be ignored by git (runs/ in .gitignore)"
    r = subprocess.run(["git", "check-ignore", "-q", "results/pv_pipeline/table.csv"], cwd=ROOT, capture_output=True)
    assert r.returncode == 1  # the committed results are not


FIGURES = {"pv_pipeline": ["pv_pipeline"], "granularity_ablation": ["granularity"], "long_context": ["long_context"],
           "memory_throughput": ["memory_throughput"],
           "rope_vs_nope": ["rope_vs_nope", "layer_lines", "sqnr_heatmaps_fp8_e4m3", "channel_heatmaps"]}


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_committed_tables_replot_without_the_model(monkeypatch, tmp_path, name):
    src = ROOT / "results" / name
    if not src.is_dir():
        pytest.skip(f"no committed {src}")
    dst = tmp_path / name
    shutil.copytree(src, dst)
    for f in dst.glob("*.p[nd][gf]"):
        f.unlink()
    _run(monkeypatch, name, "--replot", "--out", str(dst))
    for stem in FIGURES[name]:
        assert (dst / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
        assert (dst / f"{stem}.pdf").read_bytes()[:4] == b"%PDF"


def test_long_context_windows_match_decode_fidelity_metrics_and_replot(monkeypatch, tmp_path, tiny_ckpt):
    """Each (config, depth) row's KL mean and flip rate are those of `fidelity_metrics`' step-by-step decode after a
    real prefill of d tokens (the served path, prefill bf16), scored on the same window positions; every statistic
    carries its interval and n."""
    import pandas as pd

    from snapquant import PRESETS
    from snapquant.eval.fidelity import fidelity_metrics, fidelity_reference, fidelity_sample
    from snapquant.eval.model import load_model
    from snapquant.patching import patched

    out = tmp_path / "lc"
    _run(monkeypatch, "long_context", "--model", str(tiny_ckpt), "--device", "cpu", "--num-sequences", "3",
         "-p", "snapmla", "-p", "per_tensor_fp8_dynamic", "--depths", "16", "8", "--steps", "4", "--batch", "3",
         "--n-resamples", "300", "--out", str(out))
    df = pd.read_csv(out / "table.csv")
    model, tok = load_model(str(tiny_ckpt), dtype="float32", device="cpu")
    ids = fidelity_sample(tok, None, 16 + 4 + 1, 3).input_ids
    assert pd.read_csv(out / "sequences.csv")["document"].nunique() == 3  # one held-out file per sequence
    for name in ("snapmla", "per_tensor_fp8_dynamic"):
        s = df[df["config"] == name].sort_values("depth")
        assert list(s["depth"]) == [8, 16] and list(s["first_position"]) == [8, 16] and list(s["last_position"]) == [11, 19]
        for _, r in s.iterrows():
            d = int(r["depth"])
            sub = ids[:, :d + 4 + 1]
            fm = fidelity_metrics(model, fidelity_reference(model, sub), PRESETS[name], modes=("decode",),
                                  prompt_len=d, patcher=patched, keep_positions=True)["decode"]["positions"]
            assert r["kl_mean"] == pytest.approx(fm["kl"].mean(), rel=1e-3)
            assert r["flip_rate"] == pytest.approx(fm["flip"].mean(), abs=1e-12)
            assert r["n_sequences"] == 3 and r["n_positions"] == 3 * 4
            for stat in ("kl_mean", "kl_p99", "flip_rate"):
                assert r[f"{stat}_ci_low"] <= r[stat] <= r[f"{stat}_ci_high"]
            assert r["kl_mean_ci_low"] < r["kl_mean_ci_high"]  # three different sequences: a real interval
    ch = pd.read_csv(out / "depth_change.csv")
    assert set(ch["metric"]) == {"kl_mean", "flip_rate"} and (ch["depth_a"] == 8).all() and (ch["depth_b"] == 16).all()
    top = pd.read_csv(out / "top_positions.csv")
    assert set(top["config"]) == {"snapmla", "per_tensor_fp8_dynamic"} and top["document"].notna().all()
    assert set(top["depth"]) <= {8, 16}
    assert "held-out files hold a whole 21-token sequence" in (out / "table.md").read_text()
    for f in ("long_context.png", "long_context.pdf"):
        (out / f).unlink()
    _run(monkeypatch, "long_context", "--replot", "--out", str(out))
    assert (out / "long_context.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "long_context.pdf").read_bytes()[:4] == b"%PDF"


def test_long_context_rejects_a_window_past_the_model_context(monkeypatch, tiny_ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, "long_context", "--model", str(tiny_ckpt), "-p", "snapmla", "--depths", "5000")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--depths 5000" in err and "1024" in err
    with pytest.raises(SystemExit) as e:  # the default presets include ds_v32, whose 128-wide tiles the tiny model lacks
        _run(monkeypatch, "long_context", "--model", str(tiny_ckpt))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "--preset ds_v32" in err


def test_replot_without_a_table_is_one_line_rc_2(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _run(monkeypatch, "pv_pipeline", "--replot", "--out", str(tmp_path / "none"))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "per_layer.csv" in err


def test_sensitivity_cli_default_output_is_under_runs(monkeypatch, tmp_path, tiny_ckpt):
    from typer.testing import CliRunner

    from snapquant.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["sensitivity", "--model", str(tiny_ckpt), "--seq-len", "16", "--num-sequences", "1",
                                 "--dtype", "fp8_e4m3", "--granularity", "per_token", "--device", "cpu", "--no-plots"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs" / "sensitivity" / "layer_error.csv").is_file()
    assert not (tmp_path / "results").exists()
