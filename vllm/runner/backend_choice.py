"""Which backend serves, with which block size and dtype, and what it costs in
deprecations.

A named backend (registry name or ``module:Class``) that cannot serve the model
is an error naming its reasons; with no name, the first registered backend
(priority order) that can serve the model at the dtype asked for (``--dtype``, or
what ``auto`` means on the device) wins, and TORCH_REF when none can. Adapted
legacy backends warn once at start (never per step or layer); with
``strict=True`` they are refused.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from vllm.attention.backend import AttentionBackend, dtype_name
from vllm.attention.errors import (
    AttentionError,
    InvalidArgumentError,
    NoBackendError,
    PluginLoadError,
    UnsupportedBackendError,
)
from vllm.attention.registry import get_backend, list_backends
from vllm.runner.attention_block import cache_head_size
from vllm.runner.config import ModelConfig

AnyBackend = type[AttentionBackend[Any]]
DTypeChoice = Literal["auto", "float32", "bfloat16", "float16"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


class LegacyBackendRefusedError(AttentionError, RuntimeError):
    """``--strict-backends`` refused an adapted legacy backend."""


@dataclass(frozen=True)
class BackendChoice:
    backend: AnyBackend
    block_size: int
    dtype: torch.dtype
    deprecations: list[str] = field(default_factory=list)
    """One line per adapted legacy backend in use (for the run's closing report)."""
    note: str | None = None


def pick_block_size(backend: AnyBackend) -> int:
    """16 when the backend takes it, else its smallest declared size >= 16, else its largest."""
    sizes = backend.block_sizes.examples()
    if not sizes:
        raise UnsupportedBackendError(
            f"{backend.name} declares no usable block size ({backend.block_sizes.describe()})")
    if 16 in sizes:
        return 16
    at_least = [s for s in sizes if s >= 16]
    return min(at_least) if at_least else max(sizes)


def wanted_dtype(choice: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype ``--dtype`` asks for; ``auto`` is the checkpoint's on CUDA and float32
    elsewhere."""
    if choice == "auto":
        return config.checkpoint_dtype if device.type == "cuda" else torch.float32
    if choice not in _DTYPES:
        raise InvalidArgumentError("--dtype", choice, "auto, float32, bfloat16 or float16")
    return _DTYPES[choice]


def resolve_dtype(choice: str, config: ModelConfig, backend: AnyBackend,
                  device: torch.device) -> torch.dtype:
    """The dtype ``backend`` serves with: :func:`wanted_dtype`, except that for ``auto``
    a backend that cannot run it gets its first 16-bit dtype (bfloat16, then float16)."""
    wanted = wanted_dtype(choice, config, device)
    if choice != "auto" or wanted in backend.supported_dtypes:
        return wanted
    for dtype in (torch.bfloat16, torch.float16):
        if dtype in backend.supported_dtypes:
            return dtype
    return wanted


def _reasons(backend: AnyBackend, config: ModelConfig, dtype: torch.dtype, block_size: int,
             kv_cache_dtype: str, device: torch.device) -> list[str]:
    head_size = (config.attn_head_size if config.is_mla
                 else cache_head_size(backend, config.head_dim, config.head_dim))
    return backend.unsupported_reasons(
        dtype=dtype, head_size=head_size, block_size=block_size,
        kv_cache_dtype=kv_cache_dtype, use_mla=config.is_mla,
        # sparse MLA backends serve with the runner's stand-in indexer (engine.py)
        use_sparse=config.is_mla and backend.is_sparse, device=device,
    )


@dataclass(frozen=True)
class ResolvedBackend:
    """A named backend, loaded, with the warnings its loading raised (held back)."""

    name: str
    backend: AnyBackend
    warnings: list[warnings.WarningMessage]


def resolve_backend_name(name: str) -> ResolvedBackend:
    """Load ``name`` (registry name or ``module:Class``), recording its warnings so
    :func:`choose_backend` decides whether and where they are shown."""
    backend, caught = _import_recording(name)
    return ResolvedBackend(name, backend, caught)


def _import_recording(name: str) -> tuple[AnyBackend, list[warnings.WarningMessage]]:
    if ":" in name and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: module:Class from the cwd
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = get_backend(name)
    return backend, caught


def _deprecation_line(backend: AnyBackend) -> str:
    return (f"{backend.name} ({backend.__module__}) is an adapted legacy backend served "
            "through the shim; migrate it (migration_guide.md)")


def choose_backend(name: str | ResolvedBackend | None, config: ModelConfig, *, dtype: str,
                   device: torch.device, block_size: int | None = None,
                   kv_cache_dtype: str = "auto", strict: bool = False,
                   show_warnings: bool = True) -> BackendChoice:
    """The backend that serves ``config`` on ``device``; see the module docstring.

    ``show_warnings=False`` (non-driver ranks) keeps the legacy warning to rank 0.
    """
    if name is None:
        return _choose_default(config, dtype=dtype, device=device, block_size=block_size,
                               kv_cache_dtype=kv_cache_dtype)
    resolved = name if isinstance(name, ResolvedBackend) else resolve_backend_name(name)
    name, backend, caught = resolved.name, resolved.backend, resolved.warnings
    legacy = backend.migration == "adapted"
    if legacy and strict:
        told = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        raise LegacyBackendRefusedError(
            f"--strict-backends: backend {name!r} is an adapted legacy backend and is refused. "
            + (told[0] if told else _deprecation_line(backend) + ".")
        )
    for w in caught:
        if show_warnings or not issubclass(w.category, FutureWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    bs = pick_block_size(backend) if block_size is None else block_size
    dt = resolve_dtype(dtype, config, backend, device)
    reasons = _reasons(backend, config, dt, bs, kv_cache_dtype, device)
    if reasons:
        raise UnsupportedBackendError(
            f"--backend {name}: {backend.name} cannot serve this model "
            f"({config.architecture}, dtype={dtype_name(dt)}, block_size={bs}, "
            f"device={device.type}): " + "; ".join(reasons)
        )
    wanted = wanted_dtype(dtype, config, device)
    note = None if dt == wanted else (
        f"{backend.name} does not run {dtype_name(wanted)} (what --dtype auto is on "
        f"{device.type}); serving {dtype_name(dt)}")
    return BackendChoice(backend, bs, dt, [_deprecation_line(backend)] if legacy else [],
                         note=note)


def _choose_default(config: ModelConfig, *, dtype: str, device: torch.device,
                    block_size: int | None, kv_cache_dtype: str) -> BackendChoice:
    wanted = wanted_dtype(dtype, config, device)
    why: list[str] = []
    candidates: list[AnyBackend] = []
    for name in list_backends():
        if name == "TORCH_REF":
            continue
        try:
            backend = get_backend(name)
        except PluginLoadError as exc:
            why.append(f"  {name}: {exc}")
            continue
        if backend.migration != "adapted":  # never chosen silently; name it with --backend
            candidates.append(backend)
    ref = get_backend("TORCH_REF")

    def size(backend: AnyBackend) -> int:
        if block_size is not None:
            return block_size
        return 16 if backend is ref else pick_block_size(backend)

    # the wanted dtype first: a faster backend at another dtype is not what was asked for
    for backend in candidates:
        reasons = _reasons(backend, config, wanted, size(backend), kv_cache_dtype, device)
        if not reasons:
            return BackendChoice(backend, size(backend), wanted)
        why.append(f"  {backend.name}: " + "; ".join(reasons))
    if not _reasons(ref, config, wanted, size(ref), kv_cache_dtype, device):
        return BackendChoice(ref, size(ref), wanted, note="no faster backend can serve this "
                                                          "here; using the TORCH_REF oracle")
    if dtype == "auto":  # nothing runs the documented dtype: one that runs its own
        for backend in [*candidates, ref]:
            dt = resolve_dtype(dtype, config, backend, device)
            if dt != wanted and not _reasons(backend, config, dt, size(backend),
                                             kv_cache_dtype, device):
                return BackendChoice(backend, size(backend), dt, note=(
                    f"no backend serves {dtype_name(wanted)} here; {backend.name} "
                    f"serves {dtype_name(dt)}"))
    raise NoBackendError(f"no attention backend can serve this model at "
                         f"dtype={dtype_name(wanted)}:\n" + "\n".join(why))
