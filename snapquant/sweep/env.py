"""What ran a cell: package versions and hardware, recorded in every result for reproducibility."""

from __future__ import annotations

import os
import platform
import socket
import sys
from importlib import metadata
from typing import Any

PACKAGES = ("snapquant", "torch", "transformers", "lm_eval", "triton", "numpy", "pandas", "datasets",
            "tokenizers", "safetensors", "submitit", "accelerate")


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
    return {"python": sys.version.split()[0], "packages": package_versions(), "hardware": hardware()}
