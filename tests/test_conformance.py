"""The conformance kit catches what it claims to: each deliberately broken
backend below fails with the matching message; TORCH_REF passes."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from vllm.attention import KVQuant
from vllm.attention.backend import AttentionLayerProtocol, PagedAttentionMetadata
from vllm.attention.backends.torch_ref import TorchRefBackend, TorchRefImpl
from vllm.attention.conformance import check_backend
from vllm.attention.types import KVCacheDType
from vllm.attention.writer import KVCacheWriter
from vllm.attention.writers.split import SplitKVCacheWriter
from vllm.attention.types import KVCacheLayout


def test_torch_ref_conforms() -> None:
    report = check_backend("TORCH_REF", "cpu")
    assert report.ok, report.failures
    assert report.passed and report.compute_path == "torch"


class _SpillingWriter:
    """Writes the right rows, then also scribbles on the next slot."""

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant) -> None:
        SplitKVCacheWriter(KVCacheLayout.SPLIT_NHD).write(key, value, kv_cache, slot_mapping, quant)
        s = int(slot_mapping[slot_mapping >= 0][0])
        bs = kv_cache.shape[2]
        nxt = (s + 1) % (kv_cache.shape[0] * bs)
        kv_cache[nxt // bs, 0, nxt % bs] = 0


class _TruncatingWriter:
    """Rounds by truncation instead of to-nearest: wrong bytes for most values."""

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant) -> None:
        n = slot_mapping.shape[0]
        keep = slot_mapping >= 0
        s = slot_mapping[keep]
        bs = kv_cache.shape[2]
        for kv, x in ((0, key), (1, value)):
            rows = x[:n][keep].float()
            if kv_cache.dtype != rows.dtype:
                rows = rows.trunc()
            kv_cache[s // bs, kv, s % bs] = rows.to(kv_cache.dtype)


class _MutatingImpl(TorchRefImpl):
    def forward(self, layer: AttentionLayerProtocol, query: torch.Tensor,
                key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: PagedAttentionMetadata, output: torch.Tensor) -> torch.Tensor:
        kv_cache[0, 0, 0, 0, 0] += 1
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)


class _WrongScaleImpl(TorchRefImpl):
    def forward(self, layer: AttentionLayerProtocol, query: torch.Tensor,
                key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: PagedAttentionMetadata, output: torch.Tensor) -> torch.Tensor:
        return super().forward(layer, query * 1.1, key, value, kv_cache, attn_metadata, output)


class _LazyImpl(TorchRefImpl):
    """Leaves the last output row unwritten."""

    def forward(self, layer: AttentionLayerProtocol, query: torch.Tensor,
                key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: PagedAttentionMetadata, output: torch.Tensor) -> torch.Tensor:
        super().forward(layer, query[:-1], key, value, kv_cache, attn_metadata, output[:-1])
        return output


def _variant(name: str, *, writer: Any = None, impl: Any = None) -> Any:
    class Variant(TorchRefBackend):
        pass

    Variant.name = name  # type: ignore[misc]
    if writer is not None:
        Variant.get_kv_cache_writer = classmethod(lambda cls, cache_dtype="auto": writer())  # type: ignore[method-assign,assignment]
    if impl is not None:
        Variant.get_impl_cls = classmethod(lambda cls: impl)  # type: ignore[method-assign,assignment]
    return Variant


@pytest.mark.parametrize(
    "backend, message",
    [
        (_variant("SPILLING", writer=_SpillingWriter), "byte(s) differ"),
        (_variant("TRUNCATING", writer=_TruncatingWriter), "byte(s) differ"),
        (_variant("MUTATING", impl=_MutatingImpl), "changed the cache bytes"),
        (_variant("WRONG_SCALE", impl=_WrongScaleImpl), "relative error"),
        (_variant("LAZY", impl=_LazyImpl), "NaN"),
    ],
    ids=["writes_outside_slots", "wrong_rounding", "compute_mutates_cache",
         "compute_wrong", "output_unwritten"],
)
def test_kit_catches_broken_backends(backend: Any, message: str) -> None:
    report = check_backend(backend, "cpu", max_configs=4)
    assert not report.ok
    assert any(message in f for f in report.failures), report.failures
