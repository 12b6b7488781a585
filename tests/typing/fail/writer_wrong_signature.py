from __future__ import annotations

import torch

from vllm.attention import KVCacheWriter, MLAKVCacheWriter


class MissingQuant:
    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        pass


class SlotsAsList:
    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: list[int], quant: object) -> None:
        pass


a: KVCacheWriter = MissingQuant()  # E: assignment
b: KVCacheWriter = SlotsAsList()  # E: assignment
c: MLAKVCacheWriter = MissingQuant()  # E: assignment
