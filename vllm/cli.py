"""``vllm-attn``: list backends, run the conformance kit, serve tokens.

  vllm-attn backends           the registry as a table (status, layout, paths, why not)
  vllm-attn check [NAME ...]   the conformance kit; exit 1 on any failure
  vllm-attn generate ...       serve tokens through the paged-KV runner
  vllm-attn migrate PATH       rewrite a legacy backend module into the new API
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from vllm.attention.backend import AttentionBackend
from vllm.attention.errors import AttentionError

AnyBackend = type[AttentionBackend[Any]]


DEVICE_TYPES = ("cpu", "cuda")
"""The device types the backends run on (ROCm's torch calls its GPUs ``cuda`` too)."""


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device(text: str) -> torch.device:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (argparse turns the error into a
    usage message and exit code 2)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected cpu, cuda or cuda:N (the device types the backends "
            "run on)")
    return device


def device_unavailable(device: torch.device) -> str | None:
    """Why this machine cannot run on ``device``, or None when it can."""
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        if torch.version.cuda is None and torch.version.hip is None:
            return f"torch {torch.__version__} is a CPU-only build"
        return (f"torch {torch.__version__} sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    count = torch.cuda.device_count()
    if (device.index or 0) >= count:  # (no index: the current device, which exists)
        return f"this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
    return None


def available_device(text: str) -> torch.device:
    """``--device`` for a command that must run there (``generate``)."""
    device = parse_device(text)
    why = device_unavailable(device)
    if why is not None:
        raise argparse.ArgumentTypeError(f"got {text!r}, but {why} (use --device cpu)")
    return device


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
    absent = device_unavailable(device)
    for entry in list_entries():
        if entry.cls is None:
            rows.append({"name": entry.name, "status": "broken", "layout": "-",
                         "cache dtypes": "-", "writer": "-", "compute": "-",
                         "here": f"no: {entry.error}"})
            continue
        b = entry.cls
        blockers = [absent] if absent else b.device_unsupported_reasons(device)
        notes = [] if absent else b.compute_path_notes(device)
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
    _print_table(backend_rows(args.device))
    return 0


def _runs_on(backend: AnyBackend, device: torch.device) -> bool:
    try:
        return not backend.device_unsupported_reasons(device)
    except Exception:  # a plugin's hook that raises: check_backend reports it as its FAIL
        return True


def kit_header(device: torch.device) -> str:
    """``check``'s first line: what runs, and where."""
    head = "conformance kit (docs/conformance.md) on "
    absent = device_unavailable(device)
    if absent is not None:
        return head + f"{device}: {absent}; nothing can run there"
    if device.type == "cpu":
        return head + ("cpu: the backends' CPU paths only; their GPU paths (vendor "
                       "kernels, Triton) run with --device cuda on a machine with a GPU")
    return head + (f"{device} ({torch.cuda.get_device_name(device)}): the writer and "
                   "compute paths each backend takes here")


def cmd_check(args: argparse.Namespace) -> int:
    from vllm.attention.conformance import check_backend
    from vllm.attention.registry import list_entries

    device: torch.device = args.device
    absent = device_unavailable(device)
    targets: list[str] = list(args.backends)
    if args.all or not targets:
        # an entry that failed to load (a bad declaration, an import error) stays in:
        # it is reported as that backend's FAIL, never silently left out
        targets = [e.name for e in list_entries() if e.cls is None or absent is not None
                   or _runs_on(e.cls, device)] + targets
    print(kit_header(device))
    failed = skipped = 0
    for target in targets:
        try:
            backend = _resolve(target)
        except AttentionError as exc:
            text = str(exc)  # a module:Class target's error already starts with it
            print(f"FAIL {text}" if text.startswith(f"{target}: ") else f"FAIL {target}: {text}")
            failed += 1
            continue
        if absent is not None:  # one line, not one failure per configuration
            print(f"SKIP {backend.name} [{device}] status={backend.migration}: {device} is "
                  "not available here")
            skipped += 1
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
        skipped += status == "SKIP"
    summary = f"{len(targets) - failed - skipped} passed, {failed} failed"
    print(summary + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


class _Parser(argparse.ArgumentParser):
    """Usage errors in two lines (the message, then where the options are listed)
    instead of the whole usage block in front of them."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the "
                     "options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-attn", description=(__doc__ or "").replace("``", ""),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list registered backends and what runs here")
    p.add_argument("--device", type=parse_device, default=_default_device(),
                   help="cpu, cuda or cuda:N (default: %(default)s)")
    p.set_defaults(func=cmd_backends)
    p = sub.add_parser("check", help="run the conformance kit")
    p.add_argument("backends", nargs="*", metavar="NAME|module:Class",
                   help="backends to check (default: every one that can run here)")
    p.add_argument("--all", action="store_true",
                   help="also check every registered backend that can run here")
    p.add_argument("--device", type=parse_device, default=_default_device(),
                   help="cpu, cuda or cuda:N (default: %(default)s); an absent device "
                        "is one SKIP line per backend")
    p.add_argument("--thorough", action="store_true", help="the full grid (slower)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_check)
    try:
        from vllm.runner.cli import add_generate_parser
    except ImportError:  # the runner is optional until it lands
        pass
    else:
        add_generate_parser(sub, device_type=available_device)
    from vllm.migrate.command import add_migrate_parser

    add_migrate_parser(sub, device_type=parse_device)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except BrokenPipeError:  # `vllm-attn backends | head`: the reader left, not an error of ours
        # stdout's buffer is still full; point it at devnull so the exit flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())
