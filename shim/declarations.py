"""What a legacy backend class declares, read as upstream reads it.

Which generation it is, the cache layout its shape implies, and its capabilities
(dtypes, head and block sizes, cache dtypes, attention types) from upstream's
``supports_*`` predicates or the older ``get_supported_*`` methods. The adapter
(:mod:`shim.adapter`) turns these into a new-style backend's class data.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import TypeGuard

from shim.upstream.backend import AttentionBackend as UpstreamBackend
from shim.upstream.backend import MLAAttentionImpl  # type: ignore[deprecated]
from vllm.attention.backend import AttentionBackend, SizeSpec, exactly
from vllm.attention.errors import LegacyBackendError
from vllm.attention.types import (
    KV_CACHE_DTYPES,
    UNQUANTISED_SPELLINGS,
    AttentionType,
    KVCacheDType,
    KVCacheLayout,
)
from vllm.attention.writers import writer_for_layout

REQUIRED = ("get_name", "get_impl_cls", "get_builder_cls", "get_kv_cache_shape")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LegacyGeneration(enum.Enum):
    FUSED = "fused"
    """``forward()`` writes the cache from ``attn_metadata.slot_mapping``."""
    FLAGGED = "flagged"
    """``forward_includes_kv_cache_update = False`` plus ``do_kv_cache_update()``."""


def is_legacy_backend(obj: object) -> TypeGuard[type]:
    """A class of the legacy surface (a subclass of its ``AttentionBackend``), or one with
    the legacy classmethods, that is not a new-style backend."""
    if not isinstance(obj, type) or issubclass(obj, AttentionBackend):
        return False
    return issubclass(obj, UpstreamBackend) or all(
        callable(getattr(obj, m, None)) for m in REQUIRED)


def refuse_mla(cls: type) -> None:
    is_mla = getattr(cls, "is_mla", None)
    impl_cls = cls.get_impl_cls()  # type: ignore[attr-defined]
    if (callable(is_mla) and is_mla() is True) or (
            isinstance(impl_cls, type) and issubclass(impl_cls, MLAAttentionImpl)):
        raise LegacyBackendError(
            f"{cls.__qualname__} is a legacy MLA backend (forward_mha / forward_mqa): the "
            "adapter runs standard attention backends only. Migrate it onto "
            "vllm.attention's MLA bases (see docs/mla.md and migration_guide.md).")


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


def stride_order(cls: type) -> tuple[int, ...] | None:
    """The legacy stride order, or None where the class leaves it to the default."""
    get_order = getattr(cls, "get_kv_cache_stride_order", None)
    if not callable(get_order):
        return None
    try:
        return tuple(int(i) for i in get_order())
    except NotImplementedError:  # upstream's default: the physical order is the logical one
        return None


def infer_layout(cls: type) -> KVCacheLayout:
    """The cache layout a legacy backend's shape and stride order imply.

    A legacy class may declare ``kv_cache_layout`` (a :class:`KVCacheLayout`) instead.
    """
    declared = getattr(cls, "kv_cache_layout", None)
    if isinstance(declared, KVCacheLayout):
        return declared
    nb, bs, h, d = _PROBE
    shape = tuple(cls.get_kv_cache_shape(nb, bs, h, d))  # type: ignore[attr-defined]
    order = stride_order(cls) or tuple(range(len(shape)))
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


# -- capabilities, read as upstream reads them -----------------------------------------


def _probe_sizes(admits: Callable[[int], bool], limit: int) -> SizeSpec:
    """A SizeSpec of the sizes in ``1..limit`` a legacy predicate admits: ``multiple_of``
    when they are all multiples of their smallest in a range (open-ended if the range
    reaches ``limit``), else the exact set."""
    sizes = [n for n in range(1, limit + 1) if admits(n)]
    if not sizes:
        return exactly(*())
    low, high = sizes[0], sizes[-1]
    step = math.gcd(*sizes)
    if sizes == list(range(low, high + 1, step)) and low % step == 0 and len(sizes) > 2:
        return SizeSpec(multiple_of=step, min=low, max=None if high == limit else high)
    return exactly(*sizes)


def _call(cls: type, name: str, *args: object) -> Any:
    method = getattr(cls, name, None)
    return method(*args) if callable(method) else None


def head_sizes_of(cls: type) -> SizeSpec:
    if callable(getattr(cls, "supports_head_size", None)):
        return _probe_sizes(lambda n: bool(cls.supports_head_size(n)), 512)  # type: ignore[attr-defined]
    sizes = _call(cls, "get_supported_head_sizes") or []
    return exactly(*sizes) if sizes else SizeSpec()


def _shape_accepts(cls: type, block_size: int) -> bool:
    """Upstream's shapes refuse block sizes their kernels cannot page (``ValueError``)."""
    try:
        cls.get_kv_cache_shape(7, block_size, 3, 8)  # type: ignore[attr-defined]
    except ValueError:
        return False
    return True


