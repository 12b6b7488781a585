"""Writers for the split K/V layouts: NHD, HND, K/V-first and block-interleaved.

All four are a K view and a V view ``[nb, bs, H, D]`` of one tensor with some
stride order (``vllm.attention.layouts.split_kv_views``); the writer addresses
through those views' strides, so a view of a larger hybrid buffer works too.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.layouts import split_kv_views
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers.quant import store_values
from vllm.attention.writers.validation import (
    check_cache_dtype,
    check_quant,
    check_rows,
    check_same_device,
    check_slot_mapping,
    check_tensor,
)

SPLIT_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def reference_split_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
) -> None:
    """The torch reference: ``k_view[slot // bs, slot % bs] = store(key[i])``.

    ``k_view``/``v_view``: ``[nb, bs, H, D]`` views (any strides) of the cache.
    """
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_view.shape[1]
    blocks, offsets = slots // bs, slots % bs
    dt = quant.kv_cache_dtype
    k_view[blocks, offsets] = store_values(key[:n][keep], dt, quant.k_scale, k_view.dtype)
    v_view[blocks, offsets] = store_values(value[:n][keep], dt, quant.v_scale, v_view.dtype)


class SplitKVCacheWriter:
    """:class:`~vllm.attention.KVCacheWriter` for a split K/V layout."""

    def __init__(self, layout: KVCacheLayout,
                 cache_dtypes: tuple[KVCacheDType, ...] = SPLIT_CACHE_DTYPES) -> None:
        self.layout = layout
        self.cache_dtypes = cache_dtypes

    def __repr__(self) -> str:
        return f"SplitKVCacheWriter({self.layout.value})"

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant) -> None:
        cache = check_tensor("kv_cache", kv_cache)
        k_view, v_view = split_kv_views(cache, self.layout)
        write_kv_views(key, value, k_view, v_view, slot_mapping, quant, self.cache_dtypes)


def validate_kv_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
    cache_dtypes: tuple[KVCacheDType, ...] = SPLIT_CACHE_DTYPES,
) -> None:
    """Check every argument of a split write. Writes nothing."""
    slots = check_slot_mapping(slot_mapping, k_view.device)
    n = slots.shape[0]
    _, _, h, d = k_view.shape
    k = check_rows("key", key, num_tokens=n, tail=(h, d), tail_desc="num_kv_heads, head_size")
    v = check_rows("value", value, num_tokens=n, tail=tuple(v_view.shape[2:]),
                   tail_desc="num_kv_heads, head_size_v")
    if v.dtype != k.dtype:
        raise_dtype_mismatch(k.dtype, v.dtype)
    check_same_device("key", k, k_view.device)
    check_same_device("value", v, k_view.device)
    q = check_quant(quant, num_kv_heads=h, device=k_view.device, allowed=cache_dtypes)
    check_cache_dtype(k_view, q.kv_cache_dtype, k.dtype)


def write_kv_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
    cache_dtypes: tuple[KVCacheDType, ...] = SPLIT_CACHE_DTYPES,
) -> None:
    """Validate, then write into ``[nb, bs, H, D]`` K and V views (any strides)."""
    validate_kv_views(key, value, k_view, v_view, slot_mapping, quant, cache_dtypes)
    reference_split_write(key, value, k_view, v_view, slot_mapping, quant)


def raise_dtype_mismatch(key_dtype: torch.dtype, value_dtype: torch.dtype) -> None:
    from vllm.attention.errors import KVCacheWriteError

    raise KVCacheWriteError("value.dtype", value_dtype, f"{key_dtype} (key's dtype)")
