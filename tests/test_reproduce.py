"""`snapquant.reproduce`: every committed results file is claimed by exactly one listed command, and
every listed command's script exists (the commands themselves are not run here)."""

import subprocess
from pathlib import Path

import pytest

from snapquant import reproduce
from snapquant.reproduce import JOBS, ROOT, claimed_by, folders, main


def _committed_results() -> list[str]:
    """Files under results/ in git's index (sweep outputs such as results/quickstart/ are ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "results"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the committed results cannot be listed")
    files = [f for f in out.stdout.decode().split("\0") if f]
    if not files:
        pytest.skip("no committed results in this checkout")
    return files


def test_every_committed_results_file_has_exactly_one_producer():
    unclaimed, ambiguous = [], []
    for f in _committed_results():
        jobs = claimed_by(f)
        if not jobs:
            unclaimed.append(f)
        elif len(jobs) > 1:
            ambiguous.append((f, [j.command() for j in jobs]))
    assert not unclaimed, f"results files no reproduce job writes (add one to snapquant/reproduce.py): {unclaimed}"
    assert not ambiguous, f"results files claimed by several jobs: {ambiguous}"


def test_every_results_folder_is_listed_and_every_listing_is_current():
    committed = _committed_results()
    dirs = {Path(f).parent.as_posix() for f in committed}
    assert dirs <= set(folders()), f"results folders missing from the listing: {sorted(dirs - set(folders()))}"
    for job in JOBS:
        assert any(job in claimed_by(f) for f in committed), f"listed job writes no committed file: {job.command()}"


def test_every_listed_script_exists_and_jobs_are_well_formed():
    for job in JOBS:
        assert job.target_exists(), f"{job.target} (from `{job.command()}`) does not exist"
        assert job.device in reproduce.DEVICES
        assert job.folder.startswith("results/") and (ROOT / job.folder).is_dir()
        if job.stdout:
            assert any(Path(job.stdout).match(p) for p in job.outputs), job.stdout
    # a target that does not exist is reported as missing (the check above can fail)
    ghost = reproduce.Job("results/bench", "cpu", ("scripts/no_such_script.py",), ("x",), "ghost")
    assert not ghost.target_exists()
    assert not reproduce.Job("results/bench", "cpu", ("-m", "snapquant.no_such"), ("x",), "ghost").target_exists()
    assert not reproduce.Job("results/kernels", "gpu", ("-m", "pytest", "tests/test_no_such.py"), ("x",),
                             "ghost").target_exists()


def test_cli_lists_every_folder_and_rejects_unknown_ones(capsys):
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    for job in JOBS:
        assert job.folder in listed and job.command() in listed
    assert main(["--cpu", "--only", "results/nowhere"]) == 2
    assert "results/nowhere" in capsys.readouterr().err


def test_selection_and_dry_run(capsys):
    cpu = reproduce.select("cpu", None)
    assert cpu and all(j.device == "cpu" and not j.manual for j in cpu)
    assert all(not j.manual for j in reproduce.select("gpu", None))
    manual = [j for j in JOBS if j.manual]
    assert all(j in reproduce.select(j.device, [j.folder]) for j in manual)  # --only names it: it runs
    assert main(["--gpu", "--dry-run", "--only", "results/kernels/"]) == 0
    out = capsys.readouterr().out
    assert out.count("[") == len([j for j in JOBS if j.folder == "results/kernels"])
    assert "scripts/check_kernels_gpu.py" in out


def test_run_job_keeps_a_failing_commands_log(tmp_path, capsys):
    """A stdout job's output is shown and written to its file, also when the command fails."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "noisy.py").write_text("import sys\nprint('line one')\nsys.exit(3)\n")
    job = reproduce.Job("results/x", "cpu", ("scripts/noisy.py",), ("log.txt",), "test", stdout="log.txt")
    assert reproduce.run_job(job, root=tmp_path) == 3
    assert (tmp_path / "results/x/log.txt").read_text() == "line one\n"
    assert "line one" in capsys.readouterr().out
    plain = reproduce.Job("results/y", "cpu", ("scripts/noisy.py",), ("*",), "test")
    assert reproduce.run_job(plain, root=tmp_path) == 3 and (tmp_path / "results/y").is_dir()
