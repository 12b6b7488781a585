"""A legacy *fused* backend, written as backends were before the split:
``forward()`` appends K/V to the cache from ``attn_metadata.slot_mapping`` and
then computes. It imports nothing from the new write path; it only runs
through ``shim.adapt_legacy_backend``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.ops.reference import attend


@dataclass
class FusedLegacyMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    slot_mapping: torch.Tensor


class FusedLegacyBuilder:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(self, common_prefix_len: int, common_attn_metadata: Any) -> FusedLegacyMetadata:
        c = common_attn_metadata
        return FusedLegacyMetadata(c.query_start_loc_cpu, c.seq_lens_cpu, c.block_table,
                                   c.num_reqs, c.slot_mapping)


class FusedLegacyImpl:
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = "decoder",
                 kv_sharing_target_layer_name: str | None = None) -> None:
        self.num_heads = num_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: FusedLegacyMetadata, output: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
        bs = key_cache.shape[1]
        if self.kv_sharing_target_layer_name is None:
            # the old fused write
            slots = attn_metadata.slot_mapping
            n = slots.shape[0]
            keep = slots >= 0
            key_cache[slots[keep] // bs, slots[keep] % bs] = key[:n][keep]
            value_cache[slots[keep] // bs, slots[keep] % bs] = value[:n][keep]
        starts = attn_metadata.query_start_loc_cpu.tolist()
        lens = attn_metadata.seq_lens_cpu.tolist()
        for i in range(attn_metadata.num_reqs):
            qs, qe, length = starts[i], starts[i + 1], lens[i]
            nblk = -(-length // bs)
            ids = attn_metadata.block_table[i, :nblk].long()
            k = key_cache[ids].flatten(0, 1)[:length].float()
            v = value_cache[ids].flatten(0, 1)[:length].float()
            out = attend(query[qs:qe].float(), k, v, scale=self.scale, causal=True,
                         sliding_window=self.sliding_window,
                         logits_soft_cap=self.logits_soft_cap)
            output[qs:qe] = out.to(output.dtype)
        return output


class FusedLegacyBackend:
    @staticmethod
    def get_name() -> str:
        return "EXAMPLE_LEGACY_FUSED"

    @staticmethod
    def get_impl_cls() -> type[FusedLegacyImpl]:
        return FusedLegacyImpl

    @staticmethod
    def get_metadata_cls() -> type[FusedLegacyMetadata]:
        return FusedLegacyMetadata

    @staticmethod
    def get_builder_cls() -> type[FusedLegacyBuilder]:
        return FusedLegacyBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_dtypes() -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]
