"""Wrap a legacy backend into a new-style :class:`~vllm.attention.AttentionBackend`.

Two legacy generations (``docs/architecture.md``, ``migration_guide.md``):

* **fused**: ``impl.forward()`` writes the cache itself from ``attn_metadata.slot_mapping``.
  The adapted writer writes the same slots first (through the standard writer of
  the layout the legacy shape implies); the legacy forward then rewrites identical
  bytes, so the cache and the output are bit-identical to running it directly.
* **flagged**: ``forward_includes_kv_cache_update = False`` plus
  ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``, which
  becomes the adapted writer.

A legacy backend is called with upstream's conventions (``shim.upstream``): the impl
is built with upstream's positional arguments, the builder as ``(kv_cache_spec,
layer_names, vllm_config, device)`` and called as ``build(common_prefix_len,
common_attn_metadata)``, the impl's ``forward`` and ``do_kv_cache_update`` get the
legacy view of the layer (``layer._k_scale``, ``layer._k_scale_float``, ...), and the
layer's slot mapping is copied from the ForwardContext into the legacy metadata right
before the legacy ``forward`` runs. This package's earlier legacy examples (a builder
taking only ``device``) keep working.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from shim.declarations import (
    REQUIRED,
    LegacyGeneration,
    attention_types_of,
    block_sizes_of,
    cache_dtypes_of,
    dtypes_of,
    head_sizes_of,
    infer_layout,
    is_legacy_backend,
    legacy_generation,
    refuse_mla,
    stride_order,
)
from shim.upstream.backend import CommonAttentionMetadata as LegacyCommon
from shim.upstream.config import (
    CacheConfig,
    CompilationConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from shim.upstream.kv_cache_interface import FullAttentionSpec
from shim.upstream.layer import Attention as LegacyLayer
from shim.upstream.platform import DeviceCapability
from shim.warnings import Location, caller_location, warn_once
from vllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerProtocol,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.attention.errors import (
    AttentionError,
    LegacyBackendError,
    UnsupportedBackendError,
)
from vllm.attention.types import (
    AttentionType,
    KVCacheDType,
    KVQuant,
)
from vllm.attention.writer import KVCacheWriter
from vllm.attention.writers import writer_for_layout
from vllm.forward_context import get_forward_context


class LegacyBackendRuntimeError(AttentionError, RuntimeError):
    """A legacy backend raised while running through the adapter."""


# -- the legacy view of each layer, and the configuration legacy code reads ---------------


@contextlib.contextmanager
def _legacy_code(raised: str) -> Iterator[None]:
    """Around a call into legacy code: this package's errors pass through; any other
    becomes a :class:`LegacyBackendRuntimeError` ``"<raised> <type>: <message>"`` with the
    original as ``__cause__``."""
    try:
        yield
    except AttentionError:
        raise
    except Exception as exc:
        raise LegacyBackendRuntimeError(f"{raised} {type(exc).__name__}: {exc}") from exc


class _LiveLayers(Mapping[str, LegacyLayer]):
    """Every adapted layer alive, by name (``static_forward_context`` of the config)."""

    def __init__(self) -> None:
        self._layers: weakref.WeakValueDictionary[str, LegacyLayer] = (
            weakref.WeakValueDictionary())

    def add(self, view: LegacyLayer) -> None:
        self._layers[view.layer_name] = view

    def __getitem__(self, name: str) -> LegacyLayer:
        return self._layers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._layers))

    def __len__(self) -> int:
        return len(self._layers)


LIVE_LAYERS = _LiveLayers()


def _same_group(view: LegacyLayer, spec: AttentionLayerSpec) -> bool:
    s = view.layer.spec
    return (s.num_heads, s.num_kv_heads, s.head_size, s.v_head_size, s.kv_cache_dtype,
            s.sliding_window) == (spec.num_heads, spec.num_kv_heads, spec.head_size,
                                  spec.v_head_size, spec.kv_cache_dtype, spec.sliding_window)


def _vllm_config(spec: AttentionLayerSpec, spelling: str, *, block_size: int,
                 dtype: torch.dtype) -> VllmConfig:
    """What upstream's config would say of this layer group."""
    model = ModelConfig(dtype=dtype, num_attention_heads=spec.num_heads,
                        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, cache_dtype=spelling),  # type: ignore[arg-type]
        compilation_config=CompilationConfig(static_forward_context=LIVE_LAYERS),
    )


def _group_cache_dtype(spec: AttentionLayerSpec) -> torch.dtype:
    """The storage dtype of a bound cache of this group, else the default float dtype
    (a builder built before any cache is bound)."""
    for view in list(LIVE_LAYERS.values()):
        cache = view.layer.kv_cache
        if _same_group(view, spec) and cache.numel():
            return cache.dtype
    return torch.get_default_dtype()


