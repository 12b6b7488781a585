"""``vllm._custom_ops``: vLLM's cache-write ops, routed through this package's writers.

Same signatures as upstream's, and the write semantics of ``docs/layouts.md`` (a
negative slot is skipped; nothing outside the named slots changes). vLLM's own tensor
conventions are accepted: fp8 caches held as ``torch.uint8`` are viewed as the format's
fp8 dtype, and 0-d scales are per-tensor scales. Deprecated for the type checker; a
backend that calls them runs through the adapter, which warns once per backend class.
"""

from __future__ import annotations

import torch
from typing_extensions import deprecated

from vllm.attention.types import KVQuant, is_fp8_scaled, parse_kv_cache_dtype
from vllm.attention.writers import mla_writer_for
from vllm.attention.writers.paged import write_legacy_paged_views
from vllm.attention.writers.quant import FP8_DTYPES
from vllm.attention.writers.split import write_kv_views

__all__ = ["concat_and_cache_mla", "reshape_and_cache", "reshape_and_cache_flash"]



def _quant(kv_cache_dtype: str, k_scale: torch.Tensor | float,
           v_scale: torch.Tensor | float) -> KVQuant:
    dt = parse_kv_cache_dtype(kv_cache_dtype)
    k = torch.as_tensor(k_scale, dtype=torch.float32)
    v = torch.as_tensor(v_scale, dtype=torch.float32)
    return KVQuant(dt, k, v)


def as_storage(cache: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """``cache`` in the dtype its format stores: vLLM keeps fp8 caches as ``uint8``."""
    if cache.dtype == torch.uint8 and is_fp8_scaled(quant.kv_cache_dtype):
        return cache.view(FP8_DTYPES[quant.kv_cache_dtype])
    return cache


def write_flash_views(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache_dtype: str, k_scale: torch.Tensor | float,
                      v_scale: torch.Tensor | float) -> None:
    """``reshape_and_cache_flash``'s body: ``[nb, bs, H, D]`` K and V caches, any strides."""
    quant = _quant(kv_cache_dtype, k_scale, v_scale)
    write_kv_views(key, value, as_storage(key_cache, quant), as_storage(value_cache, quant),
                   slot_mapping, quant)


@deprecated("reshape_and_cache_flash() writes inside the backend: return a KVCacheWriter from "
            "AttentionBackend.get_kv_cache_writer() and let the layer write "
            "(see migration_guide.md)", category=None)
def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_cache_dtype: str, k_scale: torch.Tensor,
                            v_scale: torch.Tensor) -> None:
    """Write into ``[nb, bs, H, D]`` K and V caches (any strides: NHD or HND)."""
    write_flash_views(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                      k_scale, v_scale)


@deprecated("reshape_and_cache() writes inside the backend: return a KVCacheWriter from "
            "AttentionBackend.get_kv_cache_writer() and let the layer write "
            "(see migration_guide.md)", category=None)
def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache_dtype: str, k_scale: torch.Tensor,
                      v_scale: torch.Tensor) -> None:
    """Write into the legacy paged K ``[nb, H, D/x, bs, x]`` and V ``[nb, H, D, bs]``."""
    quant = _quant(kv_cache_dtype, k_scale, v_scale)
    write_legacy_paged_views(key, value, as_storage(key_cache, quant),
                             as_storage(value_cache, quant), slot_mapping, quant)


@deprecated("concat_and_cache_mla() writes inside the backend: return a KVCacheWriter from "
            "AttentionBackend.get_kv_cache_writer() and let the layer write "
            "(see migration_guide.md)", category=None)
def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str,
                         scale: torch.Tensor) -> None:
    """Write ``[T, kv_lora_rank]`` latents and ``[T, rope_dim]`` rope parts into an
    ``(nb, bs, L + R)`` cache (or the 656-byte ``fp8_ds_mla`` entry)."""
    quant = _quant(kv_cache_dtype, scale, scale)
    mla_writer_for(quant.kv_cache_dtype).write(kv_c, k_pe, as_storage(kv_cache, quant),
                                               slot_mapping, quant)
