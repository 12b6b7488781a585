"""Writer for per-token-head quantised caches (``int8_per_token_head``,
``fp8_per_token_head``); ``docs/layouts.md``, "Per-token-head quantisation".

Cache uint8 ``(nb, 2, bs, H, D + 4)`` (any stride order): each (token, head) row is
D quantised bytes followed by the 4 bytes of its float32 scale. Per row ``x``:

* ``scale = amax(|x|) / qmax`` (qmax 127 for int8, 448 for E4M3), float32; a NaN
  anywhere in the row makes the scale NaN (the whole row then reads back NaN);
* ``y = x / scale`` (``x / 1`` when ``scale == 0``: an all-zero row stores zeros);
* int8: ``clamp(round_half_even(y), -127, 127)``, NaN stored as 0;
  fp8: E4M3 of ``clamp(y, -448, 448)``, round to nearest even, NaN as ``0x7F``.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.errors import KVCacheWriteError
from vllm.attention.layouts import PER_TOKEN_HEAD_SCALE_BYTES, split_kv_views
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers import kernels
from vllm.attention.writers.dispatch import WritePath, WriterBase, resolve_path
from vllm.attention.writers.quant import canonical_nan, to_fp8
from vllm.attention.writers.split import kept_slots
from vllm.attention.writers.validation import check_cache_tensor, check_kv_inputs

PER_TOKEN_HEAD_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = (
    "int8_per_token_head",
    "fp8_per_token_head",
)
PER_TOKEN_HEAD_QMAX: Final[dict[str, float]] = {
    "int8_per_token_head": 127.0,
    "fp8_per_token_head": 448.0,
}
PER_TOKEN_HEAD_VALUE_DTYPE: Final[dict[str, torch.dtype]] = {
    "int8_per_token_head": torch.int8,
    "fp8_per_token_head": torch.float8_e4m3fn,
}
"""How the D value bytes of a row are read."""


def quantize_per_token_head(
    x: torch.Tensor, cache_dtype: KVCacheDType
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., D]`` to ``(values, scales)``: values ``[..., D]`` in
    :data:`PER_TOKEN_HEAD_VALUE_DTYPE`, scales float32 ``[...]``."""
    xf = x.to(torch.float32)
    # Divide by a device tensor: a Python scalar divisor may become a reciprocal multiply.
    qmax = torch.tensor(PER_TOKEN_HEAD_QMAX[cache_dtype], device=x.device)
    scale = canonical_nan(xf.abs().amax(-1) / qmax)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    y = xf / divisor.unsqueeze(-1)
    if cache_dtype == "int8_per_token_head":
        q = torch.where(y.isnan(), 0.0, y.clamp(-127.0, 127.0).round()).to(torch.int8)
    else:
        q = to_fp8(y, torch.float8_e4m3fn)
    return q, scale


def per_token_head_rows(x: torch.Tensor, cache_dtype: KVCacheDType) -> torch.Tensor:
    """Rows ``[..., D]`` as the uint8 ``[..., D + 4]`` they are stored as."""
    q, scale = quantize_per_token_head(x, cache_dtype)
    scale_bytes = scale.unsqueeze(-1).contiguous().view(torch.uint8)  # little-endian
    return torch.cat([q.view(torch.uint8), scale_bytes], dim=-1)


def reference_per_token_head_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_dtype: KVCacheDType,
) -> None:
    """``view[slot // bs, slot % bs] = per_token_head_rows(x[i])`` for K and V;
    views uint8 ``[nb, bs, H, D + 4]``."""
    n = slot_mapping.shape[0]
    keep, blocks, offsets = kept_slots(slot_mapping, k_view.shape[0], k_view.shape[1])
    k_view[blocks, offsets] = per_token_head_rows(key[:n][keep], cache_dtype)
    v_view[blocks, offsets] = per_token_head_rows(value[:n][keep], cache_dtype)


class PerTokenHeadKVCacheWriter(WriterBase):
    """:class:`~vllm.attention.KVCacheWriter` for ``KVCacheLayout.PER_TOKEN_HEAD_QUANT``."""

    layout = KVCacheLayout.PER_TOKEN_HEAD_QUANT
    cache_dtypes = PER_TOKEN_HEAD_CACHE_DTYPES

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *,
              path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.KVCacheWriter`; ``kv_cache``: uint8
        ``(nb, 2, bs, H, D + 4)``, any stride order; ``quant``'s scales are unused."""
        cache = check_cache_tensor(kv_cache)
        k_view, v_view = split_kv_views(cache, self.layout)
        _, _, h, d4 = k_view.shape
        d = d4 - PER_TOKEN_HEAD_SCALE_BYTES
        if d < 1:
            raise KVCacheWriteError("kv_cache.shape", tuple(cache.shape),
                                    "a last axis of head_size + 4 bytes, head_size >= 1")
        check_kv_inputs(key, value, slot_mapping, quant, cache=cache, num_kv_heads=h,
                        head_size=d, head_size_v=d, cache_dtypes=self.cache_dtypes)
        if resolve_path(cache.device, path) == "triton":
            kernels.per_token_head(key, value, k_view, v_view, slot_mapping,
                                          int8=quant.kv_cache_dtype == "int8_per_token_head")
        else:
            reference_per_token_head_write(key, value, k_view, v_view, slot_mapping,
                                           quant.kv_cache_dtype)
