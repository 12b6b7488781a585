"""``vllm-attn``: list backends, run the conformance kit, serve tokens.

``vllm-attn backends``        the registry as a table (status, layout, paths, why not)
``vllm-attn check [NAME ...]`` the conformance kit; exit 1 on any failure
``vllm-attn generate ...``     serve tokens through the paged-KV runner
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from vllm.attention.backend import AttentionBackend
from vllm.attention.errors import AttentionError

AnyBackend = type[AttentionBackend[Any]]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve(target: str) -> AnyBackend:
    from vllm.attention.registry import get_backend

    if ":" in target and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: module:Class from the cwd
    return get_backend(target)


def _writer_path(backend: AnyBackend, device: torch.device) -> str:
    try:
        writer = backend.get_kv_cache_writer("auto")
    except AttentionError as exc:
        return f"error: {exc}"
    path = getattr(writer, "path", None)
    name = type(writer).__name__
    return f"{name} ({path(device) if callable(path) else 'torch'})"


def backend_rows(device: torch.device) -> list[dict[str, str]]:
    """One row per registered backend: the table ``vllm-attn backends`` prints."""
    from vllm.attention.registry import list_entries

    rows = []
    for entry in list_entries():
        if entry.cls is None:
            rows.append({"name": entry.name, "status": "broken", "layout": "-",
                         "cache dtypes": "-", "writer": "-", "compute": "-",
                         "here": f"no: {entry.error}"})
            continue
        b = entry.cls
        blockers = b.device_unsupported_reasons(device)
        notes = b.compute_path_notes(device)
        here = "yes" if not blockers else "no: " + "; ".join(blockers)
        if not blockers and notes:
            here += " (" + "; ".join(notes) + ")"
        rows.append({
            "name": b.name,
            "status": b.migration,
            "layout": b.kv_cache_layout.value,
            "cache dtypes": ",".join(sorted(b.supported_kv_cache_dtypes)),
            "writer": _writer_path(b, device),
            "compute": b.compute_path(device) if not blockers else "-",
            "here": here,
        })
    return rows


def _print_table(rows: list[dict[str, str]]) -> None:
    if not rows:
        print("(no backends registered)")
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols[:-1]}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols[:-1]) + "  " + cols[-1].upper())
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols[:-1]) + "  " + r[cols[-1]])


def cmd_backends(args: argparse.Namespace) -> int:
    _print_table(backend_rows(torch.device(args.device)))
    return 0


def _runs_on(backend: AnyBackend, device: torch.device) -> bool:
    try:
        return not backend.device_unsupported_reasons(device)
    except Exception:  # a plugin's hook that raises: check_backend reports it as its FAIL
        return True


def cmd_check(args: argparse.Namespace) -> int:
    from vllm.attention.conformance import check_backend
    from vllm.attention.registry import list_entries

    device = torch.device(args.device)
    targets: list[str] = list(args.backends)
    if args.all or not targets:
        # an entry that failed to load (a bad declaration, an import error) stays in:
        # it is reported as that backend's FAIL, never silently left out
        targets = [e.name for e in list_entries() if e.cls is None
                   or _runs_on(e.cls, device)] + targets
    failed = 0
    for target in targets:
        try:
            backend = _resolve(target)
        except AttentionError as exc:
            text = str(exc)  # a module:Class target's error already starts with it
            print(f"FAIL {text}" if text.startswith(f"{target}: ") else f"FAIL {target}: {text}")
            failed += 1
            continue
        report = check_backend(backend, device, thorough=args.thorough)
        status = "PASS" if report.ok else "FAIL"
        if report.skipped and not report.passed and report.ok:
            status = "SKIP"
        print(f"{status} {report.backend} [{report.device}] status={backend.migration} "
              f"compute={report.compute_path} writer={report.writer_path} "
              f"configs={len(report.passed)}/{len(report.passed) + len(report.failures)}")
        for line in report.failures:
            print(f"    fail: {line}")
        for line in report.skipped:
            print(f"    skip: {line}")
        if args.verbose:
            for line in report.passed:
                print(f"    ok:   {line}")
        failed += not report.ok
    print(f"{len(targets) - failed} passed, {failed} failed")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-attn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list registered backends and what runs here")
    p.add_argument("--device", default=_default_device())
    p.set_defaults(func=cmd_backends)
    p = sub.add_parser("check", help="run the conformance kit")
    p.add_argument("backends", nargs="*", metavar="NAME|module:Class",
                   help="backends to check (default: every one that can run here)")
    p.add_argument("--all", action="store_true",
                   help="also check every registered backend that can run here")
    p.add_argument("--device", default=_default_device())
    p.add_argument("--thorough", action="store_true", help="the full grid (slower)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_check)
    try:
        from vllm.runner.cli import add_generate_parser
    except ImportError:  # the runner is optional until it lands
        pass
    else:
        add_generate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
