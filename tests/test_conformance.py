"""The conformance kit catches what it claims to: each deliberately broken
backend below fails with the matching message; TORCH_REF passes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from vllm.attention import KVQuant
from vllm.attention.backend import (
    AttentionLayerProtocol,
    AttentionLayerSpec,
    PagedAttentionMetadata,
)
from vllm.attention.backends.torch_ref import TorchRefBackend, TorchRefImpl
from vllm.attention.conformance import (
    CheckConfig,
    check_backend,
    check_config,
    conformance_grid,
)
from vllm.attention.types import AttentionType
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


class _NoSlidingWindowImpl(TorchRefImpl):
    """Computes as if the layer had no sliding window."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(dataclasses.replace(spec, sliding_window=None))


class _NoSoftCapImpl(TorchRefImpl):
    """Computes as if the layer had no logits soft cap."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(dataclasses.replace(spec, logits_soft_cap=None))


class _AlwaysCausalImpl(TorchRefImpl):
    """Applies the causal mask to encoder attention too."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        super().__init__(dataclasses.replace(spec, attn_type=AttentionType.DECODER))

    def forward(self, layer: AttentionLayerProtocol, query: torch.Tensor,
                key: torch.Tensor | None, value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: PagedAttentionMetadata, output: torch.Tensor) -> torch.Tensor:
        causal = dataclasses.replace(attn_metadata, causal=True)
        return super().forward(layer, query, key, value, kv_cache, causal, output)


@pytest.mark.parametrize(("impl", "exercises", "feature", "declaration"), [
    (_NoSlidingWindowImpl, lambda c: c.sliding_window is not None, "sliding_window=21",
     "supports_sliding_window = False"),
    (_NoSoftCapImpl, lambda c: c.logits_soft_cap is not None, "logits_soft_cap=7.5",
     "supports_logits_soft_cap = False"),
    (_AlwaysCausalImpl, lambda c: c.attn_type is AttentionType.ENCODER, "attn_type=encoder",
     "leaves AttentionType.ENCODER out of attention_types"),
], ids=["sliding_window", "logits_soft_cap", "encoder"])
def test_a_failure_names_the_feature_and_its_opt_out(
        impl: type[TorchRefImpl], exercises: Callable[[CheckConfig], bool], feature: str,
        declaration: str) -> None:
    backend = _variant("IGNORES", impl=impl)
    grid = conformance_grid(backend, "cpu")
    [with_feature] = [cfg for cfg in grid if exercises(cfg)]
    [message] = check_config(backend, with_feature)
    assert "compute: relative error" in message
    assert f"the configuration exercises {feature}" in message
    assert declaration in message
    assert f"the output matches attention without {feature}" in message
    assert message.endswith("the impl ignores it")
    # the configurations without the feature pass: the kit blames only the feature
    assert all(check_config(backend, cfg) == [] for cfg in grid[:3])


def test_a_wrong_result_names_what_the_configuration_exercises() -> None:
    backend = _variant("WRONG_SCALE", impl=_WrongScaleImpl)
    cfg = next(c for c in conformance_grid(backend, "cpu")
               if c.cache_dtype == "fp8_e4m3" and c.num_kv_heads == 2)
    [message] = check_config(backend, cfg)
    assert "kv_cache_dtype='fp8_e4m3' with per-kv-head scales" in message
    assert "leaves 'fp8_e4m3' out of supported_kv_cache_dtypes" in message
    assert "GQA: 4 query heads per kv head" in message
    assert "prefill, chunked prefill and decode requests" in message
    assert "the output matches attention without" not in message  # no option to blame


class _RaisingPath(TorchRefBackend):
    name: ClassVar[str] = "RAISING_PATH"

    @classmethod
    def compute_path(cls, device: torch.device) -> str:
        raise RuntimeError("vendor probe crashed")


def test_a_hook_that_raises_is_a_failure_of_that_backend() -> None:
    report = check_backend(_RaisingPath, "cpu")
    assert report.failures == ["RAISING_PATH: raised RuntimeError: vendor probe crashed"]


def test_an_mla_failure_names_what_the_configuration_exercises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.mla.test_conformance import _WrongScale
    from vllm.attention.conformance_mla import MLACheckConfig, check_mla_config
    from vllm.attention.registry import get_backend

    backend = get_backend("TRITON_MLA")
    monkeypatch.setattr(backend, "get_impl_cls", classmethod(lambda cls: _WrongScale))
    cfg = MLACheckConfig("TRITON_MLA", "cpu", torch.bfloat16, "fp8", 16)
    [message] = check_mla_config(backend, cfg)
    assert "relative error" in message
    assert ("the configuration exercises kv_cache_dtype='fp8' scaled by k_scale (a backend "
            "without it leaves 'fp8' out of supported_kv_cache_dtypes)") in message
    assert "kv_lora_rank=512, rope_dim=64" in message


def test_an_mla_backend_that_admits_no_mla_head_is_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.attention.backend import exactly
    from vllm.attention.registry import get_backend

    backend = get_backend("TRITON_MLA")
    monkeypatch.setattr(backend, "head_sizes", exactly(128))
    report = check_backend(backend, "cpu")
    assert report.failures == [
        "TRITON_MLA.head_sizes: got '128', expected sizes admitting the kit's "
        "kv_lora_rank + rope_dim = 576"]
