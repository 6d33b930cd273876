"""`KVQuantConfig`: one declarative, validated, serialisable description of a KV-cache scheme.

A config says what is stored for each token of the MLA cache (the NoPE latent and the RoPE key),
with which scales, and how decode consumes it (query precision, PV pipeline, prefill). It is
validated on construction: an unknown field or value raises one `ConfigError` naming the field and
the allowed values, before any compute. So does a knob the chosen formats never read (`KNOB_SCOPE`:
e.g. `token_group` without a per-channel part), which would otherwise be silently ignored. Width-dependent checks (block sizes that must divide the
latent width, int4 needing an even width) run in `check_dims`, which the quantizer calls first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .constants import PAGE_SIZE
from .errors import ConfigError, unknown_choice
from .quant.dtypes import ELEMENT_FORMATS, get_element_format
from .quant.scales import SCALE_FORMATS, SCALE_RULES

_RULE_WHY = {  # why a rule takes only some scale formats (every format works with "snapquant")
    "flashmla": "FlashMLA's reference rounds every tile scale up to a power of two",
    "vllm": "vLLM's cache writers store plain fp32 scales",
}

GRANULARITIES = ("per_tensor_dynamic", "per_tensor_static", "per_channel", "per_token", "per_token_block")
# Latent granularities with one scale per token (per-tensor: the same for every token), which pre-scaled
# RoPE can divide by.
PRESCALE_GRANULARITIES = ("per_token", "per_tensor_static", "per_tensor_dynamic")
QUERY_MODES = ("bf16", "fp8_e4m3")
PV_MODES = ("bf16", "fp8_scale_fused", "fp8_naive")
PREFILL_MODES = ("bf16", "quantized")


@dataclass(frozen=True)
class KVQuantConfig:
    """How the MLA latent cache is quantized and how decode reads it.

    Defaults are the SnapMLA paper configuration (FP8 e4m3 latent, one fp32 scale per token, BF16
    RoPE pre-divided by that scale, FP8 query per token-head, scale-fused FP8 PV, BF16 prefill).
    """

    nope_dtype: str = "fp8_e4m3"
    """Storage of the NoPE latent (kv_lora_rank wide): bf16 | fp16 | fp8_e4m3 | fp8_e5m2 | int8 | int4."""
    rope_dtype: str = "bf16"
    """Storage of the shared RoPE key (qk_rope_head_dim wide); same choices."""
    nope_granularity: str = "per_token"
    """Which elements share a scale in the latent (read only with a quantized nope_dtype)."""
    rope_granularity: str = "per_token"
    """Which elements share a scale in the RoPE part (read only with a quantized rope_dtype, no rope_prescale)."""
    block_size: int = 128
    """Channels per scale for per_token_block (128 in DeepSeek-V3.2); must divide the part's width."""
    token_group: int | None = None
    """Tokens per scale for per_channel (KIVI groups); None = one scale per channel over all tokens."""
    nope_scale: float | None = None
    """Fixed latent scale for per_tensor_static (given, or filled by `snapquant.calibrate`)."""
    rope_scale: float | None = None
    """Fixed RoPE scale for per_tensor_static."""
    scale_format: str = "fp32"
    """fp32 | pow2 (rounded up to a power of two) | e8m0 (one exponent byte)."""
    rope_prescale: bool = True
    """RoPE stored divided by the latent's scale, with no scale of its own: SnapMLA's pre-scaled domain
    alignment (16-bit rope_dtype: bf16(rope / s), s per token), or vLLM's one shared scale (a quantized
    rope_dtype: e4m3(rope / s), s the latent's per-tensor scale)."""
    query: str = "fp8_e4m3"
    """bf16 | fp8_e4m3 (per token-head scale over the absorbed NoPE query; RoPE query pre-scaled)."""
    pv: str = "fp8_scale_fused"
    """bf16 | fp8_scale_fused (SnapMLA) | fp8_naive (P cast straight to FP8, V scale kept outside)."""
    prefill: str = "bf16"
    """bf16 (attend to fresh activations, as in serving) | quantized (attend to the quantized latent)."""
    pv_block: int = PAGE_SIZE
    """Tokens per online-softmax block; P is quantized per row per block (default: the kernels' page size, 64)."""
    scale_rule: str = "snapquant"
    """How a scale follows from amax: snapquant (amax / D; 1 if amax = 0; floored at 2^-86) | flashmla
    (FlashMLA's reference: max(amax / D, 1e-4) rounded up to a power of two through an fp32 log2; pow2 or
    e8m0) | vllm (vLLM's cache writers: max(amax / D, FLT_MIN); fp32)."""
    scale_divisor: float | None = None
    """D, the value a part's amax maps to; None = the element format's qmax (448 for e4m3). vLLM's
    per-tensor kv scale uses 200 (its K_SCALE_CONSTANT), leaving headroom for later tokens."""
    name: str | None = field(default=None, compare=False)
    """Label used in tables; presets set it. Not part of equality."""

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for f in ("nope_dtype", "rope_dtype"):
            get_element_format(getattr(self, f), field=f)
        for f in ("nope_granularity", "rope_granularity"):
            _choice(f, getattr(self, f), GRANULARITIES)
        _choice("scale_format", self.scale_format, SCALE_FORMATS)
        _choice("scale_rule", self.scale_rule, SCALE_RULES)
        _choice("query", self.query, QUERY_MODES)
        _choice("pv", self.pv, PV_MODES)
        _choice("prefill", self.prefill, PREFILL_MODES)
        _positive_int("block_size", self.block_size)
        _positive_int("pv_block", self.pv_block)
        if self.token_group is not None:
            _positive_int("token_group", self.token_group)
        for f in ("nope_scale", "rope_scale", "scale_divisor"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
                raise ConfigError(f"{f}={v!r} is not valid; expected a positive finite float or null")
        if not isinstance(self.rope_prescale, bool):
            raise ConfigError(f"rope_prescale={self.rope_prescale!r} is not valid; allowed values: true, false")
        if self.rope_prescale:
            if not self.nope_format.is_quantized:
                raise ConfigError(
                    f"rope_prescale=true needs a quantized nope_dtype (RoPE is divided by the latent's scale); "
                    f"nope_dtype={self.nope_dtype!r} has no scale. Set rope_prescale: false."
                )
            if self.nope_granularity not in PRESCALE_GRANULARITIES:
                raise ConfigError(
                    f"rope_prescale=true needs one latent scale per token to divide RoPE by: nope_granularity "
                    f"one of {', '.join(PRESCALE_GRANULARITIES)}; got nope_granularity={self.nope_granularity!r}."
                )
        formats = SCALE_RULES[self.scale_rule]
        if self.scale_format not in formats and (_own_scales(self.to_dict(), "nope")
                                                 or _own_scales(self.to_dict(), "rope")):
            raise ConfigError(
                f"scale_rule={self.scale_rule!r} is defined with scale_format {' or '.join(formats)}, not "
                f"{self.scale_format!r} ({_RULE_WHY[self.scale_rule]})"
            )
        inert = inert_knobs(self.to_dict())
        if inert:
            what = "; ".join(f"{f}={getattr(self, f)!r} has no effect in this config: it is read only with "
                             f"{KNOB_SCOPE[f][0]}" for f in inert)
            defaults = ", ".join(f"{f}={DEFAULTS[f]!r}" for f in inert)
            raise ConfigError(f"{what} (this config: {self.short_description()}). Remove it (default {defaults}) "
                              f"or choose a format that reads it.")

    def check_dims(self, kv_lora_rank: int, rope_dim: int) -> None:
        """Width-dependent validation; raises ConfigError naming the field."""
        for part, width in (("nope", kv_lora_rank), ("rope", rope_dim)):
            if not isinstance(width, int) or width <= 0:
                raise ConfigError(f"{part} width must be a positive int, got {width!r}")
            fmt = self.part_format(part)
            if not fmt.is_quantized:
                continue
            if fmt.bits == 4 and width % 2:
                raise ConfigError(
                    f"{part}_dtype='int4' packs two values per byte and needs an even width; {part} width is {width}"
                )
            if part == "rope" and self.rope_prescale:
                continue  # the latent's scale: no granularity of its own
            if self.part_granularity(part) == "per_token_block" and width % self.block_size:
                raise ConfigError(
                    f"block_size={self.block_size} does not divide the {part} width {width} "
                    f"({part}_granularity='per_token_block'); choose a divisor of {width}"
                )

    # ------------------------------------------------------------------ helpers
    @property
    def nope_format(self):
        return get_element_format(self.nope_dtype)

    @property
    def rope_format(self):
        return get_element_format(self.rope_dtype)

    def part_format(self, part: str):
        return self.nope_format if part == "nope" else self.rope_format

    def part_granularity(self, part: str) -> str:
        return self.nope_granularity if part == "nope" else self.rope_granularity

    def part_static_scale(self, part: str) -> float | None:
        return self.nope_scale if part == "nope" else self.rope_scale

    @property
    def is_identity(self) -> bool:
        """True when nothing is quantized: the patched model must reproduce the original exactly."""
        return (not self.nope_format.is_quantized and not self.rope_format.is_quantized
                and self.query == "bf16" and self.pv == "bf16")

    @property
    def causal_consistent(self) -> bool:
        """True when a token's stored value never depends on later tokens (per-token-like scales).

        Then quantized prefill gives exactly what step-by-step decode with the cache gives.
        """
        for part in ("nope", "rope"):
            if not self.part_format(part).is_quantized or (part == "rope" and self.rope_prescale):
                continue
            g = self.part_granularity(part)
            if g in ("per_tensor_dynamic", "per_channel"):
                return False
        return True

    def label(self) -> str:
        return self.name or self.short_description()

    def short_description(self) -> str:
        def part(p: str) -> str:
            fmt = self.part_format(p)
            if p == "rope" and self.rope_prescale:
                return f"{fmt.name}/prescaled"  # divided by the latent's scale
            if not fmt.is_quantized:
                return fmt.name
            gran = self.part_granularity(p)
            return f"{fmt.name}/{gran}" + (f"/g{self.token_group}" if gran == "per_channel" and self.token_group
                                           else "")

        scale = self.scale_format + ("" if self.scale_rule == "snapquant" else f"/{self.scale_rule}")
        if self.scale_divisor is not None:
            scale += f"/amax:{self.scale_divisor:g}"
        return f"nope={part('nope')} rope={part('rope')} scale={scale} q={self.query} pv={self.pv}"

    def replace(self, **changes: Any) -> KVQuantConfig:
        _check_keys(changes)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVQuantConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"KVQuantConfig expects a mapping, got {type(d).__name__}")
        _check_keys(d)
        return cls(**d)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, s: str) -> KVQuantConfig:
        return cls.from_dict(json.loads(s))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, s: str) -> KVQuantConfig:
        return cls.from_dict(yaml.safe_load(s))

    def save_pretrained(self, path: str | Path) -> Path:
        """Write `snapquant_config.json` into a directory (or to a .json/.yaml file path)."""
        p = Path(path)
        if p.suffix in (".yaml", ".yml"):
            p.write_text(self.to_yaml())
        elif p.suffix == ".json":
            p.write_text(self.to_json(indent=2))
        else:
            p.mkdir(parents=True, exist_ok=True)
            p = p / "snapquant_config.json"
            p.write_text(self.to_json(indent=2))
        return p

    @classmethod
    def from_pretrained(cls, path: str | Path) -> KVQuantConfig:
        """Load from a directory holding `snapquant_config.json`, or a .json / .yaml file."""
        p = Path(path)
        if p.is_dir():
            p = p / "snapquant_config.json"
        if not p.exists():
            raise ConfigError(f"no snapquant config at {p}")
        text = p.read_text()
        return cls.from_yaml(text) if p.suffix in (".yaml", ".yml") else cls.from_json(text)


