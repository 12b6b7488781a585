"""``--check``: the adapted original against the migrated module, case by case.

Both run the conformance kit (``check_backend``) and, for every configuration of their
grids, the same layer step (:func:`vllm.attention.conformance.run_layer_step`): the
cache bytes must be identical, the outputs equal within the backend's tolerance, and
the declared capabilities the same. Each difference is one line.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import torch

from vllm.attention.backend import AttentionBackend, SizeSpec
from vllm.attention.conformance import (
    CheckConfig,
    Report,
    StepResult,
    check_backend,
    conformance_grid,
    run_layer_step,
)
from vllm.migrate.report import MigrationError

AnyBackend = type[AttentionBackend[Any]]

HEAD_PROBE: Final = range(1, 513)
BLOCK_PROBE: Final = range(1, 1025)
SHAPE_PROBE: Final = (7, 16, 3, 8)


@dataclass
class CheckResult:
    """The comparison of one migration."""

    differences: list[str] = field(default_factory=list)
    compared: list[str] = field(default_factory=list)
    """Configurations whose steps were compared."""
    refused: list[str] = field(default_factory=list)
    """Configurations both backends refuse (with the reasons)."""
    reports: tuple[Report, ...] = ()
    """The kit's reports on the original and on the migrated backend."""

    @property
    def ok(self) -> bool:
        return not self.differences


def _package_of(path: Path) -> tuple[Path, str]:
    """The directory to import from and the dotted package of ``path`` ('' for none)."""
    parts: list[str] = []
    folder = path.resolve().parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, ".".join(parts)


@contextmanager
def _quiet_legacy() -> Iterator[None]:
    from shim.warnings import LegacyBackendWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyBackendWarning)
        yield


