"""Backend registry: registration and selection are separate steps.

In-tree backends are listed by import path and imported the first time they are
asked for; out-of-tree backends come from the entry-point group
``vllm.attention_backends`` (each entry point names a backend class). Legacy
backends are adapted through :mod:`shim` when they are registered.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import Any, Final

import torch

from vllm.attention.backend import AttentionBackend
from vllm.attention.errors import (
    BackendNotFoundError,
    BackendRegistrationError,
    InvalidArgumentError,
    NoBackendError,
    PluginLoadError,
    UnsupportedBackendError,
)
from vllm.attention.types import AttentionType

AnyBackend = type[AttentionBackend[Any]]

ENTRY_POINT_GROUP: Final = "vllm.attention_backends"

# name -> "module:Class"; the order is the selection priority (fastest first).
_IN_TREE: Final[dict[str, str]] = {
    "FLASH_ATTN": "vllm.attention.backends.flash_attn:FlashAttentionBackend",
    "FLASHINFER": "vllm.attention.backends.flashinfer:FlashInferBackend",
    "FLASHINFER_HND": "vllm.attention.backends.flashinfer:FlashInferHNDBackend",
    "TRITON_ATTN": "vllm.attention.backends.triton_attn:TritonAttentionBackend",
    "FLEX_ATTENTION": "vllm.attention.backends.flex_attention:FlexAttentionBackend",
    "TREE_ATTN": "vllm.attention.backends.tree_attn:TreeAttentionBackend",
    "FLASH_ATTN_DIFFKV": "vllm.attention.backends.flash_attn_diffkv:FlashAttentionDiffKVBackend",
    "ROCM_ATTN": "vllm.attention.backends.rocm_attn:RocmAttentionBackend",
    "ROCM_AITER_UNIFIED_ATTN":
        "vllm.attention.backends.rocm_aiter_unified_attn:RocmAiterUnifiedAttentionBackend",
    "ROCM_AITER_FA": "vllm.attention.backends.rocm_aiter_fa:RocmAiterFABackend",
    "FLASHMLA": "vllm.attention.backends.mla.flashmla:FlashMLABackend",
    "FLASHMLA_SPARSE": "vllm.attention.backends.mla.flashmla_sparse:FlashMLASparseBackend",
    "FLASH_ATTN_MLA": "vllm.attention.backends.mla.flash_attn_mla:FlashAttnMLABackend",
    "FLASHINFER_MLA": "vllm.attention.backends.mla.flashinfer_mla:FlashInferMLABackend",
    "CUTLASS_MLA": "vllm.attention.backends.mla.cutlass_mla:CutlassMLABackend",
    "TRITON_MLA": "vllm.attention.backends.mla.triton_mla:TritonMLABackend",
    "ROCM_AITER_MLA": "vllm.attention.backends.mla.rocm_aiter_mla:RocmAiterMLABackend",
    "ROCM_AITER_MLA_SPARSE":
        "vllm.attention.backends.mla.rocm_aiter_mla_sparse:RocmAiterMLASparseBackend",
    "TORCH_REF": "vllm.attention.backends.torch_ref:TorchRefBackend",
}


@dataclass(frozen=True)
class BackendEntry:
    """A registry row: where the backend comes from and, once loaded, its class."""

    name: str
    source: str
    """``in-tree``, ``plugin:<dist>`` or ``registered``."""
    target: str
    """``module:Class``."""
    cls: AnyBackend | None = None
    error: str | None = None
    pending: type | None = None
    """A class recorded by :func:`register_deferred`, checked when first asked for."""
    registered_at: tuple[str, int] | None = None


_lock = threading.RLock()
_entries: dict[str, BackendEntry] = {}
_plugins_loaded = False


def _init() -> None:
    global _plugins_loaded
    with _lock:
        if not _entries:
            for name, target in _IN_TREE.items():
                if importlib.util.find_spec(target.split(":")[0]) is not None:
                    _entries[name] = BackendEntry(name, "in-tree", target)
        if not _plugins_loaded:
            _plugins_loaded = True
            _load_plugins()


def _load_plugins() -> None:
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        _entries.setdefault(ep.name, BackendEntry(ep.name, f"plugin:{dist}", ep.value))


def import_target(target: str) -> object:
    """Import ``module:Attr``; a failure is a :class:`PluginLoadError` naming the target."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidArgumentError("backend", target, "a registered name or 'module:Class'")
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # the plugin's own error, whatever it is, is the cause
        raise PluginLoadError(f"cannot load backend {target!r}: {type(exc).__name__}: {exc}") from exc
    return obj


