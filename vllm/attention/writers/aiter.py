"""Writer for the AITER shuffled layout (``docs/layouts.md``, "AITER shuffled").

Cache logical ``(2, nb, bs, H, D)``; the bytes of ``[0]`` are K ``[nb, H, D/x, bs, x]``
and those of ``[1]`` are V ``[nb, H, bs/x, D, x]``, ``x = 16 // element_size``.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.layouts import aiter_shuffled_views
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers.dispatch import WritePath, WriterBase, resolve_path
from vllm.attention.writers.kernels import ScatterTarget, scatter_kv
from vllm.attention.writers.quant import as_bits, store_values
from vllm.attention.writers.split import SPLIT_CACHE_DTYPES, kept_slots, scatter_mode
from vllm.attention.writers.validation import check_cache_tensor, check_kv_inputs

AITER_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = SPLIT_CACHE_DTYPES


def reference_aiter_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k5: torch.Tensor,
    v5: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
) -> None:
    """``K[b, h, d // x, o, d % x] = key[i, h, d]`` and
    ``V[b, h, o // x, d, o % x] = value[i, h, d]`` for ``(b, o) = divmod(slot, bs)``."""
    n = slot_mapping.shape[0]
    x = k5.shape[4]
    keep, blocks, offsets = kept_slots(slot_mapping, k5.shape[0], k5.shape[3])
    dt = quant.kv_cache_dtype
    k = store_values(key[:n][keep], dt, quant.k_scale, k5.dtype)
    v = store_values(value[:n][keep], dt, quant.v_scale, v5.dtype)
    # explicit D/x, not -1: reshape cannot infer it when no slot is kept (0 rows)
    as_bits(k5).permute(0, 3, 1, 2, 4)[blocks, offsets] = as_bits(k).reshape(
        *k.shape[:-1], k5.shape[2], x)
    as_bits(v5).permute(0, 2, 4, 1, 3)[blocks, offsets // x, offsets % x] = as_bits(v)


class AiterShuffledKVCacheWriter(WriterBase):
    """:class:`~vllm.attention.KVCacheWriter` for ``KVCacheLayout.AITER_SHUFFLED``."""

    layout = KVCacheLayout.AITER_SHUFFLED

    def __init__(self, cache_dtypes: tuple[KVCacheDType, ...] = AITER_CACHE_DTYPES) -> None:
        self.cache_dtypes = cache_dtypes

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *,
              path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.KVCacheWriter`; ``kv_cache``: ``(2, nb, bs, H, D)``
        with contiguous rows per block (they are reinterpreted)."""
        cache = check_cache_tensor(kv_cache)
        k5, v5 = aiter_shuffled_views(cache)
        _, h, _, _, _ = k5.shape
        d = v5.shape[3]
        check_kv_inputs(key, value, slot_mapping, quant, cache=cache, num_kv_heads=h,
                        head_size=d, head_size_v=d, cache_dtypes=self.cache_dtypes)
        if resolve_path(cache.device, path) == "triton":
            scatter_kv(key, value, ScatterTarget.x_split_key(k5),
                       ScatterTarget.x_split_value(v5), slot_mapping,
                       scatter_mode(quant.kv_cache_dtype), quant.k_scale, quant.v_scale)
        else:
            reference_aiter_write(key, value, k5, v5, slot_mapping, quant)
