"""The decode backend seam: a lazy registry of backends by name, and which one runs a call.

A backend is a callable with the signature of `mla_decode_reference`:

    fn(q [B,(S,)H,r+d], kv: QuantizedKV, lengths [B], softmax_scale, config, *, causal, round_16bit[, options])
        -> (out [B,(S,)H,r] fp32, lse natural log)

The registry maps each name to "module:attr" strings, imported the first time the backend is asked
for (as lm-eval registers its models), so registering a backend imports nothing and the names are
known before any implementation loads:

    reference   snapquant.reference:mla_decode_reference   the exact PyTorch reference (any device)
    triton      snapquant.kernels:triton_backend           the paged FP8 kernels (CUDA); needs triton
    flashmla    snapquant.attention.flashmla:flashmla_backend   FlashMLA's BF16 decode (CUDA, bf16 preset);
                                                           needs the optional flash_mla package

`backend_choices()` (and the live sequence `BACKEND_CHOICES`) is "auto" plus every registered name:
what `snapquant.patch`, the CLI and sweep YAMLs accept, so a backend registered with
`register_backend` can be selected everywhere. `auto` runs, on a CUDA device, the first backend
registered with `auto=True` (triton) that loads and supports the config; otherwise the reference.
`backend` is an argument of `snapquant.patch`, never a config field (configs are hashed by sweeps).

Kernel options: a backend registered with `options=` (a "module:attr" parser taking the user's
`kernel_options`, a mapping or the backend's own options object, and returning the validated object,
raising ConfigError naming the field) accepts `snapquant.patch(..., kernel_options=...)`; its fn is
then called with `options=<parsed>`. `check_kernel_options` is that validation, run by `patch` and by
the sweep schema before any model loads.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import KVQuantConfig
from ..errors import ConfigError, unknown_choice
from ..runtime import allow_host_sync, lengths_trusted, stream_capturing, trusted_lengths

# The guards live in snapquant.runtime; importable from here too (the seam's users reach them here).
__all__ = ["BACKEND_CHOICES", "Backend", "backend_choices", "check_backend_name", "check_kernel_options",
           "kernel_options_from_text", "lengths_trusted", "parse_kernel_options", "register_backend",
           "resolve_backend", "static_backend", "stream_capturing", "trusted_lengths", "unregister_backend"]

AUTO = "auto"


@dataclass(frozen=True)
class Backend:
    """A loaded backend: its callable and what the seam needs to know to choose it."""

    name: str
    fn: Callable
    supports: Callable[[KVQuantConfig], bool] | None = None
    needs_cuda: bool = False
    auto: bool = False  # a candidate of backend="auto" (on CUDA devices)
    options: Callable[[Any], Any] | None = None  # parses kernel_options; None: the backend takes none

    def bind(self, options: Any = None) -> Callable:
        """`fn` with parsed kernel options applied (`fn` itself when there are none or it takes none)."""
        if options is None or self.options is None:
            return self.fn
        return functools.partial(self.fn, options=options)


@dataclass(frozen=True)
class _Entry:
    """What `register_backend` recorded: each field a value or a "module:attr" string, loaded on first use."""

    fn: Callable | str
    supports: Callable | str | None = None
    needs_cuda: bool = True
    auto: bool = False
    options: Callable | str | None = None


def _load_ref(ref: Callable | str | None) -> Any:
    """A "module:attr" (attr may be dotted) imported now; anything else is returned as it is."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{module} has no attribute {attr!r}") from None
    return obj


_REGISTRY: dict[str, _Entry] = {}
_LOADED: dict[str, Backend] = {}
_KEEP: Any = object()  # register_backend's default for auto / options: keep the replaced entry's value


def register_backend(name: str, fn: Callable | str, *, supports: Callable[[KVQuantConfig], bool] | str | None = None,
                     needs_cuda: bool = True, auto: bool = _KEEP, options: Callable | str | None = _KEEP) -> None:
    """Add (or replace) a decode backend. Each of `fn`, `supports` and `options` may be a "module:attr"
    string, imported the first time the backend is resolved.

    supports(config): which configs it implements (None: all). needs_cuda: an explicit request on another
    device is an error. auto: a candidate of backend="auto" on CUDA. options: the parser of its
    kernel_options (None: it takes none). auto and options, when not given, keep the values of the entry
    being replaced (False / None for a new name).
    """
    if not isinstance(name, str) or not name or name == AUTO:
        raise ConfigError(f"backend name {name!r}: a non-empty string other than {AUTO!r}")
    old = _REGISTRY.get(name)
    if auto is _KEEP:
        auto = old.auto if old is not None else False
    if options is _KEEP:
        options = old.options if old is not None else None
    _REGISTRY[name] = _Entry(fn, supports, needs_cuda, bool(auto), options)
    _LOADED.pop(name, None)


