"""Writer for ``fp8_ds_mla`` caches: ``(nb, bs, 656)`` uint8, one entry per token.

Entry bytes (``docs/layouts.md``, "fp8_ds_mla"): 0-511 the 512 latent values as E4M3,
512-527 four float32 scales (one per 128-value tile, ``max(amax / 448, FLT_MIN)``,
NaN if the tile holds a NaN), 528-655 the 64 rope values in 16 bits: the input's
dtype for fp16/bf16 inputs, bf16 (round to nearest even) for fp32 inputs, since
the entry has no room for 32-bit rope values and the sparse MLA kernels read bf16.
"""

from __future__ import annotations

from typing import Final

import torch

from vllm.attention.errors import KVCacheWriteError
from vllm.attention.layouts import (
    FP8_DS_MLA_ENTRY_BYTES,
    FP8_DS_MLA_LATENT,
    FP8_DS_MLA_ROPE,
    FP8_DS_MLA_TILE,
)
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers import kernels
from vllm.attention.writers.dispatch import WritePath, WriterBase, resolve_path
from vllm.attention.writers.mla import check_mla_inputs
from vllm.attention.writers.quant import canonical_nan, to_fp8
from vllm.attention.writers.split import kept_slots
from vllm.attention.writers.validation import check_cache_dtype, check_cache_tensor, check_quant

FP8_DS_MLA_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = ("fp8_ds_mla",)
FLT_MIN: Final = float(torch.finfo(torch.float32).tiny)
BF16_NAN_BITS: Final = 0x7FC0
"""The one NaN stored for fp32 rope values (rounded to bf16)."""


def ds_mla_rope_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype the rope values of ``input_dtype`` inputs are stored in."""
    return torch.float16 if input_dtype == torch.float16 else torch.bfloat16


def quantize_ds_mla_latent(kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows ``[n, 512]`` to ``(E4M3 [n, 512], float32 tile scales [n, 4])``."""
    tiles = kv_c.to(torch.float32).reshape(  # sizes spelled out: 0 rows cannot infer a -1
        kv_c.shape[0], FP8_DS_MLA_LATENT // FP8_DS_MLA_TILE, FP8_DS_MLA_TILE)
    # Divide by device tensors: a Python scalar divisor may become a reciprocal multiply.
    amax = tiles.abs().amax(-1)
    scale = torch.maximum(amax / torch.tensor(448.0, device=kv_c.device),
                          torch.tensor(FLT_MIN, device=kv_c.device))
    scale = canonical_nan(scale)  # a tile with a NaN: scale NaN, every value NaN
    q = to_fp8(tiles / scale.unsqueeze(-1), torch.float8_e4m3fn)
    return q.flatten(-2), scale


def ds_mla_rope_bits(k_pe: torch.Tensor) -> torch.Tensor:
    """Rope rows ``[n, 64]`` as their stored 16-bit values (:func:`ds_mla_rope_dtype`)."""
    if k_pe.dtype != torch.float32:
        return k_pe
    bits = k_pe.to(torch.bfloat16).view(torch.int16)
    return bits.masked_fill(k_pe.isnan(), BF16_NAN_BITS).view(torch.bfloat16)


def ds_mla_entries(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Rows ``[n, 512]`` and ``[n, 64]`` as their uint8 ``[n, 656]`` entries."""
    q, scale = quantize_ds_mla_latent(kv_c)
    parts = (q.view(torch.uint8), scale.contiguous().view(torch.uint8),  # little-endian
             ds_mla_rope_bits(k_pe).contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1)


def reference_fp8_ds_mla_write(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``kv_cache[slot // bs, slot % bs] = ds_mla_entries(kv_c[i], k_pe[i])``."""
    n = slot_mapping.shape[0]
    keep, blocks, offsets = kept_slots(slot_mapping, kv_cache.shape[0], kv_cache.shape[1])
    kv_cache[blocks, offsets] = ds_mla_entries(kv_c[:n][keep], k_pe[:n][keep])


class FP8DsMLACacheWriter(WriterBase):
    """:class:`~vllm.attention.MLAKVCacheWriter` for ``KVCacheLayout.MLA_FP8_DS``."""

    layout = KVCacheLayout.MLA_FP8_DS
    cache_dtypes = FP8_DS_MLA_CACHE_DTYPES

    def write(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *,
              path: WritePath | None = None) -> None:
        """See :class:`~vllm.attention.MLAKVCacheWriter`; ``kv_c_normed`` ``[T, 512]``,
        ``k_pe`` ``[T, 64]``, ``kv_cache`` uint8 ``(nb, bs, 656)``; ``quant``'s scales
        are unused (each tile carries its own)."""
        cache = check_cache_tensor(kv_cache)
        kv_c, pe, slots = check_mla_inputs(kv_c_normed, k_pe, slot_mapping, cache)
        if kv_c.shape[1] != FP8_DS_MLA_LATENT:
            raise KVCacheWriteError("kv_c_normed.shape", tuple(kv_c.shape),
                                    f"[>= num_tokens, {FP8_DS_MLA_LATENT}] for fp8_ds_mla")
        if pe.shape[1] != FP8_DS_MLA_ROPE:
            raise KVCacheWriteError("k_pe.shape", tuple(pe.shape),
                                    f"[>= num_tokens, {FP8_DS_MLA_ROPE}] for fp8_ds_mla")
        if cache.dim() != 3 or cache.shape[2] != FP8_DS_MLA_ENTRY_BYTES:
            raise KVCacheWriteError("kv_cache.shape", tuple(cache.shape),
                                    f"(num_blocks, block_size, {FP8_DS_MLA_ENTRY_BYTES})")
        q = check_quant(quant, num_kv_heads=1, device=cache.device, allowed=self.cache_dtypes)
        check_cache_dtype(cache, q.kv_cache_dtype, kv_c.dtype)
        if resolve_path(cache.device, path) == "triton":
            kernels.fp8_ds_mla(kv_c, pe, cache, slots)
        else:
            reference_fp8_ds_mla_write(kv_c, pe, cache, slots)
