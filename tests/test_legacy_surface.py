"""The legacy surface's conventions: what upstream vLLM's code hands to a write, its
string attention types and cache dtype spellings, its registration rules, and the
layer view a legacy impl is called with. (The backends written against upstream's interface
are run in ``tests/test_legacy_upstream.py``.)"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.helpers import fill_random_bytes, raw
from vllm.attention import (
    AttentionType,
    InvalidArgumentError,
    KVQuant,
    allocate_kv_cache,
    registry,
)
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.errors import BackendRegistrationError, LegacyBackendError
from vllm.attention.writers.readback import reference_write
from vllm.attention.types import KVCacheLayout


def test_attention_type_members_are_upstreams_strings() -> None:
    assert AttentionType.DECODER == "decoder" and "encoder_only" == AttentionType.ENCODER_ONLY
    from vllm.v1.attention.backend import AttentionType as Legacy

    assert Legacy is AttentionType
    assert "decoder" in TorchRefBackend.attention_types  # a str set member compares too


def _split_caches(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two byte-identical ``(nb, 2, bs, H, D)`` caches of random bytes."""
    caches = []
    for _ in range(2):
        c = torch.empty(5, 2, 16, 2, 32, dtype=dtype)
        fill_random_bytes(c, seed)
        caches.append(c)
    return caches[0], caches[1]