def unregister_backend(name: str) -> None:
    """Remove a registered backend (the reference stays: it is every fallback)."""
    if name == "reference":
        raise ConfigError("backend 'reference' cannot be unregistered (it is every backend's fallback)")
    _REGISTRY.pop(name, None)
    _LOADED.pop(name, None)


def backend_choices() -> tuple[str, ...]:
    """The valid values of `backend`: "auto" and every registered name."""
    return (AUTO, *_REGISTRY)


class _Choices(Sequence):
    """`backend_choices()` as a live sequence (it follows later registrations)."""

    def __getitem__(self, i):
        return backend_choices()[i]

    def __len__(self) -> int:
        return len(backend_choices())

    def __iter__(self) -> Iterator[str]:
        return iter(backend_choices())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(backend_choices())

    def __repr__(self) -> str:
        return repr(backend_choices())


BACKEND_CHOICES: Sequence[str] = _Choices()


def check_backend_name(name: str) -> str:
    if name not in backend_choices():
        raise unknown_choice("backend", name, backend_choices())
    return name


def _load(name: str) -> Backend:
    """The registered backend `name`, importing what its entry names (ImportError when that fails)."""
    backend = _LOADED.get(name)
    if backend is None:
        e = _REGISTRY[name]
        backend = Backend(name, _load_ref(e.fn), _load_ref(e.supports), e.needs_cuda, e.auto, _load_ref(e.options))
        _LOADED[name] = backend
    return backend


def _describe(ref: Callable | str) -> str:
    return ref if isinstance(ref, str) else f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', ref)}"


def _takes_options(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "options" or p.kind is p.VAR_KEYWORD for p in params)


def _load_or_explain(name: str) -> Backend:
    try:
        return _load(name)
    except ImportError as err:
        raise ConfigError(f"backend={name!r} is not available: importing {_describe(_REGISTRY[name].fn)} failed "
                          f"({err}); "
                          f"use backend='reference' or 'auto'") from None


def _auto_candidates(config: KVQuantConfig, device: torch.device) -> Iterator[Backend]:
    """Backends backend="auto" would run here, best first (the reference last)."""
    if device.type == "cuda":  # off CUDA the kernels would run in an interpreter: never an automatic choice
        for name, entry in _REGISTRY.items():
            if not entry.auto:
                continue
            try:
                backend = _load(name)
            except ImportError:  # e.g. triton is not installed
                continue
            if backend.supports is None or backend.supports(config):
                yield backend
            else:
                _note_fallback(backend, config)
    yield _load("reference")


def resolve_backend(name: str, config: KVQuantConfig, device: torch.device) -> Backend:
    """The backend that will run decode for `config` on `device` (raises a clear error when impossible)."""
    check_backend_name(name)
    if name == AUTO:
        return next(_auto_candidates(config, device))
    backend = _load_or_explain(name)
    # An explicit request: every reason it cannot run is an error.
    if backend.needs_cuda and device.type != "cuda":
        raise ConfigError(f"backend={name!r} needs a CUDA device, but the attention runs on {device}")
    if backend.supports is not None and not backend.supports(config):
        raise ConfigError(
            f"backend={name!r} does not implement config {config.label()!r}{_why_not(backend, config)}; use "
            f"backend='auto' to fall back to the reference for it"
        )
    return backend


# ---------------------------------------------------------------------------------------------- fallback reasons
_FALLBACKS_NOTED: set[tuple[str, str]] = set()


def _why_not(backend: Backend, config: KVQuantConfig) -> str:
    """' (why backend cannot run config)': a backend's `supports` may have an `unsupported_reason(config)`
    beside it in its module (the kernels' layouts.py does), which the messages quote; else ''."""
    module = sys.modules.get(getattr(backend.supports, "__module__", None) or "")  # loaded with `supports`
    explain = getattr(module, "unsupported_reason", None)
    reason = explain(config) if callable(explain) else None
    return f" ({reason})" if reason else ""


def _note_fallback(backend: Backend, config: KVQuantConfig) -> None:
    """backend='auto' on CUDA passes over `backend` for a config it lacks: say so once per (backend, config)."""
    key = (backend.name, config.label())
    if key not in _FALLBACKS_NOTED:
        _FALLBACKS_NOTED.add(key)
        warnings.warn(f"snapquant: backend='auto' does not run {backend.name!r} for {config.label()!r}"
                      f"{_why_not(backend, config)}; the next candidate (at last the PyTorch reference) decodes it",
                      stacklevel=4)


