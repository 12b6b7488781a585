"""Wrap a legacy backend into a new-style :class:`~vllm.attention.AttentionBackend`.

Two legacy generations (``docs/architecture.md``, ``migration_guide.md``):

* **fused**: ``impl.forward()`` writes the cache itself from ``attn_metadata.slot_mapping``.
  The adapted writer writes the same slots first (through the standard writer of
  the layout the legacy shape implies); the legacy forward then rewrites identical
  bytes, so the cache and the output are bit-identical to running it directly.
* **flagged**: ``forward_includes_kv_cache_update = False`` plus
  ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``, which
  becomes the adapted writer.

Both get the layer's slot mapping copied from the ForwardContext into the legacy
metadata before the legacy ``forward`` runs.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import threading
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from typing_extensions import TypeGuard

from shim.legacy import LegacyCommonAttentionMetadata
from shim.warnings import warn_once
from vllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerProtocol,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    SizeSpec,
    common_fields,
)
from vllm.attention.errors import AttentionError, LegacyBackendError
from vllm.attention.types import (
    KVCacheDType,
    KVCacheLayout,
    KVQuant,
    parse_kv_cache_dtype,
)
from vllm.attention.writer import KVCacheWriter
from vllm.attention.writers import writer_for_layout
from vllm.forward_context import get_forward_context

_REQUIRED = ("get_name", "get_impl_cls", "get_metadata_cls", "get_builder_cls",
             "get_kv_cache_shape")


class LegacyGeneration(enum.Enum):
    FUSED = "fused"
    """``forward()`` writes the cache from ``attn_metadata.slot_mapping``."""
    FLAGGED = "flagged"
    """``forward_includes_kv_cache_update = False`` plus ``do_kv_cache_update()``."""


class LegacyBackendRuntimeError(AttentionError, RuntimeError):
    """A legacy backend raised while running through the adapter."""


def is_legacy_backend(obj: object) -> TypeGuard[type]:
    """A class with the legacy classmethods that is not a new-style backend."""
    return (
        isinstance(obj, type)
        and not issubclass(obj, AttentionBackend)
        and all(callable(getattr(obj, m, None)) for m in _REQUIRED)
    )


def legacy_generation(cls: type) -> LegacyGeneration:
    """Which generation ``cls`` is; inconsistent declarations raise :class:`LegacyBackendError`."""
    name = cls.__qualname__
    flag = getattr(cls, "forward_includes_kv_cache_update", True)
    if not isinstance(flag, bool):
        raise LegacyBackendError(
            f"{name}.forward_includes_kv_cache_update: got {flag!r}, expected True or False"
        )
    impl_cls = cls.get_impl_cls()  # type: ignore[attr-defined]
    has_update = callable(getattr(impl_cls, "do_kv_cache_update", None))
    if not flag and not has_update:
        raise LegacyBackendError(
            f"{name} sets forward_includes_kv_cache_update = False but its impl "
            f"{impl_cls.__qualname__} has no do_kv_cache_update(layer, key, value, kv_cache, "
            "slot_mapping): the cache would never be written. Add the method, or remove the "
            "flag if forward() writes the cache."
        )
    if flag and has_update:
        raise LegacyBackendError(
            f"{name}'s impl {impl_cls.__qualname__} defines do_kv_cache_update() but "
            "forward_includes_kv_cache_update is True (or unset), so forward() is taken to "
            "write the cache too and the write would run twice. Set "
            "forward_includes_kv_cache_update = False if forward() does not write."
        )
    return LegacyGeneration.FUSED if flag else LegacyGeneration.FLAGGED


_PROBE = (7, 16, 3, 8)  # nb, bs, H, D: distinct values so the shape tells the layout


def infer_layout(cls: type) -> KVCacheLayout:
    """The cache layout a legacy backend's shape and stride order imply.

    A legacy class may declare ``kv_cache_layout`` (a :class:`KVCacheLayout`) instead.
    """
    declared = getattr(cls, "kv_cache_layout", None)
    if isinstance(declared, KVCacheLayout):
        return declared
    nb, bs, h, d = _PROBE
    shape = tuple(cls.get_kv_cache_shape(nb, bs, h, d))  # type: ignore[attr-defined]
    get_order = getattr(cls, "get_kv_cache_stride_order", None)
    order = tuple(get_order()) if callable(get_order) else tuple(range(len(shape)))
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], KVCacheLayout] = {
        ((nb, 2, bs, h, d), (0, 1, 2, 3, 4)): KVCacheLayout.SPLIT_NHD,
        ((nb, 2, bs, h, d), (0, 1, 3, 2, 4)): KVCacheLayout.SPLIT_HND,
        ((nb, 2, bs, h, d), (0, 2, 1, 3, 4)): KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
        ((2, nb, bs, h, d), (0, 1, 2, 3, 4)): KVCacheLayout.SPLIT_KV_FIRST,
        ((2, nb, bs * h * d), (0, 1, 2)): KVCacheLayout.LEGACY_PAGED,
    }
    layout = known.get((shape, order))
    if layout is None:
        raise LegacyBackendError(
            f"{cls.__qualname__}.get_kv_cache_shape{_PROBE} = {shape} with stride order "
            f"{order} is not a layout the adapter knows; declare kv_cache_layout = "
            f"KVCacheLayout.<one of {', '.join(m.name for m in KVCacheLayout)}>"
        )
    return layout


@dataclass(frozen=True)
class LegacyMetadataBox(AttentionMetadata):
    """New-style metadata holding a legacy backend's own metadata object."""

    legacy: Any


