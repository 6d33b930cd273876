"""The sweep YAML schema: `SweepSpec.from_yaml(path)` -> a validated, immutable description of a sweep.

Validation happens here, before any model is loaded. Every problem in the file is collected and
raised as ONE `ConfigError` whose lines name the offending key and list the valid names/values,
so a user fixes a config in one round trip instead of one error per run.

Shape of a sweep file (every key but `model`, `tasks` and one of `presets`/`grid` has a default):

    name: quickstart
    model: embedded                # "embedded" (snapquant.load_embedded) or a HF checkpoint dir
    dtype: float32                 # auto | float32 | bfloat16 | float16
    device: auto                   # auto | cpu | cuda | cuda:N
    device_map: null               # "auto" for models larger than one GPU
    backend: auto                  # the decode backend: auto | reference | triton | any registered name
    kernel_options: {}             # the decode kernels' knobs, e.g. {num_splits: 8} (see snapquant.patch)
    loglikelihood: forward         # forward (lm-eval's pass) | decode (read through the quantized cache)
    tasks:
      - sq_code_ppl                # a bare name, or a mapping:
      - {name: sq_passkey, limit: 16, num_fewshot: 0, metric: acc}
    presets: [bf16, snapmla, per_tensor_fp8]
    grid:                          # optional: a cartesian product over KVQuantConfig fields
      base: snapmla_kv_only
      axes: {nope_dtype: [fp8_e4m3, fp8_e5m2], nope_granularity: [per_token, per_token_block]}
    baseline: bf16                 # the row deltas and paired tests compare against (added if absent)
    fidelity: {enabled: true, num_sequences: 16, seq_len: 128, prompt_len: 32, seed: 0}
    launcher: {executor: inline}   # inline | local | slurm (submitit); see LauncherSpec
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ..config import AXES, FIELD_NAMES
from ..errors import ConfigError, unknown_choice
from ..eval.fidelity import MODES as FIDELITY_MODES
from ..presets import PRESETS

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXECUTORS = ("inline", "local", "slurm")
# KVQuantConfig fields a grid may vary. `name` is a label, not an axis.
GRID_AXES = tuple(f for f in FIELD_NAMES if f != "name")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")
TaskChecker = Callable[[list[str], bool, list[str]], list[str]]


@dataclass(frozen=True)
class TaskSpec:
    """One evaluation task: an lm-eval task name (or a snapquant task) with its own limit and few-shot."""

    name: str
    limit: int | float | None = None
    """Documents to evaluate: an int count, a float fraction in (0, 1], or None for all."""
    num_fewshot: int | None = None
    metric: str | None = None
    """Metric shown in tables (default: the task's first metric)."""
    gen_kwargs: dict[str, Any] | None = None
    """Generation overrides for generate_until tasks (e.g. max_gen_toks)."""
    metadata: dict[str, Any] | None = None
    """lm-eval task metadata (e.g. max_seq_lengths, num_samples for snapquant's long-context tasks)."""


@dataclass(frozen=True)
class GridSpec:
    base: str | dict[str, Any] = "snapmla"
    """A preset name or a KVQuantConfig mapping every cell starts from."""
    axes: dict[str, tuple] = field(default_factory=dict)


@dataclass(frozen=True)
class FidelitySpec:
    """Model-level fidelity (snapquant.eval.fidelity): KL / top-1 / perplexity vs the unquantized model."""

    enabled: bool = True
    source: str | None = None
    """Text to score: a .txt / .jsonl ("text" field) path; None = the embedded model's held-out text."""
    num_sequences: int = 16
    """Rows drawn one per document round-robin, each past the document's header
    (snapquant.analysis.text_sample); the sequence is the unit the intervals resample, so >= 16."""
    seq_len: int = 128
    prompt_len: int = 32
    """Decode mode prefills this many tokens (BF16 as in serving), then feeds the rest one at a time."""
    modes: tuple[str, ...] = FIDELITY_MODES
    seed: int = 0
    """Which documents and token offsets the rows are drawn at (part of the cells' eval key)."""


@dataclass(frozen=True)
class LauncherSpec:
    """Where cells run. inline: this process. local / slurm: one submitit job per `cells_per_job` cells."""

    executor: str = "inline"
    cells_per_job: int = 1
    timeout_min: int = 240
    gpus_per_node: int = 1
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    max_parallel: int | None = None
    """Slurm array parallelism (slurm_array_parallelism)."""
    slurm: dict[str, Any] = field(default_factory=dict)
    """Extra submitit Slurm parameters without the slurm_ prefix (partition, account, qos, constraint...)."""


@dataclass(frozen=True)
class SweepSpec:
    model: str
    tasks: tuple[TaskSpec, ...]
    presets: tuple[str, ...] = ()
    grid: GridSpec | None = None
    name: str = "sweep"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    device_map: str | dict[str, Any] | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None
    """Patch backend passed to snapquant.patch (None = its default)."""
    kernel_options: dict[str, Any] = field(default_factory=dict)
    """The decode kernels' knobs passed to snapquant.patch (empty: the kernels' defaults)."""
    batch_size: int = 8
    max_length: int | None = None
    loglikelihood: str = "forward"
    """How SnapquantLM reads loglikelihood (multiple-choice) requests: "forward", lm-eval's one pass (a
    `prefill: bf16` preset then scores what the unpatched model scores), or "decode", the context
    prefilled and each continuation teacher-forced through the quantized cache (`snapquant.eval.lm`)."""
    seed: int = 1234
    bootstrap_iters: int = 1000
    """lm-eval's bootstrap iterations for stderr of non-mean metrics (0 disables them)."""
    baseline: str = "bf16"
    include_path: tuple[str, ...] = ()
    """Extra directories of lm-eval task YAML files."""
    fidelity: FidelitySpec = field(default_factory=FidelitySpec)
    allow_code_execution: bool = False
    output_dir: str | None = None
    """Where cell JSONs go; default results/<name> (relative to the working directory)."""
    launcher: LauncherSpec = field(default_factory=LauncherSpec)
    source_path: str | None = field(default=None, compare=False)

    # ---------------------------------------------------------------- derived
    @property
    def out_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("results") / self.name

    def task(self, name: str) -> TaskSpec:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source_path")
        return _jsonable(d)

    def eval_key(self) -> str:
        """Hash of everything but the KV config that changes a cell's numbers (model, tasks, seed...).

        Part of each cell id, so editing e.g. a task limit makes new cells instead of silently
        reusing results computed under the old settings.
        """
        d = self.to_dict()
        keep = {k: d[k] for k in ("model", "tokenizer", "dtype", "device_map", "model_kwargs", "backend",
                                  "max_length", "seed", "tasks", "fidelity", "include_path")}
        if d["kernel_options"]:  # only when set: sweeps written before the key existed keep their cell ids
            keep["kernel_options"] = d["kernel_options"]
        if d["loglikelihood"] != "forward":  # likewise
            keep["loglikelihood"] = d["loglikelihood"]
        return stable_hash(keep)[:8]

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None,
                  task_checker: TaskChecker | None = None) -> SweepSpec:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"sweep config {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: a sweep config is a mapping of keys (model, tasks, presets, ...)")
        data.setdefault("name", p.stem)
        if overrides:
            data.update(overrides)
        return cls.from_dict(data, source=str(p), task_checker=task_checker)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None,
                  task_checker: TaskChecker | None = None) -> SweepSpec:
        """Build and validate. `task_checker(names, allow_code_execution, include_path)` returns
        problems with task names (unknown, or code-executing without permission), reported together
        with every other problem of the file."""
        errs: list[str] = []
        spec = _build(dict(data), errs)
        if task_checker is not None:
            raw = data.get("tasks") or []
            raw = [raw] if isinstance(raw, (str, dict)) else raw
            names = [t if isinstance(t, str) else t.get("name") for t in raw if isinstance(t, (str, dict))]
            inc = data.get("include_path") or ()
            inc = [inc] if isinstance(inc, str) else list(inc)
            errs += task_checker([n for n in names if isinstance(n, str)],
                                 bool(data.get("allow_code_execution", False)),
                                 [str(Path(p).resolve()) for p in inc if Path(p).is_dir()])
        if errs:
            where = f" in {source}" if source else ""
            lines = "\n".join(f"  - {e}" for e in errs)
            raise ConfigError(f"{len(errs)} problem(s) in sweep config{where}:\n{lines}")
        return _replace(spec, source_path=source)


