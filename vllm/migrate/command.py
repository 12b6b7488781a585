"""The ``vllm-attn migrate`` subcommand (``docs/cli.md``).

Imports ``libcst`` only when it runs, and says how to install it when it is missing.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.migrate.report import (
    EXIT_CHECK_FAILED,
    EXIT_ERROR,
    EXIT_MANUAL_STEPS,
    EXIT_OK,
    MigrationError,
    MigrationResult,
)

INSTALL_HINT = ("libcst is not installed; vllm-attn migrate needs it: "
                "pip install 'vllm-kv-writer[migrate]' (or pip install 'libcst>=1.3')")

DESCRIPTION = """\
Rewrite a legacy attention backend module (fused: forward() writes the cache; flagged:
forward_includes_kv_cache_update = False and do_kv_cache_update) into the new API:
new-API imports, declarations as class data, the write moved to the writer of its
layout, metadata without slot_mapping, the builder and impl in the new signatures.
What it cannot rewrite with certainty stays in place, marked '# MIGRATE:', and is
listed as file:line: what to do. The input is never written.

exit status: 0 migrated; 1 --check found a difference; 2 bad input (nothing written);
3 migrated with manual steps left (whatever --check found)"""


def add_migrate_parser(sub: Any, *, device_type: Callable[[str], Any]) -> None:
    """Register ``migrate`` on the ``vllm-attn`` subparsers."""
    p = sub.add_parser("migrate", help="rewrite a legacy backend module into the new API",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="PATH/module.py[:Class]",
                   help="the legacy module; :Class names the backend when it holds several")
    p.add_argument("--out", type=Path, default=Path("migrated"), metavar="DIR",
                   help="directory to write the migrated module to, under the input's file "
                        "name (default: %(default)s)")
    p.add_argument("--diff", action="store_true",
                   help="print a unified diff instead of writing")
    p.add_argument("--check", action="store_true",
                   help="run the conformance kit on the adapted original and the migrated "
                        "module and print every difference")
    p.add_argument("--device", type=device_type, default="cpu",
                   help="device of --check: cpu, cuda or cuda:N (default: %(default)s)")
    p.set_defaults(func=cmd_migrate)


def _error(message: str) -> int:
    print(f"vllm-attn migrate: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def cmd_migrate(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("libcst") is None:
        return _error(INSTALL_HINT)
    from vllm.migrate.rewrite import migrate
    from vllm.migrate.source import parse_target

    try:
        target = parse_target(args.target)
        result = migrate(target)
    except MigrationError as exc:
        return _error(f"{exc} (nothing written)")
    out: Path = args.out / target.path.name
    if args.diff:
        original = target.path.read_text(encoding="utf-8")
        sys.stdout.writelines(difflib.unified_diff(
            original.splitlines(keepends=True), result.code.splitlines(keepends=True),
            fromfile=str(target.path), tofile=str(out)))
    else:
        if out.resolve() == target.path.resolve():
            return _error(f"--out {args.out}: the migrated module would replace the input "
                          f"{target.path}; choose another directory (nothing written)")
        if out.exists() and not out.is_file():
            return _error(f"--out {args.out}: {out} exists and is not a file (nothing written)")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(result.code, encoding="utf-8")
    _summary(result, out, written=not args.diff)
    code = result.exit_code
    if args.check:
        checked = _check(result, target.path, str(args.device))
        code = code if result.manual_steps else checked  # steps left: they come first
    for step in result.manual_steps:
        print(step.format(out))
    return code


def _summary(result: MigrationResult, out: Path, *, written: bool) -> None:
    what = (f"{result.backend_name} ({result.class_name}), a {result.generation} backend "
            f"with a {result.layout} cache")
    print(f"{'wrote' if written else 'diff of'} {out}: {what}", file=sys.stderr)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    left = len(result.manual_steps)
    if left:
        print(f"{left} manual step{'s' if left != 1 else ''} left, each marked '# MIGRATE:' "
              "(listed below)", file=sys.stderr)


def _check(result: MigrationResult, path: Path, device: str) -> int:
    """Print the comparison; EXIT_CHECK_FAILED on a difference, else 0."""
    with tempfile.TemporaryDirectory(prefix="vllm-migrate-") as folder:
        return _compare(result, path, device, Path(folder))


def _compare(result: MigrationResult, path: Path, device: str, folder: Path) -> int:
    from shim.adapter import adapt_quietly
    from vllm.attention.backend import AttentionBackend
    from vllm.migrate.check import compare, load_module

    try:
        original = getattr(load_module(path, path.read_text(encoding="utf-8"), "_original",
                                       folder), result.class_name)
        migrated = getattr(load_module(path, result.code, "_migrated", folder),
                           result.class_name)
    except MigrationError as exc:
        left = " (manual steps are left: do them first)" if result.manual_steps else ""
        print(f"check: cannot compare{left}: {exc}")
        return EXIT_CHECK_FAILED if not result.manual_steps else EXIT_MANUAL_STEPS
    if not (isinstance(migrated, type) and issubclass(migrated, AttentionBackend)):
        if result.manual_steps:
            print(f"check: cannot compare (manual steps are left: do them first): the "
                  f"migrated {result.class_name} is not an AttentionBackend yet")
            return EXIT_MANUAL_STEPS
        print(f"check: the migrated {result.class_name} is not an AttentionBackend")
        return EXIT_CHECK_FAILED
    problems = migrated.declaration_problems()
    if problems:
        for line in problems:
            print(f"check: the migrated backend is declared wrongly: {line}")
        return EXIT_CHECK_FAILED if not result.manual_steps else EXIT_MANUAL_STEPS
    outcome = compare(adapt_quietly(original), migrated, device)
    for line in outcome.differences:
        print(f"check: {line}")
    kit = ", ".join(f"{who} {len(r.passed)} passed, {len(r.failures)} failed"
                    for who, r in zip(("original", "migrated"), outcome.reports))
    verdict = "same" if outcome.ok else f"{len(outcome.differences)} difference(s)"
    if result.manual_steps and not outcome.ok:
        verdict += " (manual steps are left: do them, then check again)"
    print(f"check: {verdict}: {len(outcome.compared)} configurations compared on {device}, "
          f"{len(outcome.refused)} refused by both; kit: {kit}", file=sys.stderr)
    return EXIT_OK if outcome.ok else EXIT_CHECK_FAILED