@pytest.mark.parametrize("spelling", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_custom_ops_write_takes_uint8_fp8_caches_and_0d_scales(spelling: str) -> None:
    """vLLM holds an fp8 cache as uint8 and passes ``layer._k_scale`` (0-d)."""
    from vllm import _custom_ops as ops

    fp8 = torch.float8_e5m2 if spelling == "fp8_e5m2" else torch.float8_e4m3fn
    got, want = _split_caches(fp8, 3)
    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(9, 2, 32, generator=g), torch.randn(9, 2, 32, generator=g)
    slots = torch.tensor([3, -1, 17, 40, 41, -1, 79, 0, -1])
    k_scale, v_scale = torch.tensor(0.37), torch.tensor(1.5)
    quant = KVQuant(spelling, k_scale, v_scale)  # type: ignore[arg-type]
    assert quant.k_scale.shape == (1,) and quant.k_scale.data_ptr() == k_scale.data_ptr()
    reference_write(KVCacheLayout.SPLIT_NHD, key, value, want, slots, quant)
    as_bytes = got.view(torch.uint8)
    ops.reshape_and_cache_flash(key, value, as_bytes[:, 0], as_bytes[:, 1], slots,  # type: ignore[deprecated]
                                spelling, k_scale, v_scale)
    assert torch.equal(raw(got), raw(want))


def test_custom_ops_legacy_paged_and_mla_writes_match_the_reference() -> None:
    from vllm import _custom_ops as ops
    from vllm.attention.layouts import legacy_paged_views

    g = torch.Generator().manual_seed(5)
    caches = [torch.empty(2, 6, 16 * 2 * 32, dtype=torch.bfloat16) for _ in range(2)]
    for c in caches:
        fill_random_bytes(c, 6)
    key = torch.randn(7, 2, 32, generator=g).bfloat16()
    value = torch.randn(7, 2, 32, generator=g).bfloat16()
    slots = torch.tensor([5, -1, 33, 60, 95, -1, 16])
    quant = KVQuant.unscaled()
    reference_write(KVCacheLayout.LEGACY_PAGED, key, value, caches[1], slots, quant)
    k5, v4 = legacy_paged_views(caches[0], 2, 32)
    ops.reshape_and_cache(key, value, k5, v4, slots, "auto", torch.tensor(1.0),  # type: ignore[deprecated]
                          torch.tensor(1.0))
    assert torch.equal(raw(caches[0]), raw(caches[1]))

    mla = [torch.empty(4, 16, 512 + 64, dtype=torch.uint8) for _ in range(2)]
    for c in mla:
        fill_random_bytes(c, 7)
    kv_c = torch.randn(5, 512, generator=g).bfloat16()
    k_pe = torch.randn(5, 64, generator=g).bfloat16()
    mslots = torch.tensor([1, 63, -1, 20, 40])
    scale = torch.tensor(0.5)
    mla_quant = KVQuant("fp8", scale, scale)
    reference_write(KVCacheLayout.MLA_LATENT, kv_c, k_pe, mla[1].view(torch.float8_e4m3fn),
                    mslots, mla_quant)
    ops.concat_and_cache_mla(kv_c, k_pe, mla[0], mslots, "fp8", scale)  # type: ignore[deprecated]
    assert torch.equal(raw(mla[0]), raw(mla[1]))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_kvquant_refuses_scales_that_cannot_scale(bad: float) -> None:
    with pytest.raises(InvalidArgumentError, match="k_scale.*positive, finite"):
        KVQuant("fp8", torch.tensor([bad]), torch.ones(1))


def test_vllm_cache_dtype_spellings_for_every_backend() -> None:
    fa = registry.get_backend("FLASH_ATTN")
    assert fa.unsupported_reasons(dtype=torch.bfloat16, head_size=64, block_size=16,
                                  kv_cache_dtype="fp8_e4m3") == []
    assert fa.unsupported_reasons(dtype=torch.bfloat16, head_size=64, block_size=16,
                                  kv_cache_dtype="bfloat16") == []
    mismatch = fa.unsupported_reasons(dtype=torch.float16, head_size=64, block_size=16,
                                      kv_cache_dtype="bfloat16")
    assert len(mismatch) == 1 and "kv_cache_dtype='bfloat16'" in mismatch[0]
    cache = allocate_kv_cache(fa, num_blocks=2, block_size=16, num_kv_heads=1, head_size=64,
                              cache_dtype="fp8_e4m3", model_dtype=torch.bfloat16,
                              device="cpu")
    assert cache.dtype == torch.float8_e4m3fn
    for name in registry.in_tree_names():
        backend = registry.get_backend(name)
        declared = backend.supported_kv_cache_dtypes
        if declared & {"fp8", "fp8_e4m3"}:  # E4M3 under either spelling: both are taken
            for spelling in ("fp8", "fp8_e4m3"):
                assert backend.cache_dtype_spelling(spelling) in declared & {"fp8", "fp8_e4m3"}
        assert backend.cache_dtype_spelling("bfloat16", torch.bfloat16) == "auto", name


def test_a_layer_keeps_the_spelling_its_backend_declares() -> None:
    from vllm.attention.layer import Attention

    fa = registry.get_backend("FLASH_ATTN")
    layer = Attention(num_heads=4, num_kv_heads=2, head_size=64, scale=0.1, backend=fa,
                      layer_name="spelled", kv_cache_dtype="fp8_e4m3")
    assert layer.spec.kv_cache_dtype == "fp8" and layer.kv_quant.kv_cache_dtype == "fp8"


def test_a_legacy_shaped_new_style_class_is_told_which_base_to_use() -> None:
    from vllm.attention import AttentionBackend
    from tests.legacy_backends.flagged import FlaggedLegacyBackend as Legacy

    class Halfway(AttentionBackend[Any]):  # type: ignore[type-arg]
        """The new base, but written the old way: staticmethods, no class data."""

        forward_includes_kv_cache_update = False
        get_name = staticmethod(Legacy.get_name)
        get_impl_cls = staticmethod(Legacy.get_impl_cls)  # type: ignore[assignment]
        get_builder_cls = staticmethod(Legacy.get_builder_cls)  # type: ignore[assignment]
        get_kv_cache_shape = staticmethod(Legacy.get_kv_cache_shape)  # type: ignore[assignment]

    with pytest.raises(BackendRegistrationError) as info:
        registry.register_backend(Halfway)
    text = str(info.value)
    assert "Halfway" in text and "vllm.v1.attention.backend.AttentionBackend" in text
    assert "name" in text and "kv_cache_layout" in text


def test_registering_a_taken_name_says_how_to_pick_another() -> None:
    from tests.legacy_backends.fused import FusedLegacyBackend

    class Shadow(FusedLegacyBackend):
        @staticmethod
        def get_name() -> str:
            return "TORCH_REF"

    with pytest.raises(BackendRegistrationError) as info:
        registry.register_backend(Shadow)
    text = str(info.value)
    assert "'TORCH_REF' is already registered" in text and "name='MY_TORCH_REF'" in text
    assert registry.get_backend("TORCH_REF") is TorchRefBackend


@pytest.mark.usefixtures("fresh_legacy_warnings")
def test_first_use_warns_at_the_registration_line() -> None:
    from shim import LegacyBackendWarning
    from tests.legacy_backends.fused import FusedLegacyBackend
    from vllm.attention.layer import Attention

    class Registered(FusedLegacyBackend):
        @staticmethod
        def get_name() -> str:
            return "REGISTERED_HERE"

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapted = registry.register_backend(Registered); line = _line()  # noqa: E702
    try:
        with pytest.warns(LegacyBackendWarning) as record:
            Attention(num_heads=2, head_size=8, scale=1.0, backend=adapted, layer_name="r0")
        assert len(record) == 1
        assert (record[0].filename, record[0].lineno) == (__file__, line)
    finally:
        registry.unregister_backend("REGISTERED_HERE")


def _line() -> int:
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def test_the_layer_view_carries_upstreams_scales() -> None:
    """A legacy impl sees ``_k_scale`` 0-d (a view of the layer's), the floats, unit query
    and probability scales, and the layer's name."""
    from tests.legacy_backends.flagged import FlaggedLegacyBackend, FlaggedLegacyImpl
    from vllm.attention.layer import Attention

    seen: dict[str, Any] = {}

    class Peek(FlaggedLegacyImpl):
        def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                               kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
            seen.update(name=layer.layer_name, k=layer._k_scale, kf=layer._k_scale_float,
                        vf=layer._v_scale_float, q=layer._q_scale, p=layer._prob_scale,
                        cache=layer.kv_cache[0])

    class Peeking(FlaggedLegacyBackend):
        @staticmethod
        def get_name() -> str:
            return "PEEKING"

        @staticmethod
        def get_impl_cls() -> type[Peek]:
            return Peek

    import shim

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shim.LegacyBackendWarning)
        adapted = shim.adapt_legacy_backend(Peeking)
    layer = Attention(num_heads=2, head_size=8, scale=1.0, backend=adapted, layer_name="peek",
                      k_scale=0.25, v_scale=0.5)
    cache = allocate_kv_cache(adapted, num_blocks=3, block_size=16, num_kv_heads=2,
                              head_size=8, model_dtype=torch.float32, device="cpu")
    layer.bind_kv_cache(cache, 16)
    x = torch.randn(2, 2, 8)
    layer.kv_cache_writer.write(x, x, cache, torch.tensor([1, 2]), layer.kv_quant)
    assert seen["name"] == "peek" and seen["cache"] is cache
    assert seen["k"].shape == () and float(seen["k"]) == 0.25
    assert seen["k"].data_ptr() == layer.kv_quant.k_scale.data_ptr()
    assert (seen["kf"], seen["vf"]) == (0.25, 0.5)
    assert float(seen["q"]) == 1.0 and float(seen["p"]) == 1.0


def test_upstream_layer_class_is_not_built_by_hand() -> None:
    from vllm.model_executor.layers.attention import Attention as UpstreamLayer

    with pytest.raises(LegacyBackendError, match="vllm.attention.Attention"):
        UpstreamLayer(32, 128, 0.1, None, "auto")  # type: ignore[arg-type]
