"""Expanding a sweep into cells: one `Cell` per KV-cache configuration to evaluate.

Cells come from the listed presets, then the grid (the cartesian product of `grid.axes` applied
on top of `grid.base`), then the baseline preset if neither produced it. A grid combination the
config rejects (e.g. `rope_prescale: true` with a per-channel latent) is not an error of the
sweep file: it is reported as skipped with the reason, and the sweep only fails when no cell is
left. Configurations that are equal (equality ignores the label) are evaluated once.

A cell id is `<label-slug>-<hash>`, the hash covering the full KV config and the sweep's
evaluation settings (`SweepSpec.eval_key`): the same cell of the same sweep always maps to the
same file, which is what makes resume work, and changing a task limit makes fresh cells.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from ..config import DEFAULTS, KVQuantConfig, without_inert_knobs
from ..errors import ConfigError
from ..presets import PRESETS
from .schema import SweepSpec, stable_hash


@dataclass(frozen=True)
class Cell:
    cell_id: str
    label: str
    config: KVQuantConfig
    source: str
    """'preset', 'grid' or 'baseline'."""
    axes: dict = field(default_factory=dict, compare=False)
    """The grid values that define this cell (empty for presets)."""
    is_baseline: bool = False


@dataclass(frozen=True)
class Expansion:
    cells: tuple[Cell, ...]
    skipped: tuple[tuple[str, str], ...]
    """(label, reason) of grid combinations the config rejected or that duplicate an earlier cell."""


def expand(spec: SweepSpec) -> Expansion:
    """All cells of a sweep, in a stable order (presets, grid, baseline)."""
    key = spec.eval_key()
    baseline_cfg = PRESETS[spec.baseline]
    cells: list[Cell] = []
    skipped: list[tuple[str, str]] = []
    seen: dict[KVQuantConfig, str] = {}

    def add(label: str, cfg: KVQuantConfig, source: str, axes: dict | None = None) -> None:
        if cfg in seen:
            skipped.append((label, f"same configuration as {seen[cfg]!r}"))
            return
        seen[cfg] = label
        cid = f"{slug(label)}-{cell_hash(cfg, key)}"
        cells.append(Cell(cid, label, cfg.replace(name=label), source, dict(axes or {}), cfg == baseline_cfg))

    for name in spec.presets:
        add(name, PRESETS[name], "preset")
    if spec.grid is not None:
        # The base is shared by every cell: a knob of it that a cell's formats never read (the base's
        # block_size in a per_token cell) is reset for that cell; an axis value that does nothing is an error.
        if isinstance(spec.grid.base, str):
            base = PRESETS[spec.grid.base].to_dict()
        else:
            KVQuantConfig.from_dict(without_inert_knobs(spec.grid.base))  # errors of the base itself, by name
            base = dict(spec.grid.base)
        names = list(spec.grid.axes)
        for combo in itertools.product(*(spec.grid.axes[a] for a in names)):
            values = dict(zip(names, combo, strict=True))
            label = grid_label(values)
            try:
                cfg = KVQuantConfig(**without_inert_knobs({**base, **values, "name": None}, keep=values))
            except ConfigError as e:
                skipped.append((label, str(e)))
                continue
            add(label, cfg, "grid", values)
    if baseline_cfg not in seen:
        add(spec.baseline, baseline_cfg, "baseline")
    if all(c.is_baseline for c in cells):
        reasons = "; ".join(f"{lbl}: {why}" for lbl, why in skipped[:5])
        raise ConfigError(f"the sweep has no cell besides the baseline {spec.baseline!r}" +
                          (f" (skipped: {reasons})" if reasons else ""))
    return Expansion(tuple(cells), tuple(skipped))


# Fields added to KVQuantConfig after sweeps had been run: hashed only when set, so the cells of earlier
# sweeps keep their ids (and resume) under the default.
_HASHED_WHEN_SET = ("scale_rule", "scale_divisor")


def cell_hash(cfg: KVQuantConfig, eval_key: str) -> str:
    d = cfg.to_dict()
    d.pop("name")
    for f in _HASHED_WHEN_SET:
        if d[f] == DEFAULTS[f]:
            d.pop(f)
    return stable_hash({"kv": d, "eval": eval_key})[:10]


def grid_label(values: dict) -> str:
    short = {"nope_dtype": "nope", "rope_dtype": "rope", "nope_granularity": "ngran",
             "rope_granularity": "rgran", "scale_format": "scale", "rope_prescale": "prescale"}
    return ",".join(f"{short.get(k, k)}={_fmt(v)}" for k, v in values.items())


def _fmt(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def slug(label: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.]+", "-", label).strip("-")
    return s[:60] or "cell"