def _with_slot_mapping(legacy_meta: Any, slot_mapping: torch.Tensor) -> Any:
    """A copy of the legacy metadata with ``slot_mapping`` set where old code reads it."""
    if dataclasses.is_dataclass(legacy_meta) and not isinstance(legacy_meta, type):
        return dataclasses.replace(legacy_meta, slot_mapping=slot_mapping)
    clone = copy.copy(legacy_meta)
    clone.slot_mapping = slot_mapping
    return clone


class _DoKVCacheUpdateWriter:
    """Writer of a flagged legacy backend: its impl's ``do_kv_cache_update``."""

    def __init__(self, legacy_impl: Any, layer: AttentionLayerProtocol) -> None:
        self._impl = legacy_impl
        self._layer = layer

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant) -> None:
        n = slot_mapping.shape[0]
        try:
            self._impl.do_kv_cache_update(self._layer, key[:n], value[:n], kv_cache, slot_mapping)
        except AttentionError:
            raise
        except Exception as exc:
            raise LegacyBackendRuntimeError(
                f"legacy backend impl {type(self._impl).__qualname__}.do_kv_cache_update() "
                f"raised {type(exc).__name__}: {exc}"
            ) from exc


def _legacy_impl_kwargs(spec: AttentionLayerSpec) -> dict[str, Any]:
    return dict(
        num_heads=spec.num_heads, head_size=spec.head_size, scale=spec.scale,
        num_kv_heads=spec.num_kv_heads, alibi_slopes=None, sliding_window=spec.sliding_window,
        kv_cache_dtype=spec.kv_cache_dtype, logits_soft_cap=spec.logits_soft_cap,
        attn_type=spec.attn_type.value,
        kv_sharing_target_layer_name=spec.kv_sharing_target_layer_name,
    )