# ---------------------------------------------------------------------------------------------- kernel options
def parse_kernel_options(backend: str, kernel_options: Any) -> Any:
    """`kernel_options` as `backend`'s registered parser validates them (ConfigError naming the field and
    the valid ones); for callers that pass the knobs to the kernels themselves (the benchmarks)."""
    check_backend_name(backend)
    b = _load_or_explain(backend) if backend != AUTO else None
    if b is None or b.options is None:
        takes = [n for n, e in _REGISTRY.items() if e.options is not None]
        raise ConfigError(f"kernel_options: backend={backend!r} takes no kernel options"
                          + (f" (backends that do: {', '.join(takes)})" if takes else ""))
    return b.options(kernel_options)


def check_kernel_options(backend: str, kernel_options: Any) -> dict[str, Any]:
    """Validate `kernel_options` for `backend` -> {backend name: parsed options} for each backend that
    could run with them (what `snapquant.patch` passes to the backend's every call).

    None or an empty mapping: no options ({}). An explicit backend must take options (the reference takes
    none); "auto" validates them for every auto candidate (the reference, its fallback, ignores them).
    Raises ConfigError naming the offending field and the valid ones.
    """
    check_backend_name(backend)
    if kernel_options is None or (isinstance(kernel_options, Mapping) and not kernel_options):
        return {}
    names = [n for n, e in _REGISTRY.items() if e.auto] if backend == AUTO else [backend]
    parsed: dict[str, Any] = {}
    for name in names:
        b = _load_or_explain(name)
        if b.options is None:
            continue
        if not _takes_options(b.fn):  # a parser, but a function that cannot receive what it parses
            raise ConfigError(f"kernel_options: backend={name!r} cannot take them: its function "
                              f"{_describe(b.fn)} has no `options` parameter")
        parsed[name] = b.options(kernel_options)
    if not parsed:
        takes = [n for n, e in _REGISTRY.items() if e.options is not None]
        raise ConfigError(f"kernel_options: backend={backend!r} takes no kernel options"
                          + (f" (backends that do: {', '.join(takes)})" if takes else ""))
    return parsed


def kernel_options_from_text(text: str) -> dict[str, Any]:
    """Kernel options as a command line gives them: "key=value,key=value" (each value read as a YAML
    scalar: 8, true, null, qk) or a YAML / JSON mapping ("{num_splits: 8, fp8_mma: qk}")."""
    import yaml

    text = text.strip()
    if text.startswith("{"):
        try:
            out = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"kernel_options: {text!r} is not a YAML mapping ({e})") from None
        if not isinstance(out, dict):
            raise ConfigError(f"kernel_options: {text!r} is not a mapping")
        return out
    out = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"kernel_options: {item!r} is not key=value (e.g. num_splits=8,fp8_mma=qk)")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = value.strip()
    return out


register_backend("reference", "snapquant.reference:mla_decode_reference", needs_cuda=False, auto=False, options=None)
register_backend("triton", "snapquant.kernels:triton_backend", supports="snapquant.kernels:supports",
                 needs_cuda=True, auto=True, options="snapquant.kernels.options:as_options")
# FlashMLA's BF16 decode for the bf16 preset (never an automatic choice: it is the benchmarks' anchor, an
# optional package); `supports` is False while flash_mla is not importable, with the reason quoted.
register_backend("flashmla", "snapquant.attention.flashmla:flashmla_backend",
                 supports="snapquant.attention.flashmla:supports", needs_cuda=True, auto=False, options=None)


# ---------------------------------------------------------------------------------------------- static path
def static_backend(backend: Backend, options: Any = None) -> Callable:
    """`backend.fn` (with its parsed kernel `options`) as the fixed-shape decode step calls it: lengths
    trusted (no host-read checks).

    The reference backend validates lengths with a host read it has no switch for; it is never captured
    (DecodeGraph captures only the Triton backend: the reference also creates host constants per call),
    so that one read is allowed by `snapquant.runtime.no_host_sync` by name."""
    fn = backend.bind(options)

    @functools.wraps(backend.fn)
    def call(*args, **kwargs):
        with trusted_lengths():
            if backend.name == "reference":
                with allow_host_sync("mla_decode_reference's lengths check (the reference is never captured)"):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

    return call
