"""OOT_MIGRATED: OOT_LEGACY after the migration (``migration_guide.md``).

What changed: the backend subclasses ``AttentionBackend[OOTMetadata]`` and
declares its capabilities as class data; the write moved out of ``forward()``
into the standard writer of its layout (``get_kv_cache_writer``); the metadata
lost ``slot_mapping``; the builder takes ``CommonAttentionMetadata``. What did
not: the cache layout ``(nb, 2, bs, H, D)`` and the compute, so outputs and cache
bytes are identical to the legacy backend's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    InvalidArgumentError,
    KVCacheDType,
    KVCacheLayout,
    KVCacheWriter,
    SizeSpec,
)
from vllm.attention.backend import AttentionLayerProtocol
from vllm.attention.writers import writer_for_layout


@dataclass(frozen=True, kw_only=True)
class OOTMetadata(AttentionMetadata):
    """What compute reads; the slot mapping stays in the ForwardContext."""

    query_start_loc_cpu: torch.Tensor
    """``[num_reqs + 1]`` int32, host."""
    seq_lens_cpu: torch.Tensor
    """``[num_reqs]`` int32, host."""
    block_table: torch.Tensor
    """``[num_reqs, max_blocks]`` int32, on the compute device."""
    num_reqs: int


class OOTMetadataBuilder(AttentionMetadataBuilder[OOTMetadata]):
    def build(self, common: CommonAttentionMetadata) -> OOTMetadata:
        return OOTMetadata(
            query_start_loc_cpu=common.query_start_loc_cpu, seq_lens_cpu=common.seq_lens_cpu,
            block_table=common.block_table, num_reqs=common.num_reqs,
        )


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: OOTMetadata, output: torch.Tensor, *, scale: float,
                    sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its pages, in float32.

    ``query``/``output``: ``[num_tokens, num_heads, head_size]``;
    ``key_cache``/``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]``.
    """
    bs = key_cache.shape[1]
    starts, lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    for i in range(meta.num_reqs):
        qs, qe, length = starts[i], starts[i + 1], lens[i]
        if qe == qs:
            continue
        blocks = meta.block_table[i, : -(-length // bs)].long()
        k = key_cache[blocks].flatten(0, 1)[:length].float()
        v = value_cache[blocks].flatten(0, 1)[:length].float()
        q = query[qs:qe].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        # The new tokens are the last qe - qs positions of the sequence.
        q_pos = torch.arange(length - (qe - qs), length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        output[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(output.dtype)
    return output


class OOTImpl(AttentionImpl[OOTMetadata]):
    """Compute only: the layer has already written this step's K/V."""

    def forward(
        self,
        layer: AttentionLayerProtocol,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: OOTMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache.unbind(1)
        return paged_attention(query, key_cache, value_cache, attn_metadata, output,
                               scale=self.spec.scale, sliding_window=self.spec.sliding_window,
                               soft_cap=self.spec.logits_soft_cap)


class MigratedBackend(AttentionBackend[OOTMetadata]):
    name: ClassVar[str] = "OOT_MIGRATED"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_NHD
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.float16, torch.bfloat16}
    )
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    head_sizes: ClassVar[SizeSpec] = SizeSpec(values=frozenset({64, 128, 256}))
    block_sizes: ClassVar[SizeSpec] = SizeSpec(values=frozenset({16, 32, 64}))

    @classmethod
    def get_impl_cls(cls) -> type[OOTImpl]:
        return OOTImpl

    @classmethod
    def get_builder_cls(cls) -> type[OOTMetadataBuilder]:
        return OOTMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[OOTMetadata]:
        return OOTMetadata

    @classmethod
    def get_kv_cache_writer(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheWriter:
        if cache_dtype not in cls.supported_kv_cache_dtypes:
            raise InvalidArgumentError(
                "cache_dtype", cache_dtype,
                f"one of {', '.join(sorted(cls.supported_kv_cache_dtypes))} for {cls.name}",
            )
        return writer_for_layout(cls.kv_cache_layout)
