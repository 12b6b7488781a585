"""A legacy *flagged* backend: ``forward_includes_kv_cache_update = False`` and the
write in ``impl.do_kv_cache_update``, on a K/V-first ``(2, nb, bs, H, D)`` cache.
Written as before the split; it runs only through ``shim.adapt_legacy_backend``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.ops.reference import attend


@dataclass
class FlaggedLegacyMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    causal: bool
    slot_mapping: torch.Tensor


class FlaggedLegacyBuilder:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(self, common_prefix_len: int, common_attn_metadata: Any) -> FlaggedLegacyMetadata:
        c = common_attn_metadata
        return FlaggedLegacyMetadata(c.query_start_loc_cpu, c.seq_lens_cpu, c.block_table,
                                     c.num_reqs, c.causal, c.slot_mapping)


class FlaggedLegacyImpl:
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = "decoder",
                 kv_sharing_target_layer_name: str | None = None) -> None:
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.causal = attn_type == "decoder"

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        bs = kv_cache.shape[2]
        for i, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            kv_cache[0, slot // bs, slot % bs] = key[i]
            kv_cache[1, slot // bs, slot % bs] = value[i]

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: FlaggedLegacyMetadata, output: torch.Tensor) -> torch.Tensor:
        bs = kv_cache.shape[2]
        starts = attn_metadata.query_start_loc_cpu.tolist()
        lens = attn_metadata.seq_lens_cpu.tolist()
        for i in range(attn_metadata.num_reqs):
            qs, qe, length = starts[i], starts[i + 1], lens[i]
            ids = attn_metadata.block_table[i, : -(-length // bs)].long()
            k = kv_cache[0][ids].flatten(0, 1)[:length].float()
            v = kv_cache[1][ids].flatten(0, 1)[:length].float()
            out = attend(query[qs:qe].float(), k, v, scale=self.scale,
                         causal=self.causal and attn_metadata.causal,
                         sliding_window=self.sliding_window,
                         logits_soft_cap=self.logits_soft_cap)
            output[qs:qe] = out.to(output.dtype)
        return output


class FlaggedLegacyBackend:
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "EXAMPLE_LEGACY_FLAGGED"

    @staticmethod
    def get_impl_cls() -> type[FlaggedLegacyImpl]:
        return FlaggedLegacyImpl

    @staticmethod
    def get_metadata_cls() -> type[FlaggedLegacyMetadata]:
        return FlaggedLegacyMetadata

    @staticmethod
    def get_builder_cls() -> type[FlaggedLegacyBuilder]:
        return FlaggedLegacyBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