def _legacy_shaped(cls: type[AttentionBackend[Any]]) -> bool:
    """A class written like a legacy backend (its methods, not class data, say what it is)."""
    own = {k for c in cls.__mro__ if issubclass(c, AttentionBackend) and c is not AttentionBackend
           for k in vars(c)}
    return bool(own & {"get_name", "forward_includes_kv_cache_update"})


def _as_backend(obj: object, *, origin: str, name: str | None = None,
                registered_at: tuple[str, int] | None = None) -> AnyBackend:
    """A new-style backend class, adapting a legacy one through :mod:`shim` (quietly: an
    adapted backend warns when it is first used, pointing at ``registered_at``)."""
    if isinstance(obj, type) and issubclass(obj, AttentionBackend):
        problems = obj.declaration_problems()
        if problems and _legacy_shaped(obj):
            raise BackendRegistrationError(
                f"{origin}: backend {obj.__qualname__} subclasses the new "
                "vllm.attention.AttentionBackend but is written like a legacy backend "
                f"(get_name(), get_impl_cls(), ...; {'; '.join(problems)}). Subclass the "
                "legacy base vllm.v1.attention.backend.AttentionBackend (or "
                "vllm.attention.backends.abstract.AttentionBackend) to run it unchanged "
                "through the adapter, or declare name and kv_cache_layout as class data to "
                "migrate it (migration_guide.md)."
            )
        if problems:
            raise BackendRegistrationError(
                f"{origin}: backend {obj.__qualname__} is declared wrongly: "
                + "; ".join(problems)
            )
        if name is not None and name != obj.name:
            raise BackendRegistrationError(
                f"{origin}: name={name!r} for {obj.__qualname__}, whose name is {obj.name!r}; "
                "a new-style backend is registered under its own name (declare another)")
        return obj
    from shim.adapter import adapt_quietly
    from shim.declarations import is_legacy_backend

    if is_legacy_backend(obj):
        return adapt_quietly(obj, name=name, registered_at=registered_at)
    raise BackendRegistrationError(
        f"{origin}: got {obj!r}, expected an AttentionBackend subclass or a legacy backend "
        "class (get_name/get_impl_cls/get_builder_cls/get_kv_cache_shape)"
    )


def register_backend(cls: type, *, name: str | None = None, replace: bool = False,
                     registered_at: tuple[str, int] | None = None) -> AnyBackend:
    """Register ``cls`` under its name, or ``name`` (legacy classes only). Returns the
    registered, new-style class. Registering never makes it the selected backend.

    A legacy class is adapted; its one :class:`shim.LegacyBackendWarning` comes when it is
    first used and points at ``registered_at`` (default: the caller of this function).
    """
    if registered_at is None:
        from shim.warnings import caller_location

        registered_at = caller_location()
    backend = _as_backend(cls, origin="register_backend", name=name,
                          registered_at=registered_at)
    _init()
    with _lock:
        old = _entries.get(backend.name)
        if old is not None and not replace and old.cls is not backend:
            legacy = backend.migration == "adapted"
            how = (f"register_backend({cls.__qualname__}, name='MY_{backend.name}')"
                   if legacy else f"declare another name on {cls.__qualname__}")
            raise BackendRegistrationError(
                f"a backend named {backend.name!r} is already registered ({old.source}, "
                f"{old.target}); to register {cls.__module__}.{cls.__qualname__} beside it, "
                f"{how}; or pass replace=True to override it"
            )
        _entries[backend.name] = BackendEntry(
            backend.name, "registered", f"{cls.__module__}:{cls.__qualname__}", backend
        )
    return backend


def register_target(name: str, target: str) -> None:
    """Register ``module:Class`` under ``name``, imported (and checked) when first asked
    for; replaces an entry of that name."""
    module_name, sep, attr = target.partition(":")
    if not name:
        raise InvalidArgumentError("name", name, "a non-empty backend name")
    if not sep or not module_name or not attr:
        raise InvalidArgumentError("target", target, "'module:Class'")
    _init()
    with _lock:
        _entries[name] = BackendEntry(name, "registered", target)