@dataclass
class LegacyMetadataBox(AttentionMetadata):
    """New-style metadata holding a legacy backend's own metadata object (one step)."""

    legacy: Any
    _with_slots: tuple[torch.Tensor, Any] | None = dataclasses.field(default=None, repr=False)

    def with_slot_mapping(self, slot_mapping: torch.Tensor) -> Any:
        """The legacy metadata with ``slot_mapping`` where old code reads it; one copy per
        step, shared by the layers of the group (they share the slot tensor)."""
        held = self._with_slots
        if held is not None and held[0] is slot_mapping:
            return held[1]
        meta = self.legacy
        if hasattr(meta, "slot_mapping"):
            if dataclasses.is_dataclass(meta) and not isinstance(meta, type):
                meta = dataclasses.replace(meta, slot_mapping=slot_mapping)
            else:
                meta = copy.copy(meta)
                meta.slot_mapping = slot_mapping
        self._with_slots = (slot_mapping, meta)
        return meta


class _DoKVCacheUpdateWriter:
    """Writer of a flagged legacy backend: its impl's ``do_kv_cache_update``."""

    def __init__(self, legacy_impl: Any, view: LegacyLayer) -> None:
        self._impl = legacy_impl
        self._view = view

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant) -> None:
        n = slot_mapping.shape[0]
        with _legacy_code(f"legacy backend impl {type(self._impl).__qualname__}"
                          ".do_kv_cache_update() raised"):
            self._impl.do_kv_cache_update(self._view, key[:n], value[:n], kv_cache, slot_mapping)


_IMPL_PARAMS = ("num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes",
                "sliding_window", "kv_cache_dtype", "logits_soft_cap", "attn_type",
                "kv_sharing_target_layer_name")


def build_legacy_impl(impl_cls: type, spec: AttentionLayerSpec, spelling: str) -> Any:
    """The legacy impl, built as upstream's layer builds it: positional arguments in
    upstream's order; an impl that takes them only by keyword gets keywords."""
    args = (spec.num_heads, spec.head_size, spec.scale, spec.num_kv_heads, None,
            spec.sliding_window, spelling, spec.logits_soft_cap, spec.attn_type,
            spec.kv_sharing_target_layer_name)
    try:
        inspect.signature(impl_cls).bind(*args)
    except TypeError:
        return impl_cls(**dict(zip(_IMPL_PARAMS, args)))
    except ValueError:  # no signature to read: call it as upstream does
        pass
    return impl_cls(*args)


class AdaptedImplBase(AttentionImpl[LegacyMetadataBox]):
    """Runs a legacy impl's ``forward`` with the slot mapping copied in."""

    legacy_impl_cls: ClassVar[type]
    legacy_backend: ClassVar[type[AdaptedBackendBase]]

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(spec)
        backend = self.legacy_backend
        backend.warn_first_use()
        spelling = backend.legacy_spelling(spec.kv_cache_dtype)
        self.spelling = spelling
        config = _vllm_config(spec, spelling, block_size=16, dtype=torch.get_default_dtype())
        with _legacy_code(f"legacy backend {backend.name!r} raised building its impl:"):
            try:
                with set_current_vllm_config(config):
                    self.legacy = build_legacy_impl(self.legacy_impl_cls, spec, spelling)
            except NotImplementedError as exc:
                raise UnsupportedBackendError(
                    f"{backend.name} cannot run this layer: its impl raised "
                    f"NotImplementedError: {exc}") from exc
        self._view: LegacyLayer | None = None
        self._weights_processed = False

    def view_of(self, layer: AttentionLayerProtocol) -> LegacyLayer:
        """The legacy view of ``layer`` handed to the legacy impl (one per layer)."""
        view = self._view
        if view is None or view.layer is not layer:
            view = LegacyLayer.view(layer, self.legacy,  # type: ignore[arg-type]
                                    self.legacy_backend.legacy_cls, self.spelling)
            self._view = view
            LIVE_LAYERS.add(view)
        return view

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
        view = self.view_of(layer)
        if not self._weights_processed:  # upstream calls it once, after loading weights
            self._weights_processed = True
            process = getattr(self.legacy, "process_weights_after_loading", None)
            if callable(process):
                process(query.dtype)
        ctx = get_forward_context()
        writes = (self.spec.kv_sharing_target_layer_name is None
                  and self.spec.attn_type is not AttentionType.ENCODER_ONLY)
        if not writes and layer.layer_name not in ctx.slot_mapping:
            # a layer that writes nothing (KV sharing, encoder-only) needs no slot mapping;
            # the legacy metadata keeps the builder's -1 pad slots
            legacy_meta = attn_metadata.legacy
        else:
            legacy_meta = attn_metadata.with_slot_mapping(ctx.slot_mapping_for(layer.layer_name))
        with _legacy_code(f"legacy backend {self.legacy_backend.name!r} raised in forward():"):
            if self.legacy_backend.accept_output_buffer:
                result = self.legacy.forward(view, query, key, value, kv_cache, legacy_meta,
                                             output)
            else:
                result = self.legacy.forward(view, query, key, value, kv_cache, legacy_meta)
        if result is not output and not _into_buffer(result, output):
            self._copy_result(result, output)
        return output

    def _copy_result(self, result: object, output: torch.Tensor) -> None:
        """A legacy forward that returns a new tensor (``[T, H * D]`` or ``[T, H, D]``)."""
        if not isinstance(result, torch.Tensor) or result.numel() != output.numel():
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
            raise LegacyBackendRuntimeError(
                f"legacy backend {self.legacy_backend.name!r}: forward() returned {got}, "
                f"expected {output.numel()} values ({tuple(output.shape)}, or flattened)")
        output.copy_(result.reshape(output.shape))


