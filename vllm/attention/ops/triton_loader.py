"""Load a Triton kernel module compiled or for the CPU interpreter.

Triton fixes the mode when ``@triton.jit`` runs, from ``TRITON_INTERPRET``. The
compiled module is imported under its own name with that variable unset (a process
that set it, e.g. a test run without CUDA, must not turn it into interpreted
functions); the interpreted copy is a second import of the same file under
``<name>__interpreted`` with the variable set for the duration of the import. The
two never replace each other, so tests of either mode can run in any order.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from types import ModuleType


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels launched now run under the CPU
    interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _is_interpreted(module: ModuleType) -> bool:
    return any(type(v).__name__ == "InterpretedFunction" for v in vars(module).values())


def _with_interpret(value: str | None) -> str | None:
    """Set (or unset, for None) ``TRITON_INTERPRET``; return the previous value."""
    previous = os.environ.pop("TRITON_INTERPRET", None)
    if value is not None:
        os.environ["TRITON_INTERPRET"] = value
    return previous


@functools.cache
def load_kernel_module(name: str, *, interpret: bool) -> ModuleType:
    """The kernel module ``name`` (dotted), compiled or interpreted."""
    if not interpret:
        module = sys.modules.get(name)
        if module is not None and not _is_interpreted(module):
            return module
        previous = _with_interpret(None)
        try:
            return importlib.reload(module) if module is not None else importlib.import_module(name)
        finally:
            _with_interpret(previous)
    alias = f"{name}__interpreted"
    if alias in sys.modules:
        return sys.modules[alias]
    source = importlib.util.find_spec(name)
    if source is None or source.origin is None:
        raise ImportError(f"cannot locate {name}")
    spec = importlib.util.spec_from_file_location(alias, source.origin)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {source.origin}")
    module = importlib.util.module_from_spec(spec)
    previous = _with_interpret("1")
    try:
        sys.modules[alias] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(alias, None)
        raise
    finally:
        _with_interpret(previous)
    return module
