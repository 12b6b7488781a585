"""The cache layout a legacy backend's ``get_kv_cache_shape`` and stride order imply.

The same table as the adapter's (``shim.adapter.infer_layout``), read from the source:
the methods are evaluated for distinct probe sizes, so the shape names the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import libcst as cst

from vllm.attention.types import KVCacheLayout
from vllm.migrate.analysis import ClassInfo, ModuleInfo
from vllm.migrate.literal import Evaluator, Raised
from vllm.migrate.report import MigrationError

PROBE: Final = (7, 16, 3, 8)
"""num_blocks, block_size, num_kv_heads, head_size: distinct, so the shape tells the layout."""


def _known() -> dict[tuple[tuple[int, ...], tuple[int, ...]], KVCacheLayout]:
    nb, bs, h, d = PROBE
    return {
        ((nb, 2, bs, h, d), (0, 1, 2, 3, 4)): KVCacheLayout.SPLIT_NHD,
        ((nb, 2, bs, h, d), (0, 1, 3, 2, 4)): KVCacheLayout.SPLIT_HND,
        ((nb, 2, bs, h, d), (0, 2, 1, 3, 4)): KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
        ((2, nb, bs, h, d), (0, 1, 2, 3, 4)): KVCacheLayout.SPLIT_KV_FIRST,
        ((2, nb, bs * h * d), (0, 1, 2)): KVCacheLayout.LEGACY_PAGED,
    }


SPLIT_FAMILY: Final = frozenset({KVCacheLayout.SPLIT_NHD, KVCacheLayout.SPLIT_HND,
                                 KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
                                 KVCacheLayout.SPLIT_KV_FIRST})


@dataclass(frozen=True)
class LayoutFinding:
    layout: KVCacheLayout
    note: str | None = None
    """Set when the legacy stride order depends on ``get_kv_cache_layout()``."""


def _shape(info: ModuleInfo, backend: ClassInfo) -> tuple[int, ...]:
    fn = info.methods_of(backend)["get_kv_cache_shape"]
    value = Evaluator(info, backend.attrs).call(fn, *PROBE)
    if isinstance(value, Raised):
        raise MigrationError(
            f"{info.path}: {backend.name}.get_kv_cache_shape{PROBE} raises {value.exception}; "
            "cannot tell the cache layout from it: declare kv_cache_layout = "
            "KVCacheLayout.<member> on the legacy class and run the command again")
    if not (isinstance(value, tuple) and all(isinstance(v, int) for v in value)):
        raise MigrationError(
            f"{info.path}: {backend.name}.get_kv_cache_shape() does not return a literal tuple "
            "of its arguments, so the command cannot tell the cache layout: declare "
            "kv_cache_layout = KVCacheLayout.<member> on the legacy class (the adapter reads "
            "it too) and run the command again")
    return value


def _order(info: ModuleInfo, backend: ClassInfo, ndim: int,
           kv_cache_layout: str) -> tuple[int, ...] | None:
    fn = info.methods_of(backend).get("get_kv_cache_stride_order")
    if fn is None:
        return tuple(range(ndim))
    value = Evaluator(info, backend.attrs, kv_cache_layout=kv_cache_layout).call(fn)
    if isinstance(value, Raised) and value.exception == "NotImplementedError":
        return tuple(range(ndim))  # upstream's default: the physical order is the logical one
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return value
    return None


def _declared(info: ModuleInfo, backend: ClassInfo) -> KVCacheLayout | None:
    for cls in info.local_mro(backend):
        value = cls.attrs.get("kv_cache_layout")
        if isinstance(value, cst.Attribute):
            member = KVCacheLayout.__members__.get(value.attr.value)
            if member is not None:
                return member
    return None


def infer_layout(info: ModuleInfo, backend: ClassInfo) -> LayoutFinding:
    declared = _declared(info, backend)
    if declared is not None:
        return LayoutFinding(declared)
    shape = _shape(info, backend)
    order = _order(info, backend, len(shape), "NHD")
    if order is None:
        raise MigrationError(
            f"{info.path}: {backend.name}.get_kv_cache_stride_order() does not return a "
            "literal tuple, so the command cannot tell the physical cache layout: declare "
            "kv_cache_layout = KVCacheLayout.<member> on the legacy class and run the command "
            "again")
    layout = _known().get((shape, order))
    if layout is None:
        names = ", ".join(m.name for m in KVCacheLayout)
        raise MigrationError(
            f"{info.path}: {backend.name}.get_kv_cache_shape{PROBE} = {shape} with stride "
            f"order {order} is not a layout this package has a writer for; declare "
            f"kv_cache_layout = KVCacheLayout.<one of {names}> if one of them is yours")
    other = _order(info, backend, len(shape), "HND")
    note = None
    if other is not None and other != order:
        alt = _known().get((shape, other))
        note = (f"{layout.name} is the legacy stride order under get_kv_cache_layout()'s "
                "default, NHD (VLLM_KV_CACHE_LAYOUT unset); "
                + (f"HND would be {alt.name}" if alt else "HND is no layout of this package"))
    return LayoutFinding(layout, note)
