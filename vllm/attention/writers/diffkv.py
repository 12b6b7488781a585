"""Writer for DiffKV packed caches: ``(nb, bs, H, Dk + Dv)``, K then V on the last axis.

K and V are the ``[..., :Dk]`` and ``[..., Dk:]`` views, written like a split layout
(:func:`vllm.attention.writers.split.write_kv_views`); ``Dk`` is the key's head size.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.layouts import diffkv_views
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers.dispatch import WritePath, WriterBase
from vllm.attention.writers.paged import key_heads_and_size
from vllm.attention.writers.split import SPLIT_CACHE_DTYPES, write_kv_views
from vllm.attention.writers.validation import check_cache_tensor

DIFFKV_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = SPLIT_CACHE_DTYPES


class DiffKVCacheWriter(WriterBase):
    """:class:`~vllm.attention.KVCacheWriter` for ``KVCacheLayout.DIFFKV_PACKED``;
    ``value`` is ``[T, H, Dv]`` with its own head size."""

    layout = KVCacheLayout.DIFFKV_PACKED

    def __init__(self, cache_dtypes: tuple[KVCacheDType, ...] = DIFFKV_CACHE_DTYPES) -> None:
        self.cache_dtypes = cache_dtypes

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *,
              path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.KVCacheWriter`; ``kv_cache``: ``(nb, bs, H, Dk + Dv)``."""
        cache = check_cache_tensor(kv_cache)
        _, dk = key_heads_and_size(key)
        k_view, v_view = diffkv_views(cache, dk)
        write_kv_views(key, value, k_view, v_view, slot_mapping, quant, self.cache_dtypes,
                       path=path)
