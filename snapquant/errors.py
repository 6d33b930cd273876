"""Errors raised by snapquant. All user-facing validation goes through these."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class SnapquantError(Exception):
    """Base class of every error snapquant raises on purpose."""


class ConfigError(SnapquantError, ValueError):
    """A configuration field or value is invalid. The message names the field and the allowed values."""


class ShapeError(SnapquantError, ValueError):
    """A tensor argument has the wrong shape, dtype or device. The message names the argument."""


class NonFiniteInputError(SnapquantError, ValueError):
    """Input to a quantizer contains NaN or Inf while checking is enabled."""


class HostSyncError(SnapquantError, RuntimeError):
    """An op that forces a host-device sync ran inside `snapquant.graphs.no_host_sync()`; names the op."""


def unknown_choice(field: str, value: object, allowed: Iterable[str]) -> ConfigError:
    """Build the one error used everywhere for a value outside a closed set."""
    allowed = list(allowed)
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value, allowed, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    return ConfigError(f"{field}={value!r} is not valid{hint}; allowed values: {', '.join(allowed)}")
