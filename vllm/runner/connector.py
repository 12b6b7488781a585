"""KV connectors: code that sees every layer's cache right after its write.

The attention layer calls ``kv_connector.on_kv_written(layer_name, kv_cache,
slot_mapping)`` (``vllm.attention.layer``) for the connector the runner puts in
the ForwardContext; that is the one hook. A connector that also has
``register_kv_caches`` learns each layer's cache geometry once, before the first step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from vllm.forward_context import KVConnector

__all__ = ["CPUMirrorConnector", "KVConnector", "RegisteredKVCache", "RegistersKVCaches"]


@dataclass(frozen=True)
class RegisteredKVCache:
    """One layer's cache as the runner allocated it.

    ``block_axis``: the axis of ``kv_cache`` that indexes blocks (not always 0:
    K/V-first layouts put it at 1); ``kv_cache.select(block_axis, b)`` is block ``b``.
    """

    kv_cache: torch.Tensor
    block_size: int
    block_axis: int
    backend_name: str


@runtime_checkable
class RegistersKVCaches(Protocol):
    def register_kv_caches(self, caches: Mapping[str, RegisteredKVCache]) -> None: ...


class CPUMirrorConnector:
    """Mirrors every written block to CPU memory (what a KV offloader does first).

    ``mirrors[layer]`` is a CPU tensor shaped like the layer's cache; after each
    write the blocks holding a written slot are copied whole. ``written_blocks``
    records which blocks each layer has mirrored.
    """

    def __init__(self) -> None:
        self.mirrors: dict[str, torch.Tensor] = {}
        self.written_blocks: dict[str, set[int]] = {}
        self.num_calls = 0
        self._caches: dict[str, RegisteredKVCache] = {}

    def register_kv_caches(self, caches: Mapping[str, RegisteredKVCache]) -> None:
        for name, info in caches.items():
            self._caches[name] = info
            self.mirrors[name] = torch.zeros(info.kv_cache.shape, dtype=info.kv_cache.dtype,
                                             device="cpu")
            self.written_blocks[name] = set()

    def on_kv_written(self, layer_name: str, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """Copy the blocks of ``slot_mapping``'s non-negative slots (int64 ``[T]``)."""
        self.num_calls += 1
        info = self._caches.get(layer_name)
        if info is None:
            return  # a layer the runner did not register (not ours to mirror)
        slots = slot_mapping[slot_mapping >= 0]
        if slots.numel() == 0:
            return
        blocks = torch.unique(slots // info.block_size)
        mirror = self.mirrors[layer_name]
        src = kv_cache.index_select(info.block_axis, blocks)
        mirror.index_copy_(info.block_axis, blocks.cpu(), src.cpu())
        self.written_blocks[layer_name].update(int(b) for b in blocks.tolist())


def _check_protocol(c: CPUMirrorConnector) -> KVConnector:
    return c  # mypy: CPUMirrorConnector satisfies the ForwardContext's KVConnector