class AdaptedImplBase(AttentionImpl[LegacyMetadataBox]):
    """Runs a legacy impl's ``forward`` with the slot mapping copied in."""

    legacy_impl_cls: ClassVar[type]
    legacy_backend_name: ClassVar[str]

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(spec)
        self.legacy = self.legacy_impl_cls(**_legacy_impl_kwargs(spec))

    def forward(
        self,
        layer: AttentionLayerProtocol,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: LegacyMetadataBox,
        output: torch.Tensor,
    ) -> torch.Tensor:
        slots = get_forward_context().slot_mapping_for(layer.layer_name)
        legacy_meta = _with_slot_mapping(attn_metadata.legacy, slots)
        try:
            result: torch.Tensor = self.legacy.forward(
                layer, query, key, value, kv_cache, legacy_meta, output
            )
        except AttentionError:
            raise
        except Exception as exc:
            raise LegacyBackendRuntimeError(
                f"legacy backend {self.legacy_backend_name!r} raised in forward(): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return result


class FlaggedImplBase(AdaptedImplBase):
    """A flagged legacy impl also provides the layer's writer."""

    def kv_cache_writer(self, layer: AttentionLayerProtocol) -> KVCacheWriter:
        return _DoKVCacheUpdateWriter(self.legacy, layer)


class AdaptedBuilderBase(AttentionMetadataBuilder[LegacyMetadataBox]):
    legacy_builder_cls: ClassVar[type]

    def __init__(self, spec: AttentionLayerSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.legacy = self.legacy_builder_cls(device)

    def build(self, common: CommonAttentionMetadata) -> LegacyMetadataBox:
        placeholder = torch.full(
            (common.num_actual_tokens,), -1, dtype=torch.int64, device=common.seq_lens.device
        )
        legacy_common = LegacyCommonAttentionMetadata(
            **common_fields(common),
            slot_mapping=placeholder,
        )
        return LegacyMetadataBox(self.legacy.build(0, legacy_common))


class AdaptedBackendBase(AttentionBackend[LegacyMetadataBox]):
    """Base of every adapted class; ``legacy_cls`` is the wrapped legacy backend."""

    migration: ClassVar[Any] = "adapted"
    legacy_cls: ClassVar[type]
    legacy_generation: ClassVar[LegacyGeneration]
    impl_cls: ClassVar[type[AdaptedImplBase]]
    builder_cls: ClassVar[type[AdaptedBuilderBase]]

    @classmethod
    def get_impl_cls(cls) -> type[AdaptedImplBase]:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type[AdaptedBuilderBase]:
        return cls.builder_cls

    @classmethod
    def get_metadata_cls(cls) -> type[LegacyMetadataBox]:
        return LegacyMetadataBox

    @classmethod
    def get_kv_cache_writer(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheWriter:
        """The layout's standard writer. A flagged backend's layers use its bound
        ``do_kv_cache_update`` instead (see :class:`FlaggedImplBase`)."""
        return writer_for_layout(cls.kv_cache_layout)

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype: KVCacheDType = "auto") -> tuple[int, ...]:
        shape = cls.legacy_cls.get_kv_cache_shape(  # type: ignore[attr-defined]
            num_blocks, block_size, num_kv_heads, head_size
        )
        return tuple(int(s) for s in shape)


def _declared_caps(cls: type) -> dict[str, Any]:
    """Capability declarations read from a legacy class's optional methods."""
    caps: dict[str, Any] = {}
    if callable(getattr(cls, "get_supported_dtypes", None)):
        caps["supported_dtypes"] = frozenset(cls.get_supported_dtypes())  # type: ignore[attr-defined]
    if callable(getattr(cls, "get_supported_head_sizes", None)):
        caps["head_sizes"] = SizeSpec(values=frozenset(cls.get_supported_head_sizes()))  # type: ignore[attr-defined]
    else:
        caps["head_sizes"] = SizeSpec()
    if callable(getattr(cls, "get_supported_block_sizes", None)):
        caps["block_sizes"] = SizeSpec(values=frozenset(cls.get_supported_block_sizes()))  # type: ignore[attr-defined]
    else:
        caps["block_sizes"] = SizeSpec()
    dtypes = getattr(cls, "supported_kv_cache_dtypes", ("auto",))
    caps["supported_kv_cache_dtypes"] = frozenset(
        parse_kv_cache_dtype(d, argument=f"{cls.__qualname__}.supported_kv_cache_dtypes")
        for d in dtypes
    )
    return caps


_adapted: weakref.WeakKeyDictionary[type, type[AdaptedBackendBase]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()

_ADVICE = {
    LegacyGeneration.FUSED: (
        "its forward() writes the KV cache from attn_metadata.slot_mapping",
        "subclass vllm.attention.AttentionBackend, return a KVCacheWriter from "
        "get_kv_cache_writer(), delete the write from forward() and slot_mapping from the "
        "metadata",
    ),
    LegacyGeneration.FLAGGED: (
        "it writes through do_kv_cache_update() behind forward_includes_kv_cache_update = False",
        "subclass vllm.attention.AttentionBackend, move do_kv_cache_update() into a "
        "KVCacheWriter returned by get_kv_cache_writer(), and drop the flag",
    ),
}


def adapt_legacy_backend(cls: type) -> type[AttentionBackend[Any]]:
    """The new-style backend that runs legacy ``cls`` unchanged.

    Warns once per legacy class per process (:class:`shim.LegacyBackendWarning`).
    Raises :class:`~vllm.attention.LegacyBackendError` for a class that is not a
    legacy backend or declares the write inconsistently. A new-style backend is
    returned as it is.
    """
    candidate: object = cls
    if not isinstance(candidate, type):
        raise LegacyBackendError(
            f"adapt_legacy_backend: got {candidate!r}, expected a legacy backend class"
        )
    if issubclass(cls, AttentionBackend):
        return cls
    if not is_legacy_backend(cls):
        missing = [m for m in _REQUIRED if not callable(getattr(cls, m, None))]
        raise LegacyBackendError(
            f"adapt_legacy_backend: {cls!r} is not a legacy attention backend class "
            f"(missing {', '.join(missing)})"
        )
    with _lock:
        adapted = _adapted.get(cls)
    if adapted is None:
        adapted = _build_adapted(cls)
        with _lock:
            adapted = _adapted.setdefault(cls, adapted)
    what, change = _ADVICE[adapted.legacy_generation]
    warn_once(
        f"{cls.__module__}.{cls.__qualname__}",
        f"attention backend {adapted.name!r} ({cls.__module__}.{cls.__qualname__}) is a legacy "
        f"{adapted.legacy_generation.value} backend: {what}. It runs through the compatibility "
        f"adapter (shim). To migrate, {change}. See migration_guide.md.",
    )
    return adapted


def _build_adapted(cls: type) -> type[AdaptedBackendBase]:
    generation = legacy_generation(cls)
    layout = infer_layout(cls)
    backend_name = str(cls.get_name())  # type: ignore[attr-defined]
    impl_base = FlaggedImplBase if generation is LegacyGeneration.FLAGGED else AdaptedImplBase
    impl_cls = type(f"Adapted{cls.__name__}Impl", (impl_base,), {
        "legacy_impl_cls": cls.get_impl_cls(),  # type: ignore[attr-defined]
        "legacy_backend_name": backend_name,
    })
    builder_cls = type(f"Adapted{cls.__name__}Builder", (AdaptedBuilderBase,), {
        "legacy_builder_cls": cls.get_builder_cls(),  # type: ignore[attr-defined]
    })
    namespace: dict[str, Any] = {
        "name": backend_name,
        "kv_cache_layout": layout,
        "legacy_cls": cls,
        "legacy_generation": generation,
        "impl_cls": impl_cls,
        "builder_cls": builder_cls,
        "__module__": cls.__module__,
        "__doc__": f"Adapted legacy backend {cls.__qualname__} ({generation.value}).",
        **_declared_caps(cls),
    }
    if callable(getattr(cls, "get_kv_cache_stride_order", None)):
        order = tuple(cls.get_kv_cache_stride_order())  # type: ignore[attr-defined]
        namespace["get_kv_cache_stride_order"] = classmethod(lambda _c: order)
    return type(f"Adapted{cls.__name__}", (AdaptedBackendBase,), namespace)
