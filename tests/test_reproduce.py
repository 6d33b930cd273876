"""`snapquant.reproduce`: every committed results file is claimed by exactly one listed command, and
every listed command's script exists (the commands themselves are not run here)."""

import json
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
        # results/ itself holds only claims.md, the summary written from the folders' tables
        assert (job.folder.startswith("results/") or job.folder == "results") and (ROOT / job.folder).is_dir()
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


# ---------------------------------------------------------------------------------------------- --stale
def test_every_jobs_declared_code_exists():
    for job in JOBS:
        missing = [p for p in job.code_paths if not (ROOT / p).exists()]
        assert not missing, f"{job.command()}: declared code paths that do not exist: {missing}"


def test_recorded_commit_reads_json_jsonl_and_text(tmp_path):
    from snapquant.staleness import recorded_commit

    sha = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / "a.json").write_text(json.dumps({"env": {"git_commit": sha}}))
    (tmp_path / "b.jsonl").write_text('{"commit": null}\nnot json\n{"x": [{"commit": "abcdef1"}]}\n')
    (tmp_path / "c.md").write_text("| git_commit | 7c2f294 |\n")
    (tmp_path / "d.md").write_text("Produced on an H200 at commit a0ae444 (two calls).\n")
    (tmp_path / "e.csv").write_text("a,b\n1,2\n")
    (tmp_path / "f.png").write_bytes(b"\x89PNG commit abcdef1")
    got = [recorded_commit(tmp_path / n) for n in ("a.json", "b.jsonl", "c.md", "d.md", "e.csv", "f.png")]
    assert got == [sha, "abcdef1", "7c2f294", "a0ae444", None, None]


def _git(root, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_stale_report_compares_the_recorded_commit_with_the_jobs_code(tmp_path):
    """A result is current until a commit touches its job's script or declared code; commits elsewhere and
    files without a recorded commit (they take the job's) do not change that; an unknown commit is reported."""
    from snapquant.staleness import stale_report

    _git(tmp_path, "init", "-q")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "scripts" / "make.py").write_text("print(1)\n")
    (tmp_path / "pkg" / "code.py").write_text("x = 1\n")
    (tmp_path / "other.py").write_text("y = 1\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "code")
    produced_at = _git(tmp_path, "rev-parse", "HEAD")
    out = tmp_path / "results" / "x"
    out.mkdir(parents=True)
    (out / "r.json").write_text(json.dumps({"git_commit": produced_at}))
    (out / "r.png").write_bytes(b"png")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "results")
    job = reproduce.Job("results/x", "cpu", ("scripts/make.py",), ("r.*",), "test", code=("pkg",))
    files = ["results/x/r.json", "results/x/r.png"]

    def report():
        return stale_report((job,), lambda f: [job], files, tmp_path)

    [v] = report()
    assert not v.stale and v.files == tuple(files) and v.commit == produced_at and "current" in v.line()
    (tmp_path / "other.py").write_text("y = 2\n")
    _git(tmp_path, "commit", "-qam", "unrelated")
    assert not report()[0].stale
    (tmp_path / "pkg" / "code.py").write_text("x = 2\n")
    _git(tmp_path, "commit", "-qam", "change the code")
    [v] = report()
    assert v.stale and v.later == 1 and "change the code" in v.newest and v.line().lstrip().startswith("STALE")
    (out / "r.json").write_text(json.dumps({"git_commit": "deadbee"}))
    [v] = report()
    assert v.stale and v.commit is None and "unknown commit deadbee" in v.line()


def test_cli_stale_lists_every_committed_group(capsys):
    committed = _committed_results()
    rc = main(["--stale"])
    out = capsys.readouterr().out
    assert rc in (0, 1) and "result groups stale" in out
    assert all(f"{Path(f).parent.as_posix()}: " in out for f in committed)  # every folder has a verdict line


def test_experiment_jobs_write_their_results_folder():
    """The experiment scripts default to the git-ignored runs/NAME; a job that did not pass --out would
    rerun and leave the committed results untouched."""
    for job in JOBS:
        if job.target.startswith("experiments/"):
            argv = list(job.argv)
            assert "--out" in argv and argv[argv.index("--out") + 1] == job.folder, job.command()