# ---------------------------------------------------------------------- building + validation
_TOP_KEYS = tuple(f.name for f in fields(SweepSpec) if f.name != "source_path")


def _build(d: dict[str, Any], errs: list[str]) -> SweepSpec | None:
    for k in d:
        if k not in _TOP_KEYS:
            errs.append(_unknown("key", k, _TOP_KEYS))
    model = d.get("model")
    if not isinstance(model, str) or not model:
        errs.append("model: required; 'embedded' or a path to a Hugging Face checkpoint directory")
        model = "?"
    name = d.get("name", "sweep")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        errs.append(f"name={name!r}: use letters, digits, '_', '.', '-' (it names the output directory)")
    _check_choice(errs, "dtype", d.get("dtype", "auto"), DTYPES)
    device = d.get("device", "auto")
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        errs.append(f"device={device!r} is not valid; allowed values: auto, cpu, cuda, cuda:N, mps")
    dm = d.get("device_map")
    if dm is not None and not (dm == "auto" or isinstance(dm, dict) or dm in ("balanced", "sequential")):
        errs.append(f"device_map={dm!r} is not valid; allowed values: null, auto, balanced, sequential, or a mapping")
    for k in ("batch_size", "bootstrap_iters", "seed"):
        _check_int(errs, k, d.get(k, 1), minimum=0 if k != "batch_size" else 1)
    if d.get("max_length") is not None:
        _check_int(errs, "max_length", d["max_length"], minimum=1)
    _check_choice(errs, "loglikelihood", d.get("loglikelihood", "forward"), ("forward", "decode"))
    for k in ("model_kwargs",):
        if not isinstance(d.get(k, {}), dict):
            errs.append(f"{k}: expected a mapping")
    if not isinstance(d.get("allow_code_execution", False), bool):
        errs.append("allow_code_execution: expected true or false")
    kernel_options = _build_kernel_options(d.get("backend"), d.get("kernel_options"), errs)

    tasks = _build_tasks(d.get("tasks"), errs)
    presets = _build_presets(d.get("presets", ()), errs)
    grid = _build_grid(d.get("grid"), errs)
    if not presets and grid is None:
        errs.append(f"nothing to compare: give `presets` (any of: {', '.join(PRESETS)}) and/or a `grid`")
    baseline = d.get("baseline", "bf16")
    if baseline not in PRESETS:
        errs.append(_unknown("baseline", baseline, PRESETS))
    include = d.get("include_path", ())
    include = [include] if isinstance(include, str) else list(include or ())
    for p in include:
        if not Path(p).is_dir():
            errs.append(f"include_path: {p!r} is not a directory")
    fidelity = _build_fidelity(d.get("fidelity", {}), errs)
    launcher = _build_launcher(d.get("launcher", {}), errs)
    if errs:
        return None
    return SweepSpec(
        model=model, tasks=tasks, presets=presets, grid=grid, name=name, tokenizer=d.get("tokenizer"),
        dtype=d.get("dtype", "auto"), device=device, device_map=dm, model_kwargs=dict(d.get("model_kwargs") or {}),
        backend=d.get("backend"), kernel_options=kernel_options, batch_size=d.get("batch_size", 8),
        max_length=d.get("max_length"), loglikelihood=d.get("loglikelihood", "forward"),
        seed=d.get("seed", 1234), bootstrap_iters=d.get("bootstrap_iters", 1000), baseline=baseline,
        include_path=tuple(str(Path(p).resolve()) for p in include), fidelity=fidelity,
        allow_code_execution=d.get("allow_code_execution", False), output_dir=d.get("output_dir"),
        launcher=launcher,
    )


