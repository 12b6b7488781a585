"""The one runtime warning class of the legacy path."""

from __future__ import annotations

import os
import sys
import threading
import warnings

_PACKAGE_DIRS = tuple(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + pkg + os.sep
    for pkg in ("shim", "vllm")
)


class LegacyBackendWarning(FutureWarning):
    """A legacy (pre-split) attention backend or entry point is in use.

    The message names the backend or function, what to change, and
    ``migration_guide.md``.
    """


_warned: set[str] = set()
_lock = threading.Lock()


def caller_stacklevel() -> int:
    """``stacklevel`` that points at the first frame outside ``vllm``/``shim``
    (and the import machinery), so the warning names the user's file."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        internal = (filename.startswith(_PACKAGE_DIRS) or "importlib" in filename
                    or frame.f_code.co_filename.startswith("<frozen"))
        if not internal:
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn_once(key: str, message: str) -> bool:
    """Emit ``message`` as a :class:`LegacyBackendWarning` once per ``key`` per process."""
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    warnings.warn(message, LegacyBackendWarning, stacklevel=caller_stacklevel())
    return True


def _reset_for_tests() -> None:
    with _lock:
        _warned.clear()