def register_deferred(cls: type, *, name: str,
                      registered_at: tuple[str, int] | None) -> None:
    """Record ``cls`` under ``name`` and check (and adapt) it when first asked for, as
    upstream's ``@register_backend`` decorator does: the class it decorates names an impl
    and a builder that its module often defines further down. Replaces an entry of that
    name."""
    if not name:
        raise InvalidArgumentError("name", name, "a non-empty backend name")
    _init()
    with _lock:
        _entries[name] = BackendEntry(name, "registered", f"{cls.__module__}:{cls.__qualname__}",
                                      pending=cls, registered_at=registered_at)


def unregister_backend(name: str) -> None:
    with _lock:
        _entries.pop(name, None)


def _load(entry: BackendEntry) -> AnyBackend:
    if entry.cls is not None:
        return entry.cls
    if entry.error is not None:
        raise PluginLoadError(entry.error)
    try:
        deferred = entry.pending is not None
        obj = entry.pending if deferred else import_target(entry.target)
        cls = _as_backend(obj, origin=entry.target, name=entry.name if deferred else None,
                          registered_at=entry.registered_at)
    except (PluginLoadError, BackendRegistrationError) as exc:
        msg = f"backend {entry.name!r} ({entry.source}, {entry.target}) failed to load: {exc}"
        with _lock:
            _entries[entry.name] = BackendEntry(entry.name, entry.source, entry.target, error=msg)
        raise PluginLoadError(msg) from exc
    with _lock:
        _entries[entry.name] = BackendEntry(entry.name, entry.source, entry.target, cls)
    return cls


def get_backend(name: str) -> AnyBackend:
    """The backend registered as ``name``, or an out-of-tree ``module:Class``."""
    if not isinstance(name, str):
        raise InvalidArgumentError("name", name, "a backend name string")
    _init()
    if ":" in name and name not in _entries:
        return _as_backend(import_target(name), origin=name)
    entry = _entries.get(name)
    if entry is None:
        raise BackendNotFoundError(
            f"no attention backend named {name!r}; registered: {', '.join(list_backends())}"
        )
    return _load(entry)


def list_backends() -> list[str]:
    """Registered backend names, in selection priority order."""
    _init()
    with _lock:
        return list(_entries)


def in_tree_names() -> list[str]:
    """Names of the backends that ship with this package (plugins excluded)."""
    return list(_IN_TREE)


def list_entries() -> list[BackendEntry]:
    """Registry rows with their load state (the CLI table reads these)."""
    _init()
    with _lock:
        names = list(_entries)
    rows = []
    for name in names:
        try:
            _load(_entries[name])
        except PluginLoadError:
            pass
        rows.append(_entries[name])
    return rows


def select_backend(
    *,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    kv_cache_dtype: str = "auto",
    attn_type: AttentionType = AttentionType.DECODER,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    use_mla: bool = False,
    use_sparse: bool = False,
    device: torch.device | str | None = None,
    preferred: str | None = None,
) -> AnyBackend:
    """The first backend (priority order, or ``preferred``) that can run this.

    Raises :class:`UnsupportedBackendError` naming ``preferred``'s reasons, or
    :class:`NoBackendError` listing every candidate with its reasons.
    """
    config: dict[str, Any] = dict(
        dtype=dtype, head_size=head_size, block_size=block_size,
        kv_cache_dtype=kv_cache_dtype, attn_type=attn_type, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, use_mla=use_mla, use_sparse=use_sparse,
        device=None if device is None else torch.device(device),
    )
    if preferred is not None:
        backend = get_backend(preferred)
        reasons = backend.unsupported_reasons(**config)
        if reasons:
            raise UnsupportedBackendError(
                f"{backend.name} cannot run this configuration: " + "; ".join(reasons)
            )
        return backend
    why: list[str] = []
    for name in list_backends():
        if name == "TORCH_REF":
            continue  # the oracle is chosen only by name
        try:
            backend = get_backend(name)
        except PluginLoadError as exc:
            why.append(f"  {name}: {exc}")
            continue
        reasons = backend.unsupported_reasons(**config)
        if not reasons:
            return backend
        why.append(f"  {name}: " + "; ".join(reasons))
    raise NoBackendError("no attention backend can run this configuration:\n" + "\n".join(why))


def _reset_for_tests() -> None:
    """Forget every registration and plugin (tests only)."""
    global _plugins_loaded
    with _lock:
        _entries.clear()
        _plugins_loaded = False
