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


Location = tuple[str, int]
"""``(filename, lineno)`` a warning points at."""


def caller_location() -> Location | None:
    """Where the first frame outside ``vllm``/``shim`` (and the import machinery) is:
    the user's call that led here, or None when there is none (a console script)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        internal = (filename.startswith(_PACKAGE_DIRS) or "importlib" in filename
                    or frame.f_code.co_filename.startswith("<frozen"))
        if not internal:
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


def warn_once(key: str, message: str, *, at: Location | None = None) -> bool:
    """Emit ``message`` as a :class:`LegacyBackendWarning` once per ``key`` per process,
    pointing at ``at`` (a backend's registration or definition) or else at the caller."""
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    if at is None:
        warnings.warn(message, LegacyBackendWarning, stacklevel=caller_stacklevel())
    else:
        filename, lineno = at
        module = os.path.splitext(os.path.basename(filename))[0]
        warnings.warn_explicit(message, LegacyBackendWarning, filename, lineno, module=module)
    return True


def _reset_for_tests() -> None:
    with _lock:
        _warned.clear()