def _build_kernel_options(backend: Any, raw: Any, errs: list[str]) -> dict[str, Any]:
    """Check `backend` against the registered backends and `kernel_options` against what it accepts."""
    from ..attention.backends import backend_choices, check_kernel_options

    if backend is not None and backend not in backend_choices():
        errs.append(_unknown("backend", backend, backend_choices()))
        return {}
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        errs.append(f"kernel_options: expected a mapping of option: value, got {raw!r}")
        return {}
    try:
        check_kernel_options(backend or "auto", raw)
    except ConfigError as e:
        errs.append(str(e))
    return dict(raw)


def _build_tasks(raw: Any, errs: list[str]) -> tuple[TaskSpec, ...]:
    if raw is None or raw == []:
        errs.append("tasks: required; a list of lm-eval or snapquant task names (or mappings with `name`)")
        return ()
    if isinstance(raw, (str, dict)):
        raw = [raw]
    out: list[TaskSpec] = []
    allowed = tuple(f.name for f in fields(TaskSpec))
    for i, t in enumerate(raw):
        if isinstance(t, str):
            t = {"name": t}
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            errs.append(f"tasks[{i}]: expected a task name or a mapping with `name`, got {t!r}")
            continue
        bad = [k for k in t if k not in allowed]
        for k in bad:
            errs.append(_unknown(f"tasks[{i}] ({t['name']}) key", k, allowed))
        lim = t.get("limit")
        if lim is not None and not (
            (isinstance(lim, int) and not isinstance(lim, bool) and lim > 0)
            or (isinstance(lim, float) and 0 < lim <= 1)
        ):
            errs.append(f"tasks[{i}] ({t['name']}): limit={lim!r}; expected a positive int, a fraction in (0, 1] or null")
        fs = t.get("num_fewshot")
        if fs is not None:
            _check_int(errs, f"tasks[{i}] ({t['name']}).num_fewshot", fs, minimum=0)
        for k in ("gen_kwargs", "metadata"):
            if t.get(k) is not None and not isinstance(t[k], dict):
                errs.append(f"tasks[{i}] ({t['name']}).{k}: expected a mapping")
        if not bad:
            out.append(TaskSpec(**t))
    names = [t.name for t in out]
    for n in sorted({n for n in names if names.count(n) > 1}):
        errs.append(f"tasks: {n!r} is listed more than once")
    return tuple(out)


