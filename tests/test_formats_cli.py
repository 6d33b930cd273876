"""`snapquant formats`: the table, its files and its errors."""

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from snapquant.cli import app
from snapquant.quant.report import format_report


def test_format_report_rows_are_consistent():
    df = format_report(["bf16", "snapmla", "rope_fp8_per_token"], num_tokens=192, kv_lora_rank=128,
                       rope_dim=32, num_heads=4)
    rows = df.set_index("preset")
    assert list(rows["bytes_per_token"]) == [320, 128 + 4 + 64, 128 + 4 + 32 + 4]
    # the 16-bit baseline keeps far more signal than FP8, and FP8 RoPE loses RoPE signal
    assert rows.loc["bf16", "nope_sqnr_db"] > rows.loc["snapmla", "nope_sqnr_db"] + 15
    assert rows.loc["rope_fp8_per_token", "rope_sqnr_db"] < rows.loc["snapmla", "rope_sqnr_db"] - 15
    assert (df["out_rel_l2"] > 0).all() and (df["out_rel_l2"] < 1).all()


def test_formats_cli_writes_table_and_metadata(tmp_path):
    out = tmp_path / "f.csv"
    args = ["formats", "-p", "bf16", "-p", "snapmla", "--tokens", "96", "--kv-lora-rank", "64",
            "--rope-dim", "16", "--heads", "2", "--seed", "3", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out)
    assert list(df["preset"]) == ["bf16", "snapmla"]
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["parameters"]["seed"] == 3 and meta["parameters"]["num_tokens"] == 96
    assert meta["environment"]["packages"]["torch"] and "hardware" in meta["environment"]


def test_formats_cli_names_a_bad_preset():
    res = CliRunner().invoke(app, ["formats", "-p", "snapmlaa", "--tokens", "64", "--kv-lora-rank", "64",
                                   "--rope-dim", "16"])
    assert res.exit_code == 2
    assert "snapmlaa" in res.output and "did you mean 'snapmla'" in res.output


@pytest.mark.parametrize("args, option", [
    (["--tokens", "0"], "--tokens=0"), (["--tokens", "-5"], "--tokens=-5"), (["--heads", "0"], "--heads=0"),
    (["--kv-lora-rank", "0"], "--kv-lora-rank=0"), (["--rope-dim", "-1"], "--rope-dim=-1"),
    (["--out", "f.xlsx"], ".csv, .md, .json"),
])
def test_formats_cli_rejects_bad_values_in_one_line_before_computing(args, option, tmp_path, monkeypatch):
    import snapquant.quant.report as report

    def never(*a, **k):
        raise AssertionError("format_report ran on invalid arguments")

    monkeypatch.setattr(report, "format_report", never)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["formats", *args])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], res.output
    assert not (tmp_path / "f.xlsx").exists()


def test_formats_cli_tiny_contexts_run_and_a_misfit_preset_is_named():
    small = ["--kv-lora-rank", "64", "--rope-dim", "16", "--heads", "1"]
    res = CliRunner().invoke(app, ["formats", "-p", "snapmla", "-p", "int4_kivi", "--tokens", "1", *small])
    assert res.exit_code == 0, res.output  # one token: the ragged second row is one token too, never empty
    res = CliRunner().invoke(app, ["formats", "-p", "ds_v32", "--tokens", "8", *small])
    assert res.exit_code == 2 and "preset 'ds_v32': block_size=128" in res.output


def test_formats_cli_lists_every_preset_by_default(tmp_path):
    from snapquant import PRESETS

    out = tmp_path / "all.csv"
    res = CliRunner().invoke(app, ["formats", "--tokens", "96", "--kv-lora-rank", "128", "--rope-dim", "16",
                                   "--heads", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out).set_index("preset")
    assert list(df.index) == list(PRESETS)
    for name in ("ds_v32", "ds_v32_vllm", "per_tensor_fp8_vllm", "fp8_kivi"):
        assert name in res.output
    assert df.loc["ds_v32_vllm", "bytes_per_token"] == df.loc["ds_v32", "bytes_per_token"] == 128 + 4 + 32
    assert df.loc["per_tensor_fp8_vllm", "bytes_per_token"] == 128 + 16  # one shared scale: O(1)
    assert (df["out_rel_l2"] < 1).all()
