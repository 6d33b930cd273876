"""Named configurations (`PRESETS`), loaded from `presets.yaml` beside this file.

`register_preset` adds more at run time; `load_presets(path)` reads a user YAML file of the same
shape. `resolve_config` turns whatever a user passes (a name, a dict, a file, a config) into a
validated `KVQuantConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .config import KVQuantConfig
from .errors import ConfigError, unknown_choice


class UnknownPresetError(ConfigError, KeyError):
    """`PRESETS[name]` for a name that is not registered: names the valid presets and the nearest one.
    A KeyError too, so `except KeyError` around a lookup keeps working."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class PresetRegistry(dict):
    """The preset name -> KVQuantConfig mapping; a missing name raises `UnknownPresetError`."""

    def __missing__(self, name: object) -> KVQuantConfig:
        raise UnknownPresetError(str(unknown_choice("preset", name, self)))


PRESETS: dict[str, KVQuantConfig] = PresetRegistry()


def register_preset(name: str, config: KVQuantConfig | Mapping[str, Any], overwrite: bool = False) -> KVQuantConfig:
    if name in PRESETS and not overwrite:
        raise ConfigError(f"preset {name!r} already exists; pass overwrite=True to replace it")
    cfg = config if isinstance(config, KVQuantConfig) else KVQuantConfig.from_dict(dict(config))
    cfg = cfg.replace(name=name)
    PRESETS[name] = cfg
    return cfg


def load_presets(path: str | Path, overwrite: bool = False) -> list[str]:
    """Register every entry of a presets YAML file; returns the names added."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a presets file maps names to configs")
    for name, body in data.items():
        try:
            register_preset(name, body or {}, overwrite=overwrite)
        except ConfigError as e:
            raise ConfigError(f"{path}: preset {name!r}: {e}") from None
    return list(data)


def resolve_config(spec: str | Path | Mapping[str, Any] | KVQuantConfig) -> KVQuantConfig:
    """A preset name, a config, a dict, or a path to a .yaml/.json config -> KVQuantConfig."""
    if isinstance(spec, KVQuantConfig):
        return spec
    if isinstance(spec, Mapping):
        return KVQuantConfig.from_dict(dict(spec))
    if isinstance(spec, (str, Path)):
        s = str(spec)
        if s in PRESETS:
            return PRESETS[s]
        if s.endswith((".yaml", ".yml", ".json")) or Path(s).is_dir():
            return KVQuantConfig.from_pretrained(s)
        raise unknown_choice("preset", s, PRESETS)
    raise ConfigError(f"cannot build a KVQuantConfig from {type(spec).__name__}; pass a preset name, dict or config")


load_presets(Path(__file__).with_name("presets.yaml"))
