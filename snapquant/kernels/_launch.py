"""Pick the compiled or interpreted build of a kernel from the device of its tensors.

`triton.jit` decides at decoration time (import time) whether a function is compiled or run by the
interpreter, from TRITON_INTERPRET. A test suite cannot rely on that: any earlier import of
snapquant.kernels (the attention backends import it to ask `supports`) would freeze the mode. So the
modules are decorated normally, and `for_device` builds, once and on demand, an interpreted twin of
a kernel for CPU tensors: the same code object re-bound to a copy of its module's globals in which
every jit function (including helpers imported from `triton/common.py`) is replaced by its interpreted twin.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_TWIN_GLOBALS: dict[str, dict[str, Any]] = {}


def interpreting(device: torch.device) -> bool:
    """True when kernels on `device` run in the Triton interpreter (CPU tensors, or TRITON_INTERPRET=1)."""
    return device.type != "cuda" or bool(triton.knobs.runtime.interpret)


def for_device(kernel: Any, device: torch.device) -> Any:
    """The build of `kernel` that can run on `device`."""
    if not interpreting(device) or isinstance(kernel, InterpretedFunction):
        return kernel
    return _interpreted_globals(kernel.fn.__module__)[kernel.fn.__name__]


def _interpreted_globals(module_name: str) -> dict[str, Any]:
    if module_name in _TWIN_GLOBALS:
        return _TWIN_GLOBALS[module_name]
    ns = dict(vars(sys.modules[module_name]))
    _TWIN_GLOBALS[module_name] = ns  # registered first: modules may refer to each other
    for name, value in list(ns.items()):
        if not isinstance(value, JITFunction):
            continue
        fn = value.fn
        if fn.__module__ == module_name:
            twin = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
            twin.__module__ = module_name
            ns[name] = InterpretedFunction(twin)
        else:  # a helper imported from another module: use that module's twin
            ns[name] = _interpreted_globals(fn.__module__)[fn.__name__]
    return ns