def load_module(path: Path, code: str, tag: str, folder: Path | None = None) -> ModuleType:
    """``code`` as a module next to ``path`` (its relative imports resolve as the
    original's do), under a private name so it never replaces the original module. Its
    file is written to ``folder`` (default: a new temporary directory)."""
    root, package = _package_of(path)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    name = f"{package}.{tag}_{path.stem}" if package else f"{tag}_{path.stem}"
    folder = Path(tempfile.mkdtemp(prefix="vllm-migrate-", dir=folder))
    file = folder / f"{path.stem}.py"
    file.write_text(code, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise MigrationError(f"{path}: cannot load it as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _quiet_legacy():
            spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise MigrationError(f"{path} ({tag}): importing it raised {type(exc).__name__}: "
                             f"{exc}") from exc
    return module


def _sizes(spec: SizeSpec, probe: range) -> list[int]:
    return [n for n in probe if spec.admits(n)]


def compare_capabilities(original: AnyBackend, migrated: AnyBackend) -> list[str]:
    """One line per declaration the two backends answer differently."""
    lines = []

    def differ(what: str, a: object, b: object) -> None:
        if a != b:
            lines.append(f"{what}: original {a}, migrated {b}")

    differ("name", original.name, migrated.name)
    differ("kv_cache_layout", original.kv_cache_layout.name, migrated.kv_cache_layout.name)
    differ(f"get_kv_cache_shape{SHAPE_PROBE}", original.get_kv_cache_shape(*SHAPE_PROBE),
           migrated.get_kv_cache_shape(*SHAPE_PROBE))
    differ("get_kv_cache_stride_order", original.get_kv_cache_stride_order(),
           migrated.get_kv_cache_stride_order())
    differ("supported_dtypes", sorted(map(str, original.supported_dtypes)),
           sorted(map(str, migrated.supported_dtypes)))
    differ("supported_kv_cache_dtypes", sorted(original.supported_kv_cache_dtypes),
           sorted(migrated.supported_kv_cache_dtypes))
    differ("attention_types", sorted(t.value for t in original.attention_types),
           sorted(t.value for t in migrated.attention_types))
    differ("supports_sliding_window", original.supports_sliding_window,
           migrated.supports_sliding_window)
    differ("supports_logits_soft_cap", original.supports_logits_soft_cap,
           migrated.supports_logits_soft_cap)
    for what, probe in (("head_sizes", HEAD_PROBE), ("block_sizes", BLOCK_PROBE)):
        a, b = getattr(original, what), getattr(migrated, what)
        if _sizes(a, probe) != _sizes(b, probe):
            lines.append(f"{what}: original admits {a.describe()}, migrated {b.describe()} "
                         f"(over {probe.start}..{probe.stop - 1})")
    return lines


def _status(report: Report) -> dict[str, str]:
    """Configuration id -> pass / fail: ... / skip: ... of one kit run."""
    status = {cid: "pass" for cid in report.passed}
    for line in report.failures:
        cid = line.split(" ", 1)[0].rstrip(":")
        status.setdefault(cid, "fail: " + line)
    for line in report.skipped:
        status.setdefault(line.split(":", 1)[0], "skip")
    return status


def _refusal(backend: AnyBackend, cfg: CheckConfig) -> list[str]:
    return backend.unsupported_reasons(
        dtype=cfg.dtype, head_size=cfg.head_size, block_size=cfg.block_size,
        kv_cache_dtype=cfg.cache_dtype, attn_type=cfg.attn_type,
        sliding_window=cfg.sliding_window, logits_soft_cap=cfg.logits_soft_cap,
        device=torch.device(cfg.device))


def _unwrapped(step: StepResult | Exception) -> StepResult | Exception:
    """What the legacy code raised, where the adapter wrapped it (its original exception
    is the ``__cause__``)."""
    while isinstance(step, Exception) and type(step).__name__ == "LegacyBackendRuntimeError" \
            and isinstance(step.__cause__, Exception):
        step = step.__cause__
    return step


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    ref = b.double()
    denom = float(ref.norm())
    return float((a.double() - ref).norm()) / (denom if denom > 0 else 1.0)


def compare(original: AnyBackend, migrated: AnyBackend, device: str = "cpu", *,
            thorough: bool = False) -> CheckResult:
    """Compare an adapted legacy backend (``original``) with its migration."""
    result = CheckResult()
    with _quiet_legacy():
        result.differences.extend(compare_capabilities(original, migrated))
        reports = (check_backend(original, device, thorough=thorough),
                   check_backend(migrated, device, thorough=thorough))
        result.reports = reports
        before, after = (_status(r) for r in reports)
        for cid in sorted(set(before) | set(after)):
            if before.get(cid, "absent").split(":")[0] != after.get(cid, "absent").split(":")[0]:
                result.differences.append(
                    f"{cid}: original {before.get(cid, 'not in its grid')}, migrated "
                    f"{after.get(cid, 'not in its grid')}")
        grid = {c.id: c for c in conformance_grid(original, device, thorough=thorough)}
        for c in conformance_grid(migrated, device, thorough=thorough):
            grid.setdefault(c.id, c)
        for seed, (cid, cfg) in enumerate(sorted(grid.items())):
            result.differences.extend(_compare_step(original, migrated, cfg, seed, result))
    return result


def _compare_step(original: AnyBackend, migrated: AnyBackend, cfg: CheckConfig, seed: int,
                  result: CheckResult) -> list[str]:
    refused = [_refusal(b, cfg) for b in (original, migrated)]
    if bool(refused[0]) != bool(refused[1]):
        who = "original" if refused[0] else "migrated"
        return [f"{cfg.id}: only the {who} refuses it: {'; '.join(refused[0] or refused[1])}"]
    if refused[0]:
        result.refused.append(f"{cfg.id}: {'; '.join(refused[0])}")
        return []
    steps: list[StepResult | Exception] = []
    for backend in (original, migrated):
        try:
            steps.append(run_layer_step(backend, cfg, seed=seed))
        except Exception as exc:  # one side failing is a difference, named with its cause
            steps.append(exc)
    a, b = (_unwrapped(s) for s in steps)
    if isinstance(a, Exception) or isinstance(b, Exception):
        if isinstance(a, Exception) and isinstance(b, Exception) and type(a) is type(b):
            result.compared.append(cfg.id)
            return []  # both raise alike: the kit reports it on both
        said = [f"raised {type(s).__name__}: {s}" if isinstance(s, Exception) else "ran"
                for s in (a, b)]
        return [f"{cfg.id}: original {said[0]}, migrated {said[1]}"]
    result.compared.append(cfg.id)
    lines = []
    if a.cache.shape != b.cache.shape or not torch.equal(a.cache, b.cache):
        differ = int((a.cache != b.cache).sum()) if a.cache.shape == b.cache.shape else -1
        what = f"{differ} of {a.cache.numel()} bytes" if differ >= 0 else "its size"
        lines.append(f"{cfg.id}: the cache after the step differs in {what}")
    tol = migrated.tolerances.get(cfg.dtype, 0.0)
    if a.output.shape != b.output.shape:
        lines.append(f"{cfg.id}: output shape {tuple(a.output.shape)} (original) vs "
                     f"{tuple(b.output.shape)} (migrated)")
    else:
        err = _rel_err(b.output, a.output)
        if not (err <= tol or (math.isnan(err) and torch.equal(a.output.isnan(),
                                                                b.output.isnan()))):
            lines.append(f"{cfg.id}: outputs differ by {err:.2e} (relative), more than the "
                         f"tolerance {tol:.0e}")
    return lines
