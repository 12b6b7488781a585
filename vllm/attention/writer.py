"""The write capability: appending this step's K/V to the paged cache.

Semantics shared by every writer (``docs/architecture.md``):

* ``slot = block_id * block_size + offset``; token ``i`` goes to ``slot_mapping[i]``;
  a negative slot means "skip".
* ``num_tokens = slot_mapping.shape[0]``; rows of ``key``/``value`` past it are
  ignored (CUDA-graph padding).
* Nothing outside the named slots changes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from vllm.attention.types import KVQuant


@runtime_checkable
class KVCacheWriter(Protocol):
    """Writes K/V into one layer's cache."""

    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        quant: KVQuant,
    ) -> None:
        """Store ``key``/``value`` rows at ``slot_mapping``.

        Args:
            key: ``[>= num_tokens, num_kv_heads, head_size]``, fp32/fp16/bf16.
            value: ``[>= num_tokens, num_kv_heads, head_size_v]``, same dtype as ``key``.
            kv_cache: the layer's cache in its backend's logical shape.
            slot_mapping: ``[num_tokens]`` int64; negative entries are skipped.
            quant: cache format and scales.
        """
        ...


@runtime_checkable
class MLAKVCacheWriter(Protocol):
    """Writes the MLA latent and its rotary part into one layer's cache."""

    def write(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        quant: KVQuant,
    ) -> None:
        """Store one latent row per token at ``slot_mapping``.

        Args:
            kv_c_normed: ``[>= num_tokens, kv_lora_rank]``, fp32/fp16/bf16.
            k_pe: ``[>= num_tokens, rope_dim]`` (a middle axis of size 1 is accepted).
            kv_cache: ``(nb, bs, kv_lora_rank + rope_dim)`` or ``(nb, bs, 656)`` uint8.
            slot_mapping: ``[num_tokens]`` int64; negative entries are skipped.
            quant: cache format; ``k_scale`` scales both parts.
        """
        ...
