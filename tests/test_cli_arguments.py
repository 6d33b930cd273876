"""Every option of the model-loading commands is checked before anything loads: one `error:` line
naming the option, exit code 2, and the model loader never called."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from snapquant.cli import app


@pytest.fixture
def no_model_loads(monkeypatch):
    import snapquant.embedded
    import snapquant.eval.model

    def never(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(snapquant.eval.model, "load_model", never)
    monkeypatch.setattr(snapquant.embedded, "load_embedded", never)


def _one_error_line(res, option: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], res.output


FIDELITY = [
    (["--mode", "sideways"], "--mode='sideways'"),
    (["--seq-len", "16", "--prompt-len", "32"], "--prompt-len=32"),
    (["--seq-len", "16", "--prompt-len", "15"], "--prompt-len=15"),  # no decode step left to score
    (["--prompt-len", "0"], "--prompt-len=0"),
    (["--seq-len", "2", "--mode", "prefill"], "--seq-len=2"),
    (["--num-sequences", "0"], "--num-sequences=0"),
    (["--backend", "cuda"], "--backend='cuda'"),
    (["--model-dtype", "fp8"], "--model-dtype='fp8'"),
    (["--device", "gpu"], "--device='gpu'"),
    (["--model", "{tmp}/no_checkpoint"], "--model="),
    (["--text", "{tmp}/missing.txt"], "--text="),
    (["--out", "{tmp}/a_file"], "--out="),
    (["-p", "snapmlaa"], "did you mean 'snapmla'"),
]

SENSITIVITY = [
    (["--dtype", "fp7"], "--dtype='fp7'"),
    (["--granularity", "per_galaxy"], "--granularity='per_galaxy'"),
    (["--scheme", "snapmlaa"], "did you mean 'snapmla'"),
    (["--block-size", "0"], "--block-size=0"),
    (["--outlier-sigma", "-1"], "--outlier-sigma=-1.0"),
    (["--seq-len", "1"], "--seq-len=1"),
    (["--num-sequences", "0"], "--num-sequences=0"),
    (["--model-dtype", "double"], "--model-dtype='double'"),
    (["--device", "tpu"], "--device='tpu'"),
    (["--model", "{tmp}/no_checkpoint"], "--model="),
    (["--text", "{tmp}/missing.txt"], "--text="),
    (["--out", "{tmp}/a_file"], "--out="),
]


@pytest.mark.parametrize("command, args, option", [("fidelity", a, o) for a, o in FIDELITY]
                         + [("sensitivity", a, o) for a, o in SENSITIVITY])
def test_bad_arguments_fail_before_the_model_loads(command, args, option, tmp_path, no_model_loads):
    (tmp_path / "a_file").write_text("x")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    _one_error_line(CliRunner().invoke(app, [command, *args, "--device", "cpu"] if "--device" not in args
                                       else [command, *args]), option)


def test_sensitivity_no_plots_flag_reads_as_written():
    res = CliRunner().invoke(app, ["sensitivity", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--no-plots" in res.output and "--no-no-plots" not in res.output


def test_cli_text_is_self_contained_and_consistent():
    """Help and listings speak for themselves (no references to the development tracker), flags read
    as written, and the quickstart config states the README's run time."""
    import re
    from pathlib import Path

    import typer.main

    commands = sorted(typer.main.get_command(app).commands)
    assert {"bench", "fidelity", "formats", "sensitivity", "sweep", "table"} <= set(commands)
    runner = CliRunner()
    for args in [[c, "--help"] for c in commands] + [["--help"], ["bench", "--list"]]:
        res = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert res.exit_code == 0, (args, res.output)
        assert "issue" not in res.output.lower() and "--no-no-" not in res.output, (args, res.output)
    root = Path(__file__).resolve().parents[1]
    readme = re.search(r"\((\d+) s on 2 idle CPU cores\)", (root / "README.md").read_text())
    quick = re.search(r"about (\d+) s on 2 idle cores", (root / "configs" / "quickstart.yaml").read_text())
    assert readme and quick and readme.group(1) == quick.group(1)