def _build_presets(raw: Any, errs: list[str]) -> tuple[str, ...]:
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, (list, tuple)):
        errs.append(f"presets: expected a list of preset names, got {raw!r}")
        return ()
    out = []
    for p in raw:
        if p not in PRESETS:
            errs.append(_unknown("presets", p, PRESETS))
        else:
            out.append(p)
    return tuple(dict.fromkeys(out))


def _build_grid(raw: Any, errs: list[str]) -> GridSpec | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        errs.append("grid: expected a mapping with `base` and `axes`")
        return None
    for k in raw:
        if k not in ("base", "axes"):
            errs.append(_unknown("grid key", k, ("base", "axes")))
    base = raw.get("base", "snapmla")
    if isinstance(base, str):
        if base not in PRESETS:
            errs.append(_unknown("grid.base", base, PRESETS))
    elif isinstance(base, dict):
        for k in base:
            if k not in FIELD_NAMES:
                errs.append(_unknown("grid.base field", k, FIELD_NAMES))
    else:
        errs.append("grid.base: expected a preset name or a KVQuantConfig mapping")
    axes = raw.get("axes")
    if not isinstance(axes, dict) or not axes:
        errs.append(f"grid.axes: required; a mapping from axis to a list of values; axes: {', '.join(GRID_AXES)}")
        return None
    out: dict[str, tuple] = {}
    for axis, values in axes.items():
        if axis not in GRID_AXES:
            errs.append(_unknown("grid axis", axis, GRID_AXES))
            continue
        values = values if isinstance(values, list) else [values]
        if not values:
            errs.append(f"grid.axes.{axis}: empty list of values")
            continue
        allowed = AXES.get(axis)
        for v in values:
            if allowed is not None and v not in allowed:
                errs.append(_unknown(f"grid.axes.{axis} value", v, allowed))
        out[axis] = tuple(values)
    return GridSpec(base=base, axes=out)


