"""One writer per cache-layout family; backends pick theirs from here.

``writer_for_layout(layout)`` returns the standard writer of a non-MLA layout and
``mla_writer_for(cache_dtype)`` the MLA one. Each writer validates every argument,
then runs the Triton kernel for CUDA tensors when Triton is importable and the
torch reference otherwise (``writer.path(device)`` says which). Layouts:
``docs/layouts.md``.
"""

from __future__ import annotations

import torch

from vllm.attention.errors import KVCacheWriteError
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writer import KVCacheWriter, MLAKVCacheWriter
from vllm.attention.writers.aiter import AiterShuffledKVCacheWriter
from vllm.attention.writers.diffkv import DiffKVCacheWriter
from vllm.attention.writers.dispatch import WritePath, WriterBase
from vllm.attention.writers.fp8_ds_mla import FP8DsMLACacheWriter
from vllm.attention.writers.mla import MLALatentCacheWriter
from vllm.attention.writers.paged import LegacyPagedKVCacheWriter
from vllm.attention.writers.per_token_head import PerTokenHeadKVCacheWriter
from vllm.attention.writers.split import SPLIT_LAYOUTS, SplitKVCacheWriter

MLA_LAYOUTS: tuple[KVCacheLayout, ...] = (KVCacheLayout.MLA_LATENT, KVCacheLayout.MLA_FP8_DS)

__all__ = [
    "AiterShuffledKVCacheWriter",
    "DiffKVCacheWriter",
    "FP8DsMLACacheWriter",
    "LegacyPagedKVCacheWriter",
    "MLALatentCacheWriter",
    "MLA_LAYOUTS",
    "PerTokenHeadKVCacheWriter",
    "SplitKVCacheWriter",
    "WritePath",
    "WriterBase",
    "mla_writer_for",
    "mla_writer_for_layout",
    "reference_write",
    "writer_for_layout",
]


AnyKVWriter = (SplitKVCacheWriter | LegacyPagedKVCacheWriter | AiterShuffledKVCacheWriter
               | DiffKVCacheWriter | PerTokenHeadKVCacheWriter)
AnyMLAWriter = MLALatentCacheWriter | FP8DsMLACacheWriter


def _kv_writer(layout: KVCacheLayout) -> AnyKVWriter:
    if layout in SPLIT_LAYOUTS:
        return SplitKVCacheWriter(layout)
    if layout is KVCacheLayout.LEGACY_PAGED:
        return LegacyPagedKVCacheWriter()
    if layout is KVCacheLayout.AITER_SHUFFLED:
        return AiterShuffledKVCacheWriter()
    if layout is KVCacheLayout.DIFFKV_PACKED:
        return DiffKVCacheWriter()
    if layout is KVCacheLayout.PER_TOKEN_HEAD_QUANT:
        return PerTokenHeadKVCacheWriter()
    allowed = ", ".join(x.value for x in KVCacheLayout if x not in MLA_LAYOUTS)
    raise KVCacheWriteError("layout", layout.value,
                            f"one of {allowed} (MLA layouts: mla_writer_for_layout)")


def _mla_writer(layout: KVCacheLayout) -> AnyMLAWriter:
    if layout is KVCacheLayout.MLA_LATENT:
        return MLALatentCacheWriter()
    if layout is KVCacheLayout.MLA_FP8_DS:
        return FP8DsMLACacheWriter()
    raise KVCacheWriteError("layout", layout.value,
                            f"one of {', '.join(x.value for x in MLA_LAYOUTS)}")


def writer_for_layout(layout: KVCacheLayout) -> KVCacheWriter:
    """The standard :class:`KVCacheWriter` of a non-MLA layout."""
    return _kv_writer(layout)


def mla_writer_for_layout(layout: KVCacheLayout) -> MLAKVCacheWriter:
    """The :class:`MLAKVCacheWriter` of an MLA layout."""
    return _mla_writer(layout)


def mla_writer_for(cache_dtype: KVCacheDType = "auto") -> MLAKVCacheWriter:
    """The MLA writer for a cache dtype: ``fp8_ds_mla`` packs 656-byte entries, the
    others (``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) store the latent row."""
    if cache_dtype == "fp8_ds_mla":
        return FP8DsMLACacheWriter()
    writer = MLALatentCacheWriter()
    if cache_dtype not in writer.cache_dtypes:
        raise KVCacheWriteError("cache_dtype", cache_dtype,
                                f"one of {', '.join(writer.cache_dtypes)} or fp8_ds_mla for MLA")
    return writer


def reference_write(
    layout: KVCacheLayout,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: KVQuant,
) -> None:
    """Write with the torch reference of ``layout`` (any device), after the same checks.

    For the MLA layouts ``key`` is ``kv_c_normed`` and ``value`` is ``k_pe``.
    """
    writer = _mla_writer(layout) if layout in MLA_LAYOUTS else _kv_writer(layout)
    writer.write(key, value, kv_cache, slot_mapping, quant, path="torch")
