"""The project's exception hierarchy (catalogued in ``docs/errors.md``).

Every error names the argument, the value seen and what is allowed. Each class
also derives from the standard exception a caller would expect
(``ValueError``, ``TypeError``, ``LookupError``, ``RuntimeError``).
"""

from __future__ import annotations


class AttentionError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidArgumentError(AttentionError, ValueError):
    """An argument has a value (shape, dtype, device, range, ...) that is not allowed."""

    def __init__(self, argument: str, seen: object, allowed: str) -> None:
        self.argument = argument
        self.seen = seen
        self.allowed = allowed
        super().__init__(f"{argument}: got {seen!r}, expected {allowed}")


class InvalidTypeError(AttentionError, TypeError):
    """An argument is an object of the wrong class."""

    def __init__(self, argument: str, seen: object, allowed: str) -> None:
        self.argument = argument
        self.seen = seen
        self.allowed = allowed
        super().__init__(f"{argument}: got {seen!r}, expected {allowed}")


class KVCacheWriteError(InvalidArgumentError):
    """A cache write was rejected before anything was written."""


class ForwardContextError(AttentionError, RuntimeError):
    """The forward context is missing or does not hold what a layer needs."""


class BackendNotFoundError(AttentionError, LookupError):
    """No backend is registered under the requested name."""

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class UnsupportedBackendError(AttentionError, ValueError):
    """The backend that was asked for cannot run this configuration."""


class NoBackendError(AttentionError, ValueError):
    """No registered backend can run this configuration; lists every candidate's reasons."""


class BackendRegistrationError(AttentionError, TypeError):
    """A backend class cannot be registered (bad declarations, duplicate name, ...)."""


class LegacyBackendError(AttentionError, TypeError):
    """A legacy backend's declarations are inconsistent, so it cannot be adapted."""


class PluginLoadError(AttentionError, ImportError):
    """An out-of-tree backend entry point failed to load."""
