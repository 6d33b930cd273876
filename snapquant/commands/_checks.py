"""Argument checks the commands run before loading or computing anything.

Each raises one `ConfigError` naming the option as the user typed it and what is valid; the
commands turn it into `error: ...` and exit code 2. Light imports only (no torch, no transformers).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigError, unknown_choice

MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_int(option: str, value: int, minimum: int = 1, maximum: int | None = None) -> None:
    if value < minimum or (maximum is not None and value > maximum):
        valid = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{option}={value} is not valid; expected an integer {valid}")


def check_positive(option: str, value: float) -> None:
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{option}={value} is not valid; expected a positive finite number")


def check_choices(option: str, values: Iterable[str] | None, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    for v in values or ():
        if v not in allowed:
            raise unknown_choice(option, v, allowed)


def check_suffix(option: str, path: Path | None, suffixes: tuple[str, ...]) -> None:
    if path is not None and path.suffix not in suffixes:
        raise ConfigError(f"{option}={str(path)!r}: the file type is taken from its suffix; "
                          f"use one of {', '.join(suffixes)}")
    if path is not None and path.is_dir():
        raise ConfigError(f"{option}={str(path)!r} is a directory; give a file name ending in {', '.join(suffixes)}")


def check_out_dir(option: str, path: Path | None) -> None:
    if path is not None and path.exists() and not path.is_dir():
        raise ConfigError(f"{option}={str(path)!r} is a file; give a directory to write into")


def check_text(option: str, path: Path | None) -> None:
    if path is None:
        return
    if not path.is_file():
        raise ConfigError(f"{option}={str(path)!r} is not a file; give a .txt file, or .jsonl with a 'text' field")
    if path.suffix not in (".txt", ".jsonl", ".json"):
        raise ConfigError(f"{option}={str(path)!r}: expected a .txt, .jsonl or .json file")


def check_model(option: str, model: str) -> None:
    """'embedded' or a local checkpoint directory with config.json (what `load_model` accepts)."""
    if model == "embedded":
        return
    p = Path(model)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ConfigError(f"{option}={model!r}: not 'embedded' and not a checkpoint directory with config.json "
                          f"(hub names cannot be downloaded here; pass a local path)")


def check_device(option: str, device: str) -> None:
    if not _DEVICE_RE.match(device):
        raise ConfigError(f"{option}={device!r} is not valid; allowed values: auto, cpu, cuda, cuda:N")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{option}={device!r} but CUDA is not available on this machine; use cpu or auto")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"{option}={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
