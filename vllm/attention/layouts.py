"""Logical shapes, physical stride orders and K/V views of every cache layout.

The one place that knows how a layout's tensor is laid out; writers, decoders
and compute paths all go through it. Diagrams: ``docs/layouts.md``.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.types import KVCacheLayout

FP8_DS_MLA_ENTRY_BYTES: Final = 656
"""512 E4M3 latent values + 4 float32 tile scales (16 bytes) + 64 16-bit rope values."""
FP8_DS_MLA_LATENT: Final = 512
FP8_DS_MLA_ROPE: Final = 64
FP8_DS_MLA_TILE: Final = 128
PER_TOKEN_HEAD_SCALE_BYTES: Final = 4
"""A float32 scale after the D quantised bytes of each (token, head) row."""

_SPLIT_KV_AXIS: Final = {
    KVCacheLayout.SPLIT_NHD: 1,
    KVCacheLayout.SPLIT_HND: 1,
    KVCacheLayout.SPLIT_BLOCK_INTERLEAVED: 1,
    KVCacheLayout.PER_TOKEN_HEAD_QUANT: 1,
    KVCacheLayout.SPLIT_KV_FIRST: 0,
    KVCacheLayout.AITER_SHUFFLED: 0,
}


def kv_cache_shape(
    layout: KVCacheLayout,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
) -> tuple[int, ...]:
    """The logical shape. DiffKV takes ``head_size = Dk + Dv``; MLA takes
    ``num_kv_heads = 1`` and ``head_size = kv_lora_rank + rope_dim``."""
    nb, bs, h, d = num_blocks, block_size, num_kv_heads, head_size
    if layout in (
        KVCacheLayout.SPLIT_NHD,
        KVCacheLayout.SPLIT_HND,
        KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
    ):
        return (nb, 2, bs, h, d)
    if layout in (KVCacheLayout.SPLIT_KV_FIRST, KVCacheLayout.AITER_SHUFFLED):
        return (2, nb, bs, h, d)
    if layout is KVCacheLayout.PER_TOKEN_HEAD_QUANT:
        return (nb, 2, bs, h, d + PER_TOKEN_HEAD_SCALE_BYTES)
    if layout is KVCacheLayout.LEGACY_PAGED:
        return (2, nb, bs * h * d)
    if layout is KVCacheLayout.DIFFKV_PACKED:
        return (nb, bs, h, d)
    if num_kv_heads != 1:
        raise InvalidArgumentError("num_kv_heads", num_kv_heads, "1 for MLA layouts")
    if layout is KVCacheLayout.MLA_LATENT:
        return (nb, bs, d)
    if layout is KVCacheLayout.MLA_FP8_DS:
        return (nb, bs, FP8_DS_MLA_ENTRY_BYTES)
    raise AssertionError(f"unhandled layout {layout}")  # internal: every member handled


def kv_cache_stride_order(layout: KVCacheLayout) -> tuple[int, ...]:
    """Logical axes from the outermost physical axis inwards."""
    if layout is KVCacheLayout.SPLIT_HND:
        return (0, 1, 3, 2, 4)
    if layout is KVCacheLayout.SPLIT_BLOCK_INTERLEAVED:
        return (0, 2, 1, 3, 4)
    ndim = {
        KVCacheLayout.LEGACY_PAGED: 3,
        KVCacheLayout.DIFFKV_PACKED: 4,
        KVCacheLayout.MLA_LATENT: 3,
        KVCacheLayout.MLA_FP8_DS: 3,
    }.get(layout, 5)
    return tuple(range(ndim))


def split_kv_axis(layout: KVCacheLayout) -> int:
    """The logical axis that selects K (0) or V (1) in a split layout."""
    try:
        return _SPLIT_KV_AXIS[layout]
    except KeyError:
        raise InvalidArgumentError("layout", layout.value, "a split K/V layout") from None


def split_kv_views(
    kv_cache: torch.Tensor, layout: KVCacheLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[nb, bs, H, D]`` of a split-layout cache, any strides."""
    if kv_cache.dim() != 5:
        raise InvalidArgumentError(
            "kv_cache.shape", tuple(kv_cache.shape), f"5 dims for layout {layout.value}"
        )
    axis = split_kv_axis(layout)
    if kv_cache.shape[axis] != 2:
        raise InvalidArgumentError(
            "kv_cache.shape", tuple(kv_cache.shape), f"size 2 on axis {axis} ({layout.value})"
        )
    return kv_cache.select(axis, 0), kv_cache.select(axis, 1)
