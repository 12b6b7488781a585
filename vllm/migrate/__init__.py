"""``vllm-attn migrate``: rewrite a legacy attention backend module into the new API.

The command reads a legacy backend (fused or flagged, written against upstream's import
paths or this package's own legacy examples) with ``libcst``, keeps its comments and
formatting, and writes the migrated module: new-API imports, declarations as class
data, the cache write moved to the writer of its layout, metadata without
``slot_mapping`` and the builder in the new signature. ``--check`` proves the result
against the adapted original with the conformance kit. ``migration_guide.md`` and
``docs/cli.md`` describe it.

This package imports without ``libcst``; only the rewrite needs it
(``pip install 'vllm-kv-writer[migrate]'``).

Modules: :mod:`~vllm.migrate.report` (results, manual steps, errors),
:mod:`~vllm.migrate.source` (reading the input), :mod:`~vllm.migrate.analysis` (what
the module holds), :mod:`~vllm.migrate.literal` (evaluating literal legacy methods),
:mod:`~vllm.migrate.declarations` (legacy methods to class data),
:mod:`~vllm.migrate.layout` (the cache layout), :mod:`~vllm.migrate.writes` (finding
the write), :mod:`~vllm.migrate.plan` (the edits, applied in one pass), the piece
rewriters :mod:`~vllm.migrate.metadata` (metadata and builder), :mod:`~vllm.migrate.impl`
and :mod:`~vllm.migrate.backend_class`, :mod:`~vllm.migrate.imports`,
:mod:`~vllm.migrate.rewrite` (one migration), :mod:`~vllm.migrate.check` (the
comparison) and :mod:`~vllm.migrate.command` (the subcommand).
"""

from vllm.migrate.report import (
    EXIT_CHECK_FAILED,
    EXIT_ERROR,
    EXIT_MANUAL_STEPS,
    EXIT_OK,
    ManualStep,
    MigrationError,
    MigrationResult,
)

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_ERROR",
    "EXIT_MANUAL_STEPS",
    "EXIT_OK",
    "ManualStep",
    "MigrationError",
    "MigrationResult",
]
