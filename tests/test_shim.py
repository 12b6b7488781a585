"""The compatibility adapter: bit-identical results, one warning, clear errors."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch

from shim import (
    LegacyBackendRuntimeError,
    LegacyBackendWarning,
    LegacyCommonAttentionMetadata,
    LegacyGeneration,
    adapt_legacy_backend,
)
from tests.helpers import fill_random_bytes, raw
from tests.legacy_backends.flagged import FlaggedLegacyBackend
from tests.legacy_backends.fused import FusedLegacyBackend
from vllm.attention import LegacyBackendError, allocate_kv_cache
from vllm.attention.batch import make_paged_batch
from vllm.attention.layer import Attention
from vllm.forward_context import set_forward_context

LEGACY = [FusedLegacyBackend, FlaggedLegacyBackend]


def _adapt_quietly(cls: type) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyBackendWarning)
        return adapt_legacy_backend(cls)


@pytest.mark.usefixtures("fresh_legacy_warnings")
@pytest.mark.parametrize("legacy", LEGACY, ids=lambda c: c.get_name())
def test_warns_once_per_class_naming_backend_change_and_guide(legacy: type) -> None:
    with pytest.warns(LegacyBackendWarning) as record:
        adapted = adapt_legacy_backend(legacy)
    assert len(record) == 1
    w = record[0]
    assert issubclass(w.category, FutureWarning)
    text = str(w.message)
    assert legacy.get_name() in text and legacy.__qualname__ in text
    assert "get_kv_cache_writer" in text and "migration_guide.md" in text
    assert w.filename == __file__, "the warning must point at the caller's file"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adapt_legacy_backend(legacy) is adapted  # second time: no warning, same class
    assert adapted.migration == "adapted"


def _run_legacy_directly(legacy: Any, cache: torch.Tensor, batch: Any, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    common = LegacyCommonAttentionMetadata.from_new(batch.common, batch.new_slots)
    meta = legacy.get_builder_cls()(torch.device("cpu")).build(0, common)
    impl = legacy.get_impl_cls()(num_heads=q.shape[1], head_size=q.shape[2], scale=0.25,
                                 num_kv_heads=k.shape[1], alibi_slopes=None,
                                 sliding_window=None, kv_cache_dtype="auto")
    if not getattr(legacy, "forward_includes_kv_cache_update", True):
        impl.do_kv_cache_update(None, k, v, cache, batch.new_slots)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    return impl.forward(None, q, k, v, cache, meta, out)


@pytest.mark.parametrize("legacy", LEGACY, ids=lambda c: c.get_name())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_identical_to_running_the_legacy_backend_directly(legacy: Any,
                                                              dtype: torch.dtype) -> None:
    adapted = _adapt_quietly(legacy)
    g = torch.Generator().manual_seed(11)
    bs, h, d = 16, 2, 16
    batch = make_paged_batch([5, 1, 1], [0, 17, 40], block_size=bs, generator=g)
    n = batch.common.num_actual_tokens
    q = torch.randn(n, 4, d, generator=g).to(dtype)
    k = torch.randn(n + 2, h, d, generator=g).to(dtype)  # two padded rows
    v = torch.randn(n + 2, h, d, generator=g).to(dtype)
    caches = []
    for _ in range(2):
        c = allocate_kv_cache(adapted, num_blocks=batch.num_blocks, block_size=bs,
                              num_kv_heads=h, head_size=d, model_dtype=dtype, device="cpu")
        fill_random_bytes(c, 2)
        caches.append(c)
    # the context was written in earlier steps, by the same legacy write
    direct_ctx = dataclasses.replace(batch, new_slots=batch.context_slots)
    kc = torch.randn(batch.context_slots.numel(), h, d, generator=g).to(dtype)
    for c in caches:
        _run_legacy_directly(legacy, c, dataclasses.replace(
            direct_ctx, common=dataclasses.replace(batch.common, num_reqs=0)),
            q[:0], kc, kc)
    want = _run_legacy_directly(legacy, caches[0], batch, q, k[:n], v[:n])
    layer = Attention(num_heads=4, num_kv_heads=h, head_size=d, scale=0.25, backend=adapted,
                      layer_name="l0")
    layer.bind_kv_cache(caches[1], bs)
    meta = adapted.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
    assert not hasattr(meta, "slot_mapping")
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"l0": batch.new_slots}):
        got = layer(q, k, v)
    assert torch.equal(raw(caches[0]), raw(caches[1])), "cache differs from the legacy run"
    assert torch.equal(got, want), "output differs from the legacy run"


def test_generations_detected() -> None:
    assert _adapt_quietly(FusedLegacyBackend).legacy_generation is LegacyGeneration.FUSED
    assert _adapt_quietly(FlaggedLegacyBackend).legacy_generation is LegacyGeneration.FLAGGED


class _FlagWithoutWrite(FusedLegacyBackend):
    forward_includes_kv_cache_update = False


class _WriteWithoutFlag(FlaggedLegacyBackend):
    forward_includes_kv_cache_update = True


class _NotABackend:
    @staticmethod
    def get_name() -> str:
        return "X"


class _UnknownLayout(FusedLegacyBackend):
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, 2 * head_size)


@pytest.mark.parametrize(
    "cls, match",
    [(_FlagWithoutWrite, "no do_kv_cache_update.*never be written"),
     (_WriteWithoutFlag, "write would run twice"),
     (_NotABackend, "missing get_impl_cls"),
     (_UnknownLayout, "declare kv_cache_layout"),
     (42, "expected a legacy backend class")],
    ids=["flag_without_write", "write_without_flag", "not_a_backend", "unknown_layout", "int"],
)
def test_inconsistent_declarations_are_errors_at_adaptation(cls: Any, match: str) -> None:
    with pytest.raises(LegacyBackendError, match=match):
        adapt_legacy_backend(cls)


class _ExplodingImpl:
    def __init__(self, **kwargs: Any) -> None:
        pass

    def forward(self, *args: Any) -> torch.Tensor:
        raise ZeroDivisionError("legacy bug")


class _Exploding(FusedLegacyBackend):
    @staticmethod
    def get_name() -> str:
        return "EXPLODING_LEGACY"

    @staticmethod
    def get_impl_cls() -> type:
        return _ExplodingImpl


def test_legacy_backend_that_raises_mid_forward() -> None:
    adapted = _adapt_quietly(_Exploding)
    batch = make_paged_batch([2], [0], block_size=16)
    layer = Attention(num_heads=2, head_size=8, scale=1.0, backend=adapted, layer_name="l0")
    cache = allocate_kv_cache(adapted, num_blocks=batch.num_blocks, block_size=16,
                              num_kv_heads=2, head_size=8, model_dtype=torch.float32,
                              device="cpu")
    layer.bind_kv_cache(cache, 16)
    meta = adapted.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
    x = torch.randn(2, 2, 8)
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"l0": batch.new_slots}):
        with pytest.raises(LegacyBackendRuntimeError, match="EXPLODING_LEGACY.*ZeroDivisionError"):
            layer(x, x, x)
    assert issubclass(LegacyBackendRuntimeError, RuntimeError)


def test_deprecated_legacy_write_op_warns_and_writes() -> None:
    from shim.legacy import reshape_and_cache_flash

    kc = torch.zeros(2, 4, 1, 2)
    vc = torch.zeros(2, 4, 1, 2)
    k = torch.randn(2, 1, 2)
    with pytest.warns(LegacyBackendWarning, match="KVCacheWriter.*migration_guide.md"):
        reshape_and_cache_flash(k, k, kc, vc, torch.tensor([5, -1]), "auto",  # type: ignore[deprecated]
                                torch.ones(1), torch.ones(1))
    assert torch.equal(kc[1, 1], k[0]) and int((kc != 0).sum()) == 2
