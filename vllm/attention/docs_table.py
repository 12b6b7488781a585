"""The README's backend table, rendered from the registry's declarations.

``python -m vllm.attention.docs_table``                  print the table
``python -m vllm.attention.docs_table --write README.md`` refresh it between the markers
``python -m vllm.attention.docs_table --check README.md`` exit 1 if it is stale

Only in-tree backends are listed, and only from what they declare (layouts, cache
dtypes, block sizes, vendor kernels, portable path), so the table is the same on
every machine: with or without a GPU, triton, vendor packages or plugins.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch

from vllm.attention import registry
from vllm.attention.backend import AttentionBackend
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.types import KVCacheDType

AnyBackend = type[AttentionBackend[Any]]

START: Final = "<!-- backends:start -->"
END: Final = "<!-- backends:end -->"
REGENERATE: Final = "python -m vllm.attention.docs_table --write README.md"
COLUMNS: Final = ("name", "status", "cache layout", "cache dtypes", "block sizes",
                  "CPU path", "GPU paths (declared, in order)")


def _cache_dtypes(backend: AnyBackend) -> list[KVCacheDType]:
    return sorted(backend.supported_kv_cache_dtypes, key=lambda d: (d != "auto", d))


def layouts_cell(backend: AnyBackend) -> str:
    """The main layout, then each cache format that brings its own, with those formats."""
    main = backend.kv_cache_layout
    others: dict[str, list[str]] = {}
    for cache_dtype in _cache_dtypes(backend):
        layout = backend.kv_cache_layout_for(cache_dtype)
        if layout is not main:
            others.setdefault(layout.value, []).append(cache_dtype)
    extra = "".join(f"; `{layout}` for {', '.join(dts)}" for layout, dts in others.items())
    return f"`{main.value}`{extra}"


def cpu_path(backend: AnyBackend) -> str:
    """What computes on a CPU device. Vendor kernels and Triton decline a CPU device
    before importing anything, so this does not depend on the machine."""
    if backend.migration == "adapted":
        return "legacy `forward()`"
    cpu = torch.device("cpu")
    blockers = backend.device_unsupported_reasons(cpu)
    if blockers:
        return "none: " + "; ".join(blockers)
    return backend.compute_path(cpu)


def gpu_paths(backend: AnyBackend) -> list[str]:
    """The GPU compute paths a backend declares, in the order it tries them.

    Declarations, not probing: the first one that imports and suits the device
    and call runs; the portable path is torch where triton does not import.
    """
    from vllm.attention.backends.mla.common import MLABackend
    from vllm.attention.backends.standard import StandardBackend

    if backend.migration == "adapted":
        return ["legacy `forward()`"]
    if issubclass(backend, StandardBackend):
        return [kernel.name for kernel in backend.vendor_kernels] + [backend.portable_path]
    if issubclass(backend, MLABackend):
        vendor = backend.get_impl_cls().vendor
        return ([] if vendor is None else [vendor.name]) + ["triton"]
    if backend.compute_path.__func__ is AttentionBackend.compute_path.__func__:  # type: ignore[attr-defined]
        return ["torch"]  # the base class declares one path for every device
    return ["see `compute_path()`"]


def backend_row(backend: AnyBackend) -> dict[str, str]:
    """One table row, from ``backend``'s declarations only."""
    return {
        "name": backend.name,
        "status": backend.migration,
        "cache layout": layouts_cell(backend),
        "cache dtypes": ", ".join(_cache_dtypes(backend)),
        "block sizes": backend.block_sizes.describe(),
        "CPU path": cpu_path(backend),
        "GPU paths (declared, in order)": " → ".join(gpu_paths(backend)),
    }


def in_tree_backends() -> list[AnyBackend]:
    """The backends that ship with the package, in selection priority order."""
    # The registry's in-tree table, not list_backends(): plugins installed here
    # (or registered by a test) must not change what the README says ships.
    return [registry.get_backend(name) for name in registry.in_tree_names()]


def render_table(backends: Sequence[AnyBackend] | None = None) -> str:
    """The markdown table of ``backends`` (default: every in-tree backend)."""
    rows = [backend_row(b) for b in (in_tree_backends() if backends is None else backends)]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row[c] for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def replace_table(text: str, table: str) -> str:
    """``text`` with everything between the two marker comments replaced by ``table``."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise InvalidArgumentError(
            "text", f"{START in text=}, {END in text=}",
            f"a document with {START} followed by {END} on their own lines",
        )
    notice = f"<!-- generated from the registry by `{REGENERATE}`; do not edit -->\n"
    return text[: start + len(START)] + "\n" + notice + table + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm.attention.docs_table",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", metavar="FILE", type=Path,
                      help="replace the table between the markers in FILE")
    mode.add_argument("--check", metavar="FILE", type=Path,
                      help="exit 1 if FILE's table differs from the registry's")
    args = parser.parse_args(argv)
    table = render_table()
    if args.write is None and args.check is None:
        sys.stdout.write(table)
        return 0
    path: Path = args.write or args.check
    text = path.read_text(encoding="utf-8")
    fresh = replace_table(text, table)
    if args.check is not None:
        if fresh != text:
            sys.stderr.write(f"{path}: the backend table is stale; run `{REGENERATE}`\n")
            return 1
        return 0
    if fresh != text:
        path.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
