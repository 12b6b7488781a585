"""What a migration produced: the module, the steps left to do by hand, and its errors.

Kept free of ``libcst`` so that the command can report a missing ``libcst`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import textwrap
from pathlib import Path
from typing import Final

from vllm.attention.errors import AttentionError

EXIT_OK: Final = 0
"""Migrated, nothing left to do (and, with ``--check``, no difference)."""
EXIT_CHECK_FAILED: Final = 1
"""``--check`` found a difference between the adapted original and the migrated module."""
EXIT_ERROR: Final = 2
"""Bad input or usage: nothing was written."""
EXIT_MANUAL_STEPS: Final = 3
"""Migrated with manual steps left (listed as ``file:line: what to do``)."""

MARKER: Final = "# MIGRATE:"
"""How a line the command left in place is marked in the migrated module."""
MARKER_CONTINUED: Final = "#   "
"""How a marker's further lines start."""
MARKER_WIDTH: Final = 84


class MigrationError(AttentionError, ValueError):
    """The input cannot be migrated (not a legacy backend, a syntax error, already
    new-style, no cache write found, ...); nothing was written."""


@dataclass(frozen=True)
class ManualStep:
    """Something the command left in place because it cannot rewrite it with certainty."""

    reason: str
    """Why it was left (the marker comment says it)."""
    todo: str
    """What to do, one sentence (the listing says it)."""
    line: int = 0
    """Line of the marker in the migrated module (1-based; 0 until rendered)."""

    @property
    def comment(self) -> list[str]:
        """The marker: comment lines of at most :data:`MARKER_WIDTH` characters."""
        return textwrap.wrap(f"{MARKER} {self.reason}; {self.todo}", width=MARKER_WIDTH,
                             subsequent_indent=MARKER_CONTINUED, break_on_hyphens=False)

    def format(self, path: str | Path) -> str:
        return f"{path}:{self.line}: {self.todo}"


@dataclass
class MigrationResult:
    """One migrated module."""

    source: Path
    """The legacy module read (never written)."""
    class_name: str
    """The backend class migrated (same name in the migrated module)."""
    backend_name: str
    """Its registry name (``get_name()``, now ``name``)."""
    generation: str
    """``fused`` or ``flagged``."""
    layout: str
    """The ``KVCacheLayout`` member name its cache has."""
    code: str
    """The migrated module."""
    manual_steps: list[ManualStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was changed that a reader should know (choices made, defaults spelled out)."""

    @property
    def exit_code(self) -> int:
        return EXIT_MANUAL_STEPS if self.manual_steps else EXIT_OK
