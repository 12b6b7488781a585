"""TREE_ATTN: speculative-decoding verification with a draft-tree mask, over a
K/V-first cache ``(2, nb, bs, H, D)``.

A request's new tokens are the nodes of a draft tree (a parent precedes its
children). Each node sees the whole context and, among the new tokens, itself and
its ancestors; requests without a tree (prefills, plain decodes) are causal. The
mask travels in :class:`TreeAttentionMetadata` as ``tree_mask``
(``[num_tokens, max_query_len]`` bool, packed by
:func:`~vllm.attention.ops.paged_attention.pack_tree_masks`); ``None`` means every
request is causal. The runner supplies trees in one of two ways:

* a static draft-tree shape for the whole model, ``draft_tree`` (parent index per
  node, ``-1`` for the root), given to the builder: every request whose query length
  equals the tree's node count and that has context gets that tree;
* per step, ``build(common, tree_masks=[mask_or_None, ...])``: one ``[q, q]`` mask
  per request, ``None`` for causal. This wins over ``draft_tree``.

Triton on CUDA, torch elsewhere (both take the tree mask). No sliding window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.attention.backend import (
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    PagedAttentionMetadata,
    SizeSpec,
    common_fields,
    multiple_of,
)
from vllm.attention.backends.standard import StandardBackend, StandardImpl
from vllm.attention.ops.paged_attention import pack_tree_masks, tree_ancestor_mask
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout


@dataclass(frozen=True, kw_only=True)
class TreeAttentionMetadata(PagedAttentionMetadata):
    """The paged batch plus the draft-tree mask of its tree requests."""

    tree_mask: torch.Tensor | None = None
    """``[num_tokens, max_query_len]`` bool on the compute device: row ``r`` (query
    token ``r``) marks which new tokens of its own request it sees; None: all causal."""


class TreeAttentionMetadataBuilder(AttentionMetadataBuilder[TreeAttentionMetadata]):
    """Builds the tree mask from a static ``draft_tree`` or per-step ``tree_masks``."""

    def __init__(self, spec: AttentionLayerSpec, device: torch.device, *,
                 draft_tree: Sequence[int] | None = None) -> None:
        super().__init__(spec, device)
        self.draft_tree = None if draft_tree is None else tuple(draft_tree)
        self._tree = None if draft_tree is None else tree_ancestor_mask(list(draft_tree))

    def build(self, common: CommonAttentionMetadata, *,
              tree_masks: Sequence[torch.Tensor | None] | None = None) -> TreeAttentionMetadata:
        qsl = common.query_start_loc_cpu.tolist()
        seq = common.seq_lens_cpu.tolist()
        qlens = [int(qsl[i + 1] - qsl[i]) for i in range(common.num_reqs)]
        masks = tree_masks
        if masks is None and self._tree is not None:
            n = self._tree.shape[0]
            masks = [self._tree if q == n and s > q else None for q, s in zip(qlens, seq)]
        packed = None
        if masks is not None and any(m is not None for m in masks):
            packed = pack_tree_masks(masks, qlens, device=common.query_start_loc.device)
        return TreeAttentionMetadata(**common_fields(common), tree_mask=packed)


class TreeAttentionBackend(StandardBackend[TreeAttentionMetadata]):
    name: ClassVar[str] = "TREE_ATTN"
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.SPLIT_KV_FIRST
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    head_sizes: ClassVar[SizeSpec] = multiple_of(8, max=256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset({AttentionType.DECODER})
    supports_sliding_window: ClassVar[bool] = False

    @classmethod
    def get_impl_cls(cls) -> type[TreeAttentionImpl]:
        return TreeAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[TreeAttentionMetadataBuilder]:
        return TreeAttentionMetadataBuilder

    @classmethod
    def get_metadata_cls(cls) -> type[TreeAttentionMetadata]:
        return TreeAttentionMetadata


class TreeAttentionImpl(StandardImpl[TreeAttentionMetadata]):
    backend = TreeAttentionBackend

    def tree_mask(self, meta: TreeAttentionMetadata) -> torch.Tensor | None:
        return meta.tree_mask