FIELD_NAMES = tuple(f.name for f in fields(KVQuantConfig))
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(KVQuantConfig)}

_dataclass_init = KVQuantConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: KVQuantConfig, *args: Any, **kwargs: Any) -> None:
    # The keyword form gets the same error as the dict form (a bare TypeError names no valid field).
    _check_keys(kwargs)
    if len(args) > len(FIELD_NAMES):
        raise ConfigError(f"KVQuantConfig takes at most {len(FIELD_NAMES)} fields, got {len(args)} positional values")
    _dataclass_init(self, *args, **kwargs)


KVQuantConfig.__init__ = _init  # type: ignore[method-assign]


# ------------------------------------------------------------------ which knobs each format reads
def _own_scales(v: Mapping[str, Any], part: str) -> bool:
    """The part stores scaled codes with scales of its own (pre-scaled RoPE borrows the latent's)."""
    if not get_element_format(v[f"{part}_dtype"]).is_quantized:
        return False
    return not (part == "rope" and v["rope_prescale"] is True)


def _scaled_with(v: Mapping[str, Any], granularity: str) -> bool:
    return any(_own_scales(v, p) and v[f"{p}_granularity"] == granularity for p in ("nope", "rope"))


# The one table of knobs that only some formats read: field -> (when it is read, test on the field
# values). A knob set away from its default where its test is False would do nothing, silently.
KNOB_SCOPE: dict[str, tuple[str, Callable[[Mapping[str, Any]], bool]]] = {
    "nope_granularity": ("a quantized nope_dtype (not bf16/fp16)", lambda v: _own_scales(v, "nope")),
    "rope_granularity": ("a quantized rope_dtype and rope_prescale=false", lambda v: _own_scales(v, "rope")),
    "scale_format": ("a quantized part (nope_dtype or rope_dtype not bf16/fp16)",
                     lambda v: _own_scales(v, "nope") or _own_scales(v, "rope")),
    "scale_rule": ("a quantized part (nope_dtype or rope_dtype not bf16/fp16)",
                   lambda v: _own_scales(v, "nope") or _own_scales(v, "rope")),
    "scale_divisor": ("a quantized part (nope_dtype or rope_dtype not bf16/fp16)",
                      lambda v: _own_scales(v, "nope") or _own_scales(v, "rope")),
    "block_size": ("granularity 'per_token_block' on a quantized part",
                   lambda v: _scaled_with(v, "per_token_block")),
    "token_group": ("granularity 'per_channel' on a quantized part", lambda v: _scaled_with(v, "per_channel")),
    "nope_scale": ("nope_granularity='per_tensor_static' and a quantized nope_dtype",
                   lambda v: _own_scales(v, "nope") and v["nope_granularity"] == "per_tensor_static"),
    "rope_scale": ("rope_granularity='per_tensor_static', a quantized rope_dtype and rope_prescale=false",
                   lambda v: _own_scales(v, "rope") and v["rope_granularity"] == "per_tensor_static"),
}


