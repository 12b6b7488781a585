"""The pre-split world, as legacy backends knew it.

Legacy builders receive :data:`LegacyCommonAttentionMetadata` (upstream's
``CommonAttentionMetadata``), which still has ``slot_mapping``; legacy fused backends
may call :func:`reshape_and_cache_flash`.
Both exist only so old code runs unchanged through :func:`shim.adapt_legacy_backend`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from typing_extensions import deprecated

from shim.upstream.backend import CommonAttentionMetadata  # type: ignore[deprecated]
from shim.upstream.ops import write_flash_views
from shim.warnings import LegacyBackendWarning

LegacyCommonAttentionMetadata = CommonAttentionMetadata
"""What a legacy metadata builder is given: upstream's ``CommonAttentionMetadata``
(:mod:`shim.upstream.backend`), which still has ``slot_mapping``."""


class LegacyBuilder(Protocol):
    def build(self, common_prefix_len: int,
              common_attn_metadata: LegacyCommonAttentionMetadata) -> Any: ...


class LegacyImpl(Protocol):
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: Any,
                output: torch.Tensor) -> torch.Tensor: ...


@deprecated(
    "reshape_and_cache_flash() is the pre-split cache write; return a KVCacheWriter from "
    "AttentionBackend.get_kv_cache_writer() instead (see migration_guide.md)",
    category=LegacyBackendWarning,
)
def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """The legacy write op: ``key_cache``/``value_cache`` ``[nb, bs, H, D]`` views.

    Routed through the split K/V writer, so it has the new write semantics (and vLLM's
    conventions: a ``uint8`` fp8 cache, 0-d scales).
    """
    write_flash_views(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                      k_scale, v_scale)
