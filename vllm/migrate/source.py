"""Reading the input: ``PATH/module.py[:Class]``, its text and its concrete syntax tree."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from vllm.migrate.report import MigrationError


@dataclass(frozen=True)
class Target:
    """What the command was asked to migrate."""

    path: Path
    class_name: str | None
    """The backend class named after ``:`` (None: the module's only legacy backend)."""

    def __str__(self) -> str:
        return f"{self.path}:{self.class_name}" if self.class_name else str(self.path)


def parse_target(text: str) -> Target:
    """``PATH/module.py`` or ``PATH/module.py:Class``."""
    path, sep, name = text.rpartition(":")
    if sep and path.endswith(".py") and name.isidentifier():
        return Target(Path(path), name)
    if sep and path.endswith(".py"):
        raise MigrationError(
            f"target: got {text!r}, expected PATH/module.py or PATH/module.py:Class, where "
            f"Class is a Python identifier ({name!r} is not)")
    if not text.endswith(".py"):
        raise MigrationError(
            f"target: got {text!r}, expected the path of a Python file (PATH/module.py), "
            "optionally followed by :Class")
    return Target(Path(text), None)


def read_source(path: Path) -> str:
    if not path.is_file():
        what = "a directory" if path.is_dir() else "no such file"
        raise MigrationError(f"{path}: {what}; expected a Python module (PATH/module.py)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MigrationError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                             "expected a Python module") from exc


def parse_source(path: Path, text: str) -> cst.Module:
    """The module's concrete syntax tree (comments and formatting kept)."""
    try:  # Python's own parser names the line and the problem best
        compile(text, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise MigrationError(
            f"{path}:{exc.lineno}:{exc.offset}: syntax error: {exc.msg}; the command reads "
            "modules that Python can compile") from exc
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        first = str(exc.message).splitlines()[0] if exc.message else "invalid syntax"
        raise MigrationError(
            f"{path}:{exc.raw_line}: libcst cannot parse it ({first}); a newer libcst may "
            "(pip install -U libcst)") from exc
