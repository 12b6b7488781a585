"""Writer for the legacy paged layout (``docs/layouts.md``, "Legacy paged").

Cache ``(2, nb, bs*H*D)``: K is ``[0]`` read as ``[nb, H, D/x, bs, x]``, V is ``[1]``
read as ``[nb, H, D, bs]``, with ``x = 16 // element_size`` of the cache dtype.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.errors import InvalidArgumentError, KVCacheWriteError
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
    """:class:`~vllm.attention.KVCacheWriter` for ``KVCacheLayout.LEGACY_PAGED``.

    The cache ``(2, nb, bs*H*D)`` does not carry ``H`` and ``D``, so a key of another
    head count or size would fit it and land in the wrong places. A writer bound to
    a layer's geometry (:meth:`bound_to`; :class:`~vllm.attention.layer.Attention`
    binds the one it gets from its backend) rejects such keys before writing. An
    unbound writer takes ``H`` and ``D`` from ``key``: its caller vouches for them.
    """

    layout = KVCacheLayout.LEGACY_PAGED

    def __init__(self, cache_dtypes: tuple[KVCacheDType, ...] = PAGED_CACHE_DTYPES, *,
                 num_kv_heads: int | None = None, head_size: int | None = None) -> None:
        if (num_kv_heads is None) != (head_size is None):
            raise InvalidArgumentError("num_kv_heads/head_size", (num_kv_heads, head_size),
                                       "both (a bound writer) or neither")
        given: tuple[tuple[str, object], ...] = (("num_kv_heads", num_kv_heads),
                                                 ("head_size", head_size))
        for name, n in given:  # callers outside mypy's reach pass anything
            if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
                raise InvalidArgumentError(name, n, "a positive int")
        self.cache_dtypes = cache_dtypes
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size

    def bound_to(self, *, num_kv_heads: int, head_size: int,
                 head_size_v: int) -> LegacyPagedKVCacheWriter:
        """This writer for one layer's geometry: keys and values must be
        ``[>= num_tokens, num_kv_heads, head_size]``."""
        if head_size_v != head_size:
            raise InvalidArgumentError(
                "head_size_v", head_size_v,
                f"head_size={head_size}: legacy_paged stores K and V of one head size")
        return LegacyPagedKVCacheWriter(self.cache_dtypes, num_kv_heads=num_kv_heads,
                                        head_size=head_size)

    def __repr__(self) -> str:
        if self.num_kv_heads is None:
            return super().__repr__()
        return (f"{type(self).__name__}({self.layout.value}, num_kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size})")

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *,
              path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.KVCacheWriter`; ``kv_cache``: ``(2, nb, bs*H*D)``."""
        cache = check_cache_tensor(kv_cache)
        h, d = key_heads_and_size(key)
        if self.num_kv_heads is not None and (h, d) != (self.num_kv_heads, self.head_size):
            raise KVCacheWriteError(
                "key.shape", tuple(key.shape),
                f"[>= num_tokens, num_kv_heads={self.num_kv_heads}, head_size={self.head_size}]"
                " (the geometry this writer is bound to; a legacy_paged cache does not carry "
                "it, so no other fits safely)",
            )
        check_kv_inputs(key, value, slot_mapping, quant, cache=cache, num_kv_heads=h,
                        head_size=d, head_size_v=d, cache_dtypes=self.cache_dtypes)
        k5, v4 = legacy_paged_views(cache, h, d)
        scatter_legacy_paged_views(key, value, k5, v4, slot_mapping, quant, path=path)


def write_legacy_paged_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k5: torch.Tensor,
    v4: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
    cache_dtypes: tuple[KVCacheDType, ...] = PAGED_CACHE_DTYPES,
    *,
    path: WritePath | None = None,
) -> None:
    """Validate, then write into the K ``[nb, H, D/x, bs, x]`` and V ``[nb, H, D, bs]``
    views of a legacy paged cache (vLLM's ``reshape_and_cache`` arguments)."""
    check_tensor("key_cache", k5)
    check_tensor("value_cache", v4)
    if (k5.dim() != 5 or v4.dim() != 4 or k5.shape[:2] != v4.shape[:2]
            or k5.shape[3] != v4.shape[3] or k5.shape[2] * k5.shape[4] != v4.shape[2]):
        raise KVCacheWriteError(
            "kv_cache views", (tuple(k5.shape), tuple(v4.shape)),
            "K [num_blocks, num_kv_heads, head_size/x, block_size, x] and "
            "V [num_blocks, num_kv_heads, head_size, block_size]",
        )
    if v4.dtype != k5.dtype or v4.device != k5.device:
        raise KVCacheWriteError("value_cache", f"{v4.dtype} on {v4.device}",
                                f"{k5.dtype} on {k5.device} (key_cache's)")
    h, d = int(v4.shape[1]), int(v4.shape[2])
    check_kv_inputs(key, value, slot_mapping, quant, cache=k5, num_kv_heads=h, head_size=d,
                    head_size_v=d, cache_dtypes=cache_dtypes)
    scatter_legacy_paged_views(key, value, k5, v4, slot_mapping, quant, path=path)


def scatter_legacy_paged_views(
    key: torch.Tensor,
    value: torch.Tensor,
    k5: torch.Tensor,
    v4: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
    *,
    path: WritePath | None = None,
) -> None:
    """Write, unchecked, into the K ``[nb, H, D/x, bs, x]`` and V ``[nb, H, D, bs]``
    views: the Triton scatter, or the torch reference, as ``path`` resolves."""
    if resolve_path(k5.device, path) == "triton":
        scatter_kv(key, value, ScatterTarget.x_split_key(k5),
                   ScatterTarget.head_major_value(v4), slot_mapping,
                   scatter_mode(quant.kv_cache_dtype), quant.k_scale, quant.v_scale)
    else:
        reference_legacy_paged_write(key, value, k5, v4, slot_mapping, quant)
