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

from vllm.attention.rope import RoPE
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


@runtime_checkable
class FusedRoPEKVCacheWriter(KVCacheWriter, Protocol):
    """A :class:`KVCacheWriter` that can rotate (RoPE) while it writes: one kernel
    instead of a rotation kernel, a round trip of the keys, then the write.

    The layer uses it when ``supports_fused_rope`` is true and the model passes
    ``positions``; the result is byte-identical to rotating with
    :func:`vllm.attention.rope.rotate_reference` and then calling ``write``.
    """

    @property
    def supports_fused_rope(self) -> bool: ...

    def write_with_rope(
        self,
        query: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        quant: KVQuant,
        positions: torch.Tensor,
        rope: RoPE,
    ) -> None:
        """``write`` of the rotated keys, rotating ``query`` too.

        Args:
            query: ``[>= N, num_heads, head_size]`` or None; rows ``[0, N)`` are rotated
                in place (``N = positions.shape[0]``).
            key: ``[>= num_tokens, num_kv_heads, head_size]``; stored rotated, not modified.
            value, kv_cache, slot_mapping, quant: as :meth:`KVCacheWriter.write`.
            positions: ``[N >= num_tokens]`` int64 rows of ``rope.cos_sin_cache``.
            rope: the table and pairing style.
        """
        ...


@runtime_checkable
class FusedRoPEMLAKVCacheWriter(MLAKVCacheWriter, Protocol):
    """An :class:`MLAKVCacheWriter` that rotates ``k_pe`` (and the query's rope part)
    while it writes the latent row."""

    @property
    def supports_fused_rope(self) -> bool: ...

    def write_with_rope(
        self,
        query_pe: torch.Tensor | None,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        quant: KVQuant,
        positions: torch.Tensor,
        rope: RoPE,
    ) -> None:
        """``write`` with ``k_pe`` rotated; ``query_pe`` ``[>= N, num_heads, rope_dim]``
        (a view into the query is fine) rotated in place, or None."""
        ...