def _into_buffer(result: object, output: torch.Tensor) -> bool:
    """A result that is a view of ``output`` (upstream's impls may return
    ``output[:num_actual_tokens]``): upstream's layer reads the buffer, not the result."""
    return (isinstance(result, torch.Tensor)
            and result.untyped_storage().data_ptr() == output.untyped_storage().data_ptr())


class FlaggedImplBase(AdaptedImplBase):
    """A flagged legacy impl also provides the layer's writer."""

    def kv_cache_writer(self, layer: AttentionLayerProtocol) -> KVCacheWriter:
        return _DoKVCacheUpdateWriter(self.legacy, self.view_of(layer))


def _takes_upstream_args(builder_cls: type) -> bool:
    """True for a builder built as ``(kv_cache_spec, layer_names, vllm_config, device)``;
    False for this package's earlier examples, built as ``(device)``."""
    try:
        params = list(inspect.signature(builder_cls).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.kind is p.VAR_POSITIONAL for p in params)


class AdaptedBuilderBase(AttentionMetadataBuilder[LegacyMetadataBox]):
    """Builds the legacy builder on its first ``build`` (when the batch gives the block
    size) and calls it with upstream's arguments."""

    legacy_builder_cls: ClassVar[type]
    legacy_backend: ClassVar[type[AdaptedBackendBase]]

    def __init__(self, spec: AttentionLayerSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self._legacy: tuple[int, Any, VllmConfig] | None = None

    def _legacy_builder(self, block_size: int) -> tuple[Any, VllmConfig]:
        held = self._legacy
        if held is not None and held[0] == block_size:
            return held[1], held[2]
        spec = self.spec
        spelling = self.legacy_backend.legacy_spelling(spec.kv_cache_dtype)
        cache_dtype = _group_cache_dtype(spec)
        model_dtype = cache_dtype if cache_dtype.is_floating_point and \
            cache_dtype.itemsize > 1 else torch.get_default_dtype()
        config = _vllm_config(spec, spelling, block_size=block_size, dtype=model_dtype)
        names = [n for n, v in list(LIVE_LAYERS.items()) if _same_group(v, spec)]
        with (_legacy_code(f"legacy backend {self.legacy_backend.name!r} raised building its "
                           "metadata builder:"), set_current_vllm_config(config)):
            if _takes_upstream_args(self.legacy_builder_cls):
                kv_spec = FullAttentionSpec(
                    block_size=block_size, num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size, head_size_v=spec.v_head_size,
                    dtype=cache_dtype, sliding_window=spec.sliding_window)
                builder = self.legacy_builder_cls(kv_spec, names, config, self.device)
            else:
                builder = self.legacy_builder_cls(self.device)
        self._legacy = (block_size, builder, config)
        return builder, config

    def build(self, common: CommonAttentionMetadata) -> LegacyMetadataBox:
        builder, config = self._legacy_builder(common.block_size)
        legacy_common = LegacyCommon.from_new(common)
        with (_legacy_code(f"legacy backend {self.legacy_backend.name!r} raised in build():"),
              set_current_vllm_config(config)):
            meta = builder.build(0, legacy_common)
        return LegacyMetadataBox(meta)


def _probe_impl(backend: type[AdaptedBackendBase], head_size: int, spelling: str,
                sliding_window: int | None, logits_soft_cap: float | None,
                attn_type: AttentionType) -> str | None:
    """Why the legacy impl refuses to be built for this configuration (None: it builds).

    Upstream's impls refuse features in ``__init__`` with ``NotImplementedError`` (and
    head sizes with ``ValueError``); that refusal is the declaration.
    """
    spec = AttentionLayerSpec(num_heads=8, head_size=head_size, num_kv_heads=2,
                              scale=head_size ** -0.5, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, attn_type=attn_type)
    config = _vllm_config(spec, spelling, block_size=16, dtype=torch.get_default_dtype())
    try:
        with set_current_vllm_config(config):
            build_legacy_impl(backend.legacy_cls.get_impl_cls(), spec, spelling)  # type: ignore[attr-defined]
    except (NotImplementedError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # any other failure to build is a refusal too, named as such
        return f"raised {type(exc).__name__}: {exc}"
    return None


class AdaptedBackendBase(AttentionBackend[LegacyMetadataBox]):
    """Base of every adapted class; ``legacy_cls`` is the wrapped legacy backend."""

    migration: ClassVar[Any] = "adapted"
    legacy_cls: ClassVar[type]
    legacy_generation: ClassVar[LegacyGeneration]
    legacy_spellings: ClassVar[Mapping[KVCacheDType, str]]
    accept_output_buffer: ClassVar[bool]
    impl_cls: ClassVar[type[AdaptedImplBase]]
    builder_cls: ClassVar[type[AdaptedBuilderBase]]
    registered_at: ClassVar[Location | None] = None
    """Where the backend was registered (the first-use warning points there)."""

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

    @classmethod
    def legacy_spelling(cls, cache_dtype: KVCacheDType) -> str:
        """The cache dtype as the legacy code spells it (what its impl is given)."""
        return cls.legacy_spellings.get(cache_dtype, cache_dtype)

    @classmethod
    def warn_first_use(cls) -> None:
        """The one :class:`shim.LegacyBackendWarning` of this legacy class, pointing at its
        registration (or its definition when it came from an entry point)."""
        _warn(cls, cls.registered_at or _definition_site(cls.legacy_cls))

    @classmethod
    def unsupported_reasons(
        cls,
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
        device: torch.device | None = None,
    ) -> list[str]:
        """The declared reasons, then what the legacy class itself refuses: its
        ``supports_combination`` and its impl's ``__init__``."""
        reasons = super().unsupported_reasons(
            dtype=dtype, head_size=head_size, block_size=block_size,
            kv_cache_dtype=kv_cache_dtype, attn_type=attn_type, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, use_mla=use_mla, use_sparse=use_sparse,
            device=device)
        if reasons:
            return reasons
        legacy = cls.legacy_cls
        spelling = cls.legacy_spellings.get(kv_cache_dtype, kv_cache_dtype)  # type: ignore[call-overload]
        combination = getattr(legacy, "supports_combination", None)
        if callable(combination) and device is not None and device.type == "cuda":
            why = combination(head_size, dtype, spelling, block_size, False, False, False,
                              _capability(device))
            if why:
                reasons.append(f"{cls.name}: {why}")
        refusal = _cached_probe(cls, head_size, spelling, sliding_window, logits_soft_cap,
                                attn_type)
        if refusal is not None:
            reasons.append(f"{cls.name}'s impl refuses head_size={head_size}, "
                           f"kv_cache_dtype={spelling!r}, sliding_window={sliding_window}, "
                           f"logits_soft_cap={logits_soft_cap}, attn_type={attn_type.value}: "
                           f"{refusal}")
        return reasons

    @classmethod
    def device_unsupported_reasons(cls, device: torch.device) -> list[str]:
        supports = getattr(cls.legacy_cls, "supports_compute_capability", None)
        if device.type == "cuda" and callable(supports):
            cap = _capability(device)
            if not supports(cap):
                return [f"{cls.name} refuses compute capability {cap.as_version_str()} "
                        "(supports_compute_capability)"]
        return []


def _capability(device: torch.device) -> DeviceCapability:
    major, minor = torch.cuda.get_device_capability(device)
    return DeviceCapability(major, minor)


@functools.lru_cache(maxsize=512)
def _cached_probe(backend: type[AdaptedBackendBase], head_size: int, spelling: str,
                  sliding_window: int | None, logits_soft_cap: float | None,
                  attn_type: AttentionType) -> str | None:
    return _probe_impl(backend, head_size, spelling, sliding_window, logits_soft_cap,
                       attn_type)


def _definition_site(cls: type) -> Location | None:
    try:
        filename = inspect.getsourcefile(cls)
        _, lineno = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return None
    return (filename, lineno) if filename else None


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


def _warn(adapted: type[AdaptedBackendBase], at: Location | None) -> None:
    """The one :class:`shim.LegacyBackendWarning` of ``adapted``'s legacy class."""
    legacy = adapted.legacy_cls
    where = f"{legacy.__module__}.{legacy.__qualname__}"
    what, change = _ADVICE[adapted.legacy_generation]
    warn_once(where, f"attention backend {adapted.name!r} ({where}) is a legacy "
              f"{adapted.legacy_generation.value} backend: {what}. It runs through the "
              f"compatibility adapter (shim). To migrate, {change}. See migration_guide.md.",
              at=at)


def adapt_quietly(cls: type, *, name: str | None = None,
                  registered_at: Location | None = None) -> type[AdaptedBackendBase]:
    """The adapted class of legacy ``cls`` without warning now: it warns when first used,
    pointing at ``registered_at`` (or the class definition). ``name`` renames it."""
    candidate: object = cls
    if not isinstance(candidate, type):
        raise LegacyBackendError(
            f"adapt_legacy_backend: got {candidate!r}, expected a legacy backend class"
        )
    if not is_legacy_backend(cls):
        missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
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
    if registered_at is not None and adapted.registered_at is None:
        adapted.registered_at = registered_at
    if name is not None and name != adapted.name:
        renamed: type[AdaptedBackendBase] = type(adapted.__name__, (adapted,), {
            "name": name, "__module__": adapted.__module__, "__doc__": adapted.__doc__})
        return renamed
    return adapted


def adapt_legacy_backend(cls: type) -> type[AttentionBackend[Any]]:
    """The new-style backend that runs legacy ``cls`` unchanged.

    Warns once per legacy class per process (:class:`shim.LegacyBackendWarning`),
    pointing at the caller. Raises :class:`~vllm.attention.LegacyBackendError` for a
    class that is not a legacy backend or declares the write inconsistently. A
    new-style backend is returned as it is.
    """
    candidate: object = cls
    if isinstance(candidate, type) and issubclass(candidate, AttentionBackend):
        return candidate
    adapted = adapt_quietly(cls)
    _warn(adapted, caller_location())
    return adapted


def _build_adapted(cls: type) -> type[AdaptedBackendBase]:
    refuse_mla(cls)
    generation = legacy_generation(cls)
    layout = infer_layout(cls)
    backend_name = str(cls.get_name())  # type: ignore[attr-defined]
    spellings = cache_dtypes_of(cls, layout)
    impl_base = FlaggedImplBase if generation is LegacyGeneration.FLAGGED else AdaptedImplBase
    namespace: dict[str, Any] = {
        "name": backend_name,
        "kv_cache_layout": layout,
        "legacy_cls": cls,
        "legacy_generation": generation,
        "legacy_spellings": dict(spellings),
        "accept_output_buffer": bool(getattr(cls, "accept_output_buffer", True)),
        "supported_dtypes": dtypes_of(cls),
        "supported_kv_cache_dtypes": frozenset(spellings),
        "head_sizes": head_sizes_of(cls),
        "block_sizes": block_sizes_of(cls),
        "attention_types": attention_types_of(cls),
        "__module__": cls.__module__,
        "__doc__": f"Adapted legacy backend {cls.__qualname__} ({generation.value}).",
    }
    order = stride_order(cls)
    if order is not None:
        namespace["get_kv_cache_stride_order"] = classmethod(lambda _c: order)
    adapted: type[AdaptedBackendBase] = type(f"Adapted{cls.__name__}", (AdaptedBackendBase,),
                                             namespace)
    adapted.impl_cls = type(f"Adapted{cls.__name__}Impl", (impl_base,), {
        "legacy_impl_cls": cls.get_impl_cls(),  # type: ignore[attr-defined]
        "legacy_backend": adapted,
    })
    adapted.builder_cls = type(f"Adapted{cls.__name__}Builder", (AdaptedBuilderBase,), {
        "legacy_builder_cls": cls.get_builder_cls(),  # type: ignore[attr-defined]
        "legacy_backend": adapted,
    })
    head = next(iter(adapted.head_sizes.examples((64, 128, 32, 16, 96, 256, 8))), 64)
    decoder = AttentionType.DECODER
    adapted.supports_sliding_window = _cached_probe(adapted, head, "auto", 21, None,
                                                    decoder) is None
    adapted.supports_logits_soft_cap = _cached_probe(adapted, head, "auto", None, 7.5,
                                                     decoder) is None
    return adapted
