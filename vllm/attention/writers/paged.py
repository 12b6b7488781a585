"""Writer for the legacy paged layout (``docs/layouts.md``, "Legacy paged").

Cache ``(2, nb, bs*H*D)``: K is ``[0]`` read as ``[nb, H, D/x, bs, x]``, V is ``[1]``
read as ``[nb, H, D, bs]``, with ``x = 16 // element_size`` of the cache dtype.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.errors import KVCacheWriteError
from vllm.attention.layouts import legacy_paged_views
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers.dispatch import WritePath, WriterBase, resolve_path
from vllm.attention.writers.kernels import ScatterTarget, scatter_kv
from vllm.attention.writers.quant import as_bits, store_values
from vllm.attention.writers.split import SPLIT_CACHE_DTYPES, kept_slots, scatter_mode
from vllm.attention.writers.validation import check_cache_tensor, check_kv_inputs, check_tensor

PAGED_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = SPLIT_CACHE_DTYPES


def key_heads_and_size(key: object) -> tuple[int, int]:
    """``(num_kv_heads, head_size)`` of a ``[T, H, D]`` key, for layouts whose cache
    shape does not carry them."""
    k = check_tensor("key", key)
    if k.dim() != 3:
        raise KVCacheWriteError("key.shape", tuple(k.shape),
                                "[>= num_tokens, num_kv_heads, head_size]")
    return int(k.shape[1]), int(k.shape[2])


def reference_legacy_paged_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k5: torch.Tensor,
    v4: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
) -> None:
    """``K[b, h, d // x, o, d % x] = key[i, h, d]`` and ``V[b, h, d, o] = value[i, h, d]``
    for ``(b, o) = divmod(slot_mapping[i], bs)``."""
    n = slot_mapping.shape[0]
    keep, blocks, offsets = kept_slots(slot_mapping, k5.shape[0], k5.shape[3])
    dt = quant.kv_cache_dtype
    k = store_values(key[:n][keep], dt, quant.k_scale, k5.dtype)
    v = store_values(value[:n][keep], dt, quant.v_scale, v4.dtype)
    # explicit D/x, not -1: reshape cannot infer it when no slot is kept (0 rows)
    as_bits(k5).permute(0, 3, 1, 2, 4)[blocks, offsets] = as_bits(k).reshape(
        *k.shape[:-1], k5.shape[2], k5.shape[4])
    as_bits(v4).permute(0, 3, 1, 2)[blocks, offsets] = as_bits(v)


class LegacyPagedKVCacheWriter(WriterBase):
    """:class:`~vllm.attention.KVCacheWriter` for ``KVCacheLayout.LEGACY_PAGED``."""

    layout = KVCacheLayout.LEGACY_PAGED

    def __init__(self, cache_dtypes: tuple[KVCacheDType, ...] = PAGED_CACHE_DTYPES) -> None:
        self.cache_dtypes = cache_dtypes

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *,
              path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.KVCacheWriter`; ``kv_cache``: ``(2, nb, bs*H*D)``."""
        cache = check_cache_tensor(kv_cache)
        h, d = key_heads_and_size(key)
        check_kv_inputs(key, value, slot_mapping, quant, cache=cache, num_kv_heads=h,
                        head_size=d, head_size_v=d, cache_dtypes=self.cache_dtypes)
        k5, v4 = legacy_paged_views(cache, h, d)
        if resolve_path(cache.device, path) == "triton":
            scatter_kv(key, value, ScatterTarget.x_split_key(k5),
                       ScatterTarget.head_major_value(v4), slot_mapping,
                       scatter_mode(quant.kv_cache_dtype), quant.k_scale, quant.v_scale)
        else:
            reference_legacy_paged_write(key, value, k5, v4, slot_mapping, quant)