def block_sizes_of(cls: type) -> SizeSpec:
    declared = getattr(cls, "supports_block_size", None)
    if callable(declared):
        return _probe_sizes(lambda n: bool(declared(n)) and _shape_accepts(cls, n), 1024)
    sizes = _call(cls, "get_supported_block_sizes") or []
    if sizes:
        return exactly(*sizes)
    return _probe_sizes(lambda n: _shape_accepts(cls, n), 1024)


def dtypes_of(cls: type) -> frozenset[torch.dtype]:
    if callable(getattr(cls, "supports_dtype", None)):
        return frozenset(d for d in _FLOAT_DTYPES if cls.supports_dtype(d))  # type: ignore[attr-defined]
    listed = _call(cls, "get_supported_dtypes")
    if listed is None:
        listed = getattr(cls, "supported_dtypes", _FLOAT_DTYPES)
    return frozenset(listed)


_SPELLINGS = KV_CACHE_DTYPES + tuple(UNQUANTISED_SPELLINGS)


def cache_dtypes_of(cls: type, layout: KVCacheLayout) -> dict[KVCacheDType, str]:
    """The cache formats the legacy backend declares and the adapter can write, each
    with the spelling the legacy code itself uses for it (passed to its impl)."""
    if callable(getattr(cls, "supports_kv_cache_dtype", None)):
        spelled = [s for s in _SPELLINGS if cls.supports_kv_cache_dtype(s)]  # type: ignore[attr-defined]
    else:
        listed = _call(cls, "get_supported_kv_cache_dtypes")
        spelled = list(listed if listed is not None
                       else getattr(cls, "supported_kv_cache_dtypes", ("auto",)))
    writable = set(getattr(writer_for_layout(layout), "cache_dtypes", ("auto",)))
    found: dict[KVCacheDType, str] = {}
    for spelling in spelled:
        fmt = next((d for d in KV_CACHE_DTYPES if d == spelling), None)
        if spelling in UNQUANTISED_SPELLINGS or fmt == "auto":
            found.setdefault("auto", "auto" if fmt == "auto" else str(spelling))
        elif fmt is not None and fmt in writable:
            found[fmt] = fmt
    found.setdefault("auto", "auto")
    return found


def attention_types_of(cls: type) -> frozenset[AttentionType]:
    """What ``supports_attn_type`` admits, less ``ENCODER``: upstream's encoder attention
    reads this step's K/V and has no cache (``ENCODER_ONLY`` here), while this package's
    ``ENCODER`` attends over the paged cache, which no upstream impl writes for it."""
    if callable(getattr(cls, "supports_attn_type", None)):
        admits: Callable[[AttentionType], bool] = cls.supports_attn_type  # type: ignore[attr-defined]
        return frozenset(t for t in AttentionType
                         if t is not AttentionType.ENCODER and admits(t))
    return frozenset({AttentionType.DECODER})
