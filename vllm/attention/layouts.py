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


def empty_in_stride_order(shape: tuple[int, ...], order: tuple[int, ...], *,
                          dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised tensor of logical ``shape`` whose memory is laid out in
    ``order`` (logical axes from the outermost physical axis inwards, as
    :func:`kv_cache_stride_order` gives them): the physical tensor allocated dense and
    its axes permuted back."""
    physical = torch.empty([shape[i] for i in order], dtype=dtype, device=device)
    return physical.permute(*sorted(range(len(order)), key=order.__getitem__))


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


def paged_x(dtype: torch.dtype) -> int:
    """``x = 16 // element_size``: elements per 16-byte chunk (legacy and AITER layouts)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def _reinterpret(t: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    try:
        return t.view(shape)
    except RuntimeError:
        raise InvalidArgumentError(
            "kv_cache.stride", tuple(t.stride()),
            f"contiguous rows per block, so that {what} can be read as {shape}",
        ) from None


def legacy_paged_views(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[nb, H, D/x, bs, x]`` and V ``[nb, H, D, bs]`` views of a ``(2, nb, bs*H*D)`` cache."""
    h, d = num_kv_heads, head_size
    if kv_cache.dim() != 3 or kv_cache.shape[0] != 2:
        raise InvalidArgumentError("kv_cache.shape", tuple(kv_cache.shape),
                                   "(2, num_blocks, block_size * num_kv_heads * head_size)")
    x = paged_x(kv_cache.dtype)
    if d % x:
        raise InvalidArgumentError("head_size", d, f"a multiple of x={x} (16 bytes of "
                                   f"{kv_cache.dtype}) for layout legacy_paged")
    if kv_cache.shape[2] % (h * d):
        raise InvalidArgumentError(
            "kv_cache.shape", tuple(kv_cache.shape),
            f"a last axis that is block_size * num_kv_heads * head_size (H*D = {h * d})",
        )
    nb, bs = kv_cache.shape[1], kv_cache.shape[2] // (h * d)
    k = _reinterpret(kv_cache[0], (nb, h, d // x, bs, x), "K")
    v = _reinterpret(kv_cache[1], (nb, h, d, bs), "V")
    return k, v


def aiter_shuffled_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[nb, H, D/x, bs, x]`` and V ``[nb, H, bs/x, D, x]``: the bytes of a logical
    ``(2, nb, bs, H, D)`` cache's ``[0]`` and ``[1]``, reinterpreted."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise InvalidArgumentError("kv_cache.shape", tuple(kv_cache.shape),
                                   "(2, num_blocks, block_size, num_kv_heads, head_size)")
    _, nb, bs, h, d = kv_cache.shape
    x = paged_x(kv_cache.dtype)
    if d % x:
        raise InvalidArgumentError("head_size", d, f"a multiple of x={x} (16 bytes of "
                                   f"{kv_cache.dtype}) for layout aiter_shuffled")
    if bs % x:
        raise InvalidArgumentError("block_size", bs, f"a multiple of x={x} (16 bytes of "
                                   f"{kv_cache.dtype}) for layout aiter_shuffled")
    k = _reinterpret(kv_cache[0], (nb, h, d // x, bs, x), "K")
    v = _reinterpret(kv_cache[1], (nb, h, bs // x, d, x), "V")
    return k, v


def diffkv_views(
    kv_cache: torch.Tensor, head_size_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[nb, bs, H, Dk]`` and V ``[nb, bs, H, Dv]`` views of a ``(nb, bs, H, Dk + Dv)`` cache."""
    if kv_cache.dim() != 4 or not 0 < head_size_k < kv_cache.shape[3]:
        raise InvalidArgumentError(
            "kv_cache.shape", tuple(kv_cache.shape),
            f"(num_blocks, block_size, num_kv_heads, Dk + Dv) with Dk={head_size_k} and Dv >= 1",
        )
    return kv_cache[..., :head_size_k], kv_cache[..., head_size_k:]


def mla_latent_views(
    kv_cache: torch.Tensor, kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent ``[nb, bs, L]`` and rope ``[nb, bs, R]`` views of a ``(nb, bs, L + R)`` cache."""
    if kv_cache.dim() != 3 or not 0 < kv_lora_rank < kv_cache.shape[2]:
        raise InvalidArgumentError(
            "kv_cache.shape", tuple(kv_cache.shape),
            f"(num_blocks, block_size, kv_lora_rank + rope_dim) with kv_lora_rank={kv_lora_rank}"
            " and rope_dim >= 1",
        )
    return kv_cache[..., :kv_lora_rank], kv_cache[..., kv_lora_rank:]
