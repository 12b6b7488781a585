"""What the ``vllm-attn migrate`` tests share: the legacy backends, running the command,
loading a migrated module, and type-checking it with the project's mypy configuration."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from vllm.migrate.check import load_module

ROOT = Path(__file__).resolve().parents[2]
LEGACY = ROOT / "tests" / "legacy_backends"

EXAMPLES: dict[str, Path] = {
    "fused": LEGACY / "fused.py",
    "flagged": LEGACY / "flagged.py",
    "oot_legacy": ROOT / "examples" / "out_of_tree_backend" / "legacy" / "oot_attn_legacy"
                  / "backend.py",
}
"""This package's own legacy examples, each a module with one legacy backend."""


@dataclass
class Run:
    code: int
    out: str
    err: str


def run(*argv: str | Path) -> Run:
    """``vllm-attn migrate ...`` in this process."""
    from vllm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["migrate", *map(str, argv)])
    return Run(code, out.getvalue(), err.getvalue())


def guide_example(folder: Path) -> Path:
    """migration_guide.md's MY_ATTN before the migration (its first two Python blocks:
    the kernel, then the fused backend around it), as a module in ``folder``."""
    text = (ROOT / "migration_guide.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    kernel = next((b for b in blocks if "def paged_attention(" in b), None)
    backend = next((b for b in blocks if "class LegacyBackend:" in b), None)
    if kernel is None or backend is None:
        pytest.skip("migration_guide.md no longer holds the MY_ATTN legacy example")
    path = folder / "my_attn.py"
    path.write_text(kernel + "\n\n" + backend, encoding="utf-8")
    return path


def load(path: Path, code: str) -> ModuleType:
    """``code`` as the migrated module of ``path`` (relative imports as the original's)."""
    return load_module(path, code, "_migrated")


def mypy_strict(*files: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration (``--strict`` and its error codes), run in
    ``cwd`` (where it keeps its cache; default: beside the files), with this repository
    on its path (``tests.*`` imports resolve)."""
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--no-error-summary", *map(str, files)],
        capture_output=True, text=True, cwd=cwd or files[0].parent, check=False, env=env)


def marked_lines(code: str) -> list[int]:
    """Lines of the migrated module that start a ``# MIGRATE:`` marker."""
    return [i for i, line in enumerate(code.splitlines(), start=1)
            if line.strip().startswith("# MIGRATE:")]


def unmark(code: str) -> str:
    """``code`` without its ``# MIGRATE:`` marker comments."""
    lines = code.splitlines(keepends=True)
    drop: set[int] = set()
    for start in marked_lines(code):
        i = start - 1
        drop.add(i)
        while i + 1 < len(lines) and lines[i + 1].strip().startswith("#   "):
            i += 1
            drop.add(i)
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def original(path: Path, name: str) -> Any:
    """Class ``name`` of the legacy module ``path``, loaded as ``--check`` loads it."""
    return getattr(load_module(path, path.read_text(encoding="utf-8"), "_original"), name)