def _build_fidelity(raw: Any, errs: list[str]) -> FidelitySpec:
    if raw is False or raw is None:
        return FidelitySpec(enabled=False)
    if raw is True:
        return FidelitySpec()
    if not isinstance(raw, dict):
        errs.append("fidelity: expected a mapping, true or false")
        return FidelitySpec()
    allowed = tuple(f.name for f in fields(FidelitySpec))
    for k in raw:
        if k not in allowed:
            errs.append(_unknown("fidelity key", k, allowed))
    for k in ("num_sequences", "seq_len", "prompt_len"):
        if k in raw:
            _check_int(errs, f"fidelity.{k}", raw[k], minimum=1)
    if "seed" in raw:
        _check_int(errs, "fidelity.seed", raw["seed"], minimum=0)
    modes = raw.get("modes", FIDELITY_MODES)
    modes = [modes] if isinstance(modes, str) else list(modes)
    for m in modes:
        _check_choice(errs, "fidelity.modes", m, FIDELITY_MODES)
    src = raw.get("source")
    if src is not None and not Path(src).is_file():
        errs.append(f"fidelity.source: {src!r} is not a file (.txt, or .jsonl with a 'text' field)")
    seq, prompt = raw.get("seq_len", 128), raw.get("prompt_len", 32)
    if isinstance(seq, int) and isinstance(prompt, int) and prompt >= seq:
        errs.append(f"fidelity.prompt_len={prompt} must be smaller than fidelity.seq_len={seq}")
    kw = {k: v for k, v in raw.items() if k in allowed and k != "modes"}
    try:
        return FidelitySpec(**kw, modes=tuple(modes))
    except TypeError as e:  # pragma: no cover - unknown keys are reported above
        errs.append(f"fidelity: {e}")
        return FidelitySpec()


def _build_launcher(raw: Any, errs: list[str]) -> LauncherSpec:
    if isinstance(raw, str):
        raw = {"executor": raw}
    if not isinstance(raw, dict):
        errs.append("launcher: expected a mapping (executor: inline | local | slurm, ...)")
        return LauncherSpec()
    allowed = tuple(f.name for f in fields(LauncherSpec))
    ok = True
    for k in raw:
        if k not in allowed:
            errs.append(_unknown("launcher key", k, allowed))
            ok = False
    _check_choice(errs, "launcher.executor", raw.get("executor", "inline"), EXECUTORS)
    for k in ("cells_per_job", "timeout_min", "gpus_per_node"):
        if k in raw:
            _check_int(errs, f"launcher.{k}", raw[k], minimum=0 if k == "gpus_per_node" else 1)
    if not isinstance(raw.get("slurm", {}), dict):
        errs.append("launcher.slurm: expected a mapping of Slurm parameters")
        ok = False
    return LauncherSpec(**raw) if ok else LauncherSpec()


# ---------------------------------------------------------------------- helpers
def _unknown(what: str, value: object, allowed: Sequence | Mapping) -> str:
    return str(unknown_choice(what, value, [str(a) for a in allowed]))


def _check_choice(errs: list[str], what: str, value: object, allowed: Sequence) -> None:
    if value not in allowed:
        errs.append(_unknown(what, value, allowed))


def _check_int(errs: list[str], what: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        errs.append(f"{what}={value!r}: expected an integer >= {minimum}")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def stable_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys): equal settings, equal hash, on any machine."""
    return hashlib.sha256(json.dumps(_jsonable(obj), sort_keys=True, default=str).encode()).hexdigest()


def _replace(spec: SweepSpec, **kw: Any) -> SweepSpec:
    import dataclasses

    return dataclasses.replace(spec, **kw)
