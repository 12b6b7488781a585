from __future__ import annotations

import torch

from vllm.attention import AttentionImpl, PagedAttentionMetadata
from vllm.attention.backend import AttentionLayerProtocol


class Impl(AttentionImpl[PagedAttentionMetadata]):
    def forward(self, layer: AttentionLayerProtocol, query: torch.Tensor,
                key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: PagedAttentionMetadata, output: torch.Tensor) -> torch.Tensor:
        slots = attn_metadata.slot_mapping  # E: attr-defined
        del slots
        return output
