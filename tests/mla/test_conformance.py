"""The MLA conformance kit passes for all eight backends on the CPU, and catches the
faults it exists to catch."""

from __future__ import annotations

import pytest
import torch

from tests.mla.helpers import MLA_NAMES
from vllm.attention.backends.mla.common import MLACommonImpl
from vllm.attention.conformance_mla import (
    MLACheckConfig,
    check_mla_backend,
    check_mla_config,
    mla_conformance_grid,
)
from vllm.attention.registry import get_backend


@pytest.mark.parametrize("name", MLA_NAMES)
def test_conformance_cpu(name: str) -> None:
    backend = get_backend(name)
    grid = mla_conformance_grid(backend, "cpu")
    assert {c.cache_dtype for c in grid} == set(backend.supported_kv_cache_dtypes)
    assert {c.block_size for c in grid} == set(backend.block_sizes.examples((1, 16, 32, 64, 128)))
    assert check_mla_backend(backend, "cpu") == []


def test_grid_ids() -> None:
    grid = mla_conformance_grid(get_backend("FLASHMLA_SPARSE"), "cpu")
    assert [c.id for c in grid] == [
        "FLASHMLA_SPARSE-cpu-bfloat16-auto-bs64", "FLASHMLA_SPARSE-cpu-bfloat16-fp8_ds_mla-bs64",
        "FLASHMLA_SPARSE-cpu-float16-auto-bs64", "FLASHMLA_SPARSE-cpu-float16-fp8_ds_mla-bs64",
    ]


class _WritesCache(MLACommonImpl):  # type: ignore[type-arg]
    def forward(self, layer, query, key, value, kv_cache, attn_metadata,  # type: ignore[no-untyped-def]
                output):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        kv_cache.view(torch.uint8)[0, 0, 0] ^= 1
        return out


class _WrongScale(MLACommonImpl):  # type: ignore[type-arg]
    def forward(self, layer, query, key, value, kv_cache, attn_metadata,  # type: ignore[no-untyped-def]
                output):
        return super().forward(layer, query * 1.5, key, value, kv_cache, attn_metadata, output)


@pytest.mark.parametrize("impl,expected", [
    (_WritesCache, "impl.forward changed the cache bytes"),
    (_WrongScale, "relative error"),
])
def test_kit_catches_faults(monkeypatch: pytest.MonkeyPatch, impl: type, expected: str) -> None:
    backend = get_backend("TRITON_MLA")
    monkeypatch.setattr(backend, "get_impl_cls", classmethod(lambda cls: impl))
    cfg = MLACheckConfig("TRITON_MLA", "cpu", torch.bfloat16, "auto", 16)
    failures = check_mla_config(backend, cfg)
    assert any(expected in f for f in failures), failures