def inert_knobs(values: Mapping[str, Any]) -> list[str]:
    """Fields of `values` (missing ones take the defaults) set away from their default where the
    chosen formats never read them. Expects valid dtypes (raises ConfigError naming a bad one)."""
    v = {**DEFAULTS, **values}
    return [f for f, (_, reads) in KNOB_SCOPE.items() if v[f] != DEFAULTS[f] and not reads(v)]


def without_inert_knobs(values: Mapping[str, Any], keep: Iterable[str] = ()) -> dict[str, Any]:
    """`values` with the knobs its formats never read reset to their defaults, except those in `keep`
    (which then fail validation by name). For a shared base, e.g. a sweep grid's, whose `block_size`
    only the per_token_block cells read. Invalid values are left for the constructor to report."""
    out = dict(values)
    try:
        inert = inert_knobs(out)
    except ConfigError:
        return out
    for f in inert:
        if f not in keep:
            out[f] = DEFAULTS[f]
    return out

# Allowed values per axis, for sweep grids and error messages.
AXES: dict[str, tuple] = {
    "nope_dtype": tuple(ELEMENT_FORMATS),
    "rope_dtype": tuple(ELEMENT_FORMATS),
    "nope_granularity": GRANULARITIES,
    "rope_granularity": GRANULARITIES,
    "scale_format": tuple(SCALE_FORMATS),
    "scale_rule": tuple(SCALE_RULES),
    "rope_prescale": (True, False),
    "query": QUERY_MODES,
    "pv": PV_MODES,
    "prefill": PREFILL_MODES,
}


def _check_keys(d: dict[str, Any]) -> None:
    for k in d:
        if k not in FIELD_NAMES:
            raise unknown_choice("KVQuantConfig field", k, FIELD_NAMES)


def _choice(field_name: str, value: object, allowed) -> None:
    if value not in allowed:
        raise unknown_choice(field_name, value, allowed)


def _positive_int(field_name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{field_name}={value!r} is not valid; expected a positive integer")
