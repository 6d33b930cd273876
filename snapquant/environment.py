"""What produced a result: package versions, hardware and the git commit, recorded in every results file.

    environment()              the sweep / experiment record: python, package versions, hardware, commit
    device_environment(device) the flat record of the benchmarks and kernel checks: date, device,
                               torch / triton / CUDA / transformers versions, commit, host, GPU properties
    git_commit()               HEAD of this checkout (SNAPQUANT_GIT_COMMIT overrides it)
    package_versions(), hardware()   the parts of `environment()`
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("snapquant", "torch", "transformers", "lm_eval", "triton", "numpy", "pandas", "datasets",
            "tokenizers", "safetensors", "submitit", "accelerate")


def git_commit() -> str | None:
    """HEAD of this checkout; SNAPQUANT_GIT_COMMIT overrides it (a copied tree whose .git is stale)."""
    if os.environ.get("SNAPQUANT_GIT_COMMIT"):
        return os.environ["SNAPQUANT_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
        return out if len(out) == 40 else None
    except Exception:
        return None


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for p in packages:
        try:
            out[p] = metadata.version(p.replace("_", "-"))
        except metadata.PackageNotFoundError:
            try:
                out[p] = metadata.version(p)
            except metadata.PackageNotFoundError:
                out[p] = None
    return out


def hardware() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
    }
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        pass
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                 "capability": f"{p.major}.{p.minor}"})
        info["cuda"] = torch.version.cuda
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID", "CUDA_VISIBLE_DEVICES"):
        if var in os.environ:
            info[var.lower()] = os.environ[var]
    return info


def environment() -> dict[str, Any]:
    """Python, package versions, hardware and commit: recorded in every sweep cell and experiment output."""
    return {"python": sys.version.split()[0], "packages": package_versions(), "hardware": hardware(),
            "git_commit": git_commit()}


def device_environment(device: Any = None) -> dict[str, Any]:
    """The benchmarks' flat record for `device` (default: the current CUDA device, else the CPU)."""
    import torch

    import snapquant

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    versions = package_versions(("triton", "transformers"))
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device), "torch": torch.__version__, "triton": versions["triton"],
        "transformers": versions["transformers"], "cuda": torch.version.cuda,
        "python": platform.python_version(), "snapquant": snapquant.__version__, "git_commit": git_commit(),
        "host": platform.node(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                   l2_bytes=getattr(props, "L2_cache_size", None))
    return env
