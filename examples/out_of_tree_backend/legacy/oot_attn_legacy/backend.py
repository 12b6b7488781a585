"""OOT_LEGACY, written the way backends were before the KV-cache write was split out.

A *fused* backend: ``forward()`` appends this step's keys and values to the cache
from ``attn_metadata.slot_mapping``, then attends. Cache ``(nb, 2, bs, H, D)``
(``[:, 0]`` K, ``[:, 1]`` V). It imports nothing from ``vllm``: the registry runs
it through the ``shim`` adapter, which warns once. Its migrated form is the
``oot-attn-migrated`` distribution next to this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class OOTMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    slot_mapping: torch.Tensor


class OOTMetadataBuilder:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(self, common_prefix_len: int, common_attn_metadata: Any) -> OOTMetadata:
        c = common_attn_metadata
        return OOTMetadata(
            query_start_loc_cpu=c.query_start_loc_cpu, seq_lens_cpu=c.seq_lens_cpu,
            block_table=c.block_table, num_reqs=c.num_reqs, slot_mapping=c.slot_mapping,
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


class OOTImpl:
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = "decoder",
                 kv_sharing_target_layer_name: str | None = None) -> None:
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: OOTMetadata, output: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = kv_cache.unbind(1)
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            # the fused write: this is what the migration moves out of forward()
            slots = attn_metadata.slot_mapping
            n, bs = slots.shape[0], key_cache.shape[1]
            keep = slots >= 0
            blocks, offsets = slots[keep] // bs, slots[keep] % bs
            key_cache[blocks, offsets] = key[:n][keep]
            value_cache[blocks, offsets] = value[:n][keep]
        return paged_attention(query, key_cache, value_cache, attn_metadata, output,
                               scale=self.scale, sliding_window=self.sliding_window,
                               soft_cap=self.logits_soft_cap)


class LegacyBackend:
    @staticmethod
    def get_name() -> str:
        return "OOT_LEGACY"

    @staticmethod
    def get_impl_cls() -> type[OOTImpl]:
        return OOTImpl

    @staticmethod
    def get_metadata_cls() -> type[OOTMetadata]:
        return OOTMetadata

    @staticmethod
    def get_builder_cls() -> type[OOTMetadataBuilder]:
        return OOTMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_dtypes() -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return [64, 128, 256]

    @staticmethod
    def get_supported_block_sizes() -> list[int]:
        return [16, 32, 64]
