"""The bad-input catalogue (``docs/errors.md``): malformed calls across the public API.

Each entry makes one malformed call and requires:

* an error of the project's hierarchy (:class:`vllm.attention.AttentionError`, each
  class also a standard ``ValueError`` / ``TypeError`` / ``LookupError`` /
  ``RuntimeError`` / ``ImportError``), of the class the docs name;
* a message naming the argument, the value seen and what is allowed (``mentions``);
* every cache the call could reach byte-identical afterwards (except where the
  docs say the write precedes the failure: then the cache holds exactly the write);
* the process keeps working: a valid step through the same layer then writes and
  attends correctly, and no forward context is left active.

``test_docs_and_catalogue_agree`` checks the ids and error classes of
``docs/errors.md`` against this list, both ways.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import shim
from shim import LegacyBackendRuntimeError, LegacyBackendWarning, adapt_legacy_backend
from tests.helpers import fill_random_bytes, raw
from tests.legacy_backends.flagged import FlaggedLegacyBackend, FlaggedLegacyImpl
from tests.legacy_backends.fused import FusedLegacyBackend
from vllm.attention import (
    AttentionError,
    AttentionMetadata,
    BackendNotFoundError,
    ForwardContextError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheLayout,
    KVCacheWriteError,
    KVQuant,
    LegacyBackendError,
    NoBackendError,
    PluginLoadError,
    UnsupportedBackendError,
    allocate_kv_cache,
    registry,
)
from vllm.attention.backend import multiple_of
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.batch import make_paged_batch
from vllm.attention.errors import BackendRegistrationError
from vllm.attention.layer import Attention
from vllm.attention.writers import (
    AiterShuffledKVCacheWriter,
    DiffKVCacheWriter,
    FP8DsMLACacheWriter,
    LegacyPagedKVCacheWriter,
    MLALatentCacheWriter,
    PerTokenHeadKVCacheWriter,
    writer_for_layout,
)
from vllm.attention.writers.readback import read_slots
from vllm.forward_context import get_forward_context, is_forward_context_available, set_forward_context

DOCS = Path(__file__).resolve().parent.parent / "docs" / "errors.md"
BS, H, D = 16, 2, 8
L = KVCacheLayout


class World:
    """One TORCH_REF layer ``l0`` with a bound cache of random bytes, a batch, inputs,
    and every other cache a call creates (``watch``), snapshotted before the call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mp = monkeypatch
        gen = torch.Generator().manual_seed(3)
        self.batch = make_paged_batch([3, 1], [0, 5], block_size=BS, generator=gen)
        self.layer = Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.3,
                               backend=TorchRefBackend, layer_name="l0")
        self.cache = allocate_kv_cache(TorchRefBackend, num_blocks=self.batch.num_blocks,
                                       block_size=BS, num_kv_heads=H, head_size=D,
                                       model_dtype=torch.float32, device="cpu")
        self.watched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its bytes)
        self.watch(self.cache)
        self.layer.bind_kv_cache(self.cache, BS)
        self.meta = TorchRefBackend.get_builder_cls()(self.layer.spec, torch.device("cpu")).build(
            self.batch.common)
        self.slots = self.batch.new_slots
        n = self.slots.shape[0]
        self.q = torch.randn(n, 4, D, generator=gen)
        self.k = torch.randn(n, H, D, generator=gen)
        self.v = torch.randn(n, H, D, generator=gen)

    @property
    def num_slots(self) -> int:
        return self.batch.num_blocks * BS

    def watch(self, t: torch.Tensor) -> torch.Tensor:
        """Fill ``t`` with random bytes and remember them: a rejected call must leave
        ``t`` byte-identical (caches made inside a call are watched from creation)."""
        fill_random_bytes(t, 100 + len(self.watched))
        self.watched.append((t, raw(t).clone()))
        return t

    def context(self, **over: Any) -> Any:
        kw: dict[str, Any] = dict(attn_metadata={"l0": self.meta}, slot_mapping={"l0": self.slots})
        kw.update(over)
        return set_forward_context(**kw)

    def write(self, **over: Any) -> None:
        """The layer's writer with valid arguments, some replaced."""
        args: dict[str, Any] = dict(key=self.k, value=self.v, kv_cache=self.cache,
                                    slot_mapping=self.slots, quant=KVQuant.unscaled())
        args.update(over)
        self.layer.kv_cache_writer.write(**args)

    def forward(self, layer: Attention | None = None, **ctx: Any) -> torch.Tensor:
        with self.context(**ctx):
            return (layer or self.layer)(self.q, self.k, self.v)

    def checked_layer(self) -> Attention:
        layer = Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.3,
                          backend=TorchRefBackend, layer_name="l0", checked=True)
        layer.bind_kv_cache(self.cache, BS)
        return layer


def split_cache(w: World, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return w.watch(torch.empty(*shape, dtype=dtype))


def rows(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


class _OtherMetadata(AttentionMetadata):
    pass


class _Bs16Backend(TorchRefBackend):
    """TORCH_REF with FLASH_ATTN's block sizes: a backend that restricts them."""

    name: ClassVar[str] = "TORCH_REF_BS16"
    block_sizes = multiple_of(16)


class _ExplodingImpl:
    def __init__(self, **kwargs: Any) -> None:
        pass

    def forward(self, *args: Any) -> torch.Tensor:
        raise ZeroDivisionError("legacy bug")


class _ExplodingLegacy(FusedLegacyBackend):
    @staticmethod
    def get_name() -> str:
        return "EXPLODING_LEGACY"

    @staticmethod
    def get_impl_cls() -> type:
        return _ExplodingImpl


class _RaisingUpdateImpl(FlaggedLegacyImpl):
    def do_kv_cache_update(self, *args: Any) -> None:
        raise KeyError("legacy update bug")


class _RaisingUpdateLegacy(FlaggedLegacyBackend):
    @staticmethod
    def get_name() -> str:
        return "RAISING_UPDATE_LEGACY"

    @staticmethod
    def get_impl_cls() -> type:
        return _RaisingUpdateImpl


class _FlagWithoutUpdate(FusedLegacyBackend):
    forward_includes_kv_cache_update = False


class _UnknownLayoutLegacy(FusedLegacyBackend):
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, 3 * head_size)


def _adapted_layer(w: World, legacy: type) -> tuple[Attention, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyBackendWarning)
        adapted = adapt_legacy_backend(legacy)
    layer = Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.3, backend=adapted,
                      layer_name="l0")
    cache = w.watch(allocate_kv_cache(adapted, num_blocks=w.batch.num_blocks, block_size=BS,
                                      num_kv_heads=H, head_size=D, model_dtype=torch.float32,
                                      device="cpu"))
    layer.bind_kv_cache(cache, BS)
    meta = adapted.get_builder_cls()(layer.spec, torch.device("cpu")).build(w.batch.common)
    return layer, meta


def _broken_plugin(w: World) -> Callable[[], object]:
    fake = [metadata.EntryPoint("BROKEN_PLUGIN", "tests.no_such_plugin_module:Backend",
                                registry.ENTRY_POINT_GROUP)]
    w.mp.setattr(registry.importlib_metadata, "entry_points",
                 lambda *, group: fake if group == registry.ENTRY_POINT_GROUP else [])
    registry._reset_for_tests()
    return lambda: registry.get_backend("BROKEN_PLUGIN")


def _env_checked(w: World) -> Callable[[], object]:
    w.mp.setenv("VLLM_KV_CHECKED", "1")
    layer = Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.3,
                      backend=TorchRefBackend, layer_name="l0")
    layer.bind_kv_cache(w.cache, BS)
    bad = w.slots.clone()
    bad[1] = w.num_slots + 5
    return lambda: w.forward(layer, slot_mapping={"l0": bad})


def _out_of_range(w: World) -> Callable[[], object]:
    layer = w.checked_layer()
    bad = w.slots.clone()
    bad[0] = w.num_slots
    return lambda: w.forward(layer, slot_mapping={"l0": bad})


def _duplicates(w: World) -> Callable[[], object]:
    layer = w.checked_layer()
    dup = w.slots.clone()
    dup[2] = dup[0]
    return lambda: w.forward(layer, slot_mapping={"l0": dup})


def _unbound(w: World) -> Callable[[], object]:
    layer = Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.3,
                      backend=TorchRefBackend, layer_name="l0", checked=True)
    return lambda: w.forward(layer)


def _key_without_value(w: World) -> Callable[[], object]:
    def call() -> None:
        with w.context():
            w.layer(w.q, w.k, None)
    return call


def _enter_context(w: World, **over: Any) -> Callable[[], object]:
    def call() -> None:
        with w.context(**over):
            pass
    return call


def _legacy_mid_forward(w: World) -> Callable[[], object]:
    layer, meta = _adapted_layer(w, _ExplodingLegacy)
    return lambda: w.forward(layer, attn_metadata={"l0": meta})


def _legacy_update_raises(w: World) -> Callable[[], object]:
    layer, meta = _adapted_layer(w, _RaisingUpdateLegacy)
    return lambda: w.forward(layer, attn_metadata={"l0": meta})


def _fp8_cache(w: World) -> torch.Tensor:
    return w.watch(allocate_kv_cache(TorchRefBackend, num_blocks=w.batch.num_blocks,
                                     block_size=BS, num_kv_heads=H, head_size=D,
                                     cache_dtype="fp8_e4m3", model_dtype=torch.float32,
                                     device="cpu"))


def _mla_args(w: World, **over: Any) -> dict[str, Any]:
    a: dict[str, Any] = dict(kv_c_normed=rows(4, 32), k_pe=rows(4, 8),
                             kv_cache=split_cache(w, torch.float32, 4, BS, 40),
                             slot_mapping=w.slots, quant=KVQuant.unscaled())
    a.update(over)
    return a


def _ds_args(w: World, **over: Any) -> dict[str, Any]:
    a: dict[str, Any] = dict(kv_c_normed=rows(4, 512), k_pe=rows(4, 64),
                             kv_cache=split_cache(w, torch.uint8, 4, BS, 656),
                             slot_mapping=w.slots,
                             quant=KVQuant("fp8_ds_mla", torch.ones(1), torch.ones(1)))
    a.update(over)
    return a


Setup = Callable[[World], Callable[[], object]]


@dataclass(frozen=True)
class Bad:
    """One catalogue entry (``docs/errors.md``)."""

    id: str
    setup: Setup
    error: type[AttentionError]
    mentions: tuple[str, ...]
    """Substrings of the message: the argument, the value seen, what is allowed."""
    cache: str = "unchanged"
    """``unchanged``, or ``written``: the write precedes the failure (compute, legacy
    forward), so the layer's cache holds exactly this step's rows."""


CATALOGUE: list[Bad] = [
    # ---------------------------------------------------------------- writers
    Bad("write.key-not-tensor", lambda w: lambda: w.write(key=w.k.numpy()),
        InvalidTypeError, ("key", "'ndarray'", "a torch.Tensor")),
    Bad("write.key-dtype", lambda w: lambda: w.write(key=w.k.double()),
        KVCacheWriteError, ("key.dtype", "torch.float64", "torch.float32, float16 or bfloat16")),
    Bad("write.key-num-kv-heads", lambda w: lambda: w.write(key=rows(4, H + 1, D)),
        KVCacheWriteError, ("key.shape", "(4, 3, 8)", "num_kv_heads, head_size] = [>= 4, 2, 8]")),
    Bad("write.key-head-size", lambda w: lambda: w.write(key=rows(4, H, D + 8)),
        KVCacheWriteError, ("key.shape", "(4, 2, 16)", "[>= 4, 2, 8]")),
    Bad("write.key-fewer-rows-than-slots", lambda w: lambda: w.write(key=w.k[:2]),
        KVCacheWriteError, ("key.shape", "(2, 2, 8)", ">= num_tokens=4")),
    Bad("write.value-dtype-differs", lambda w: lambda: w.write(value=w.v.half()),
        KVCacheWriteError, ("value.dtype", "torch.float16", "torch.float32 (key's dtype)")),
    Bad("write.key-device", lambda w: lambda: w.write(key=w.k.to("meta")),
        KVCacheWriteError, ("key.device", "'meta'", "cpu (the cache's)")),
    Bad("write.slots-not-tensor", lambda w: lambda: w.write(slot_mapping=w.slots.tolist()),
        InvalidTypeError, ("slot_mapping", "'list'", "a torch.Tensor")),
    Bad("write.slots-int32", lambda w: lambda: w.write(slot_mapping=w.slots.int()),
        KVCacheWriteError, ("slot_mapping.dtype", "torch.int32", "torch.int64")),
    Bad("write.slots-not-integer", lambda w: lambda: w.write(slot_mapping=w.slots.float()),
        KVCacheWriteError, ("slot_mapping.dtype", "torch.float32", "torch.int64")),
    Bad("write.slots-2d", lambda w: lambda: w.write(slot_mapping=w.slots.view(2, 2)),
        KVCacheWriteError, ("slot_mapping.shape", "(2, 2)", "[num_tokens]")),
    Bad("write.slots-device", lambda w: lambda: w.write(slot_mapping=w.slots.to("meta")),
        KVCacheWriteError, ("slot_mapping.device", "'meta'", "cpu (the cache's)")),
    Bad("write.quant-not-kvquant", lambda w: lambda: w.write(quant="auto"),
        InvalidTypeError, ("quant", "'str'", "a vllm.attention.KVQuant")),
    Bad("write.quant-format-unsupported",
        lambda w: lambda: w.write(quant=KVQuant("int8_per_token_head", torch.ones(1),
                                                torch.ones(1))),
        KVCacheWriteError, ("quant.kv_cache_dtype", "'int8_per_token_head'",
                            "one of auto, fp8_e4m3, fp8_e5m2")),
    Bad("write.cache-dtype-vs-format",
        lambda w: lambda: w.write(quant=KVQuant("fp8_e4m3", torch.ones(1), torch.ones(1))),
        KVCacheWriteError, ("kv_cache.dtype", "torch.float32",
                            "torch.float8_e4m3fn for kv_cache_dtype='fp8_e4m3'")),
    Bad("write.scale-shape",
        lambda w: lambda: w.write(kv_cache=_fp8_cache(w),
                                  quant=KVQuant("fp8_e4m3", torch.ones(3), torch.ones(1))),
        KVCacheWriteError, ("quant.k_scale.shape", "(3,)", "[1] or [num_kv_heads=2]")),
    Bad("write.scale-device",
        lambda w: lambda: w.write(kv_cache=_fp8_cache(w),
                                  quant=KVQuant("fp8_e4m3", torch.ones(1, device="meta"),
                                                torch.ones(1))),
        KVCacheWriteError, ("quant.k_scale.device", "'meta'", "cpu (the cache's)")),
    Bad("write.cache-not-tensor", lambda w: lambda: w.write(kv_cache=None),
        InvalidTypeError, ("kv_cache", "'NoneType'", "a torch.Tensor")),
    Bad("write.cache-rank", lambda w: lambda: w.write(kv_cache=w.cache[:, 0]),
        InvalidArgumentError, ("kv_cache.shape", "(3, 16, 2, 8)", "5 dims for layout split_nhd")),
    Bad("write.cache-overlapping",
        lambda w: lambda: w.write(kv_cache=w.cache[:1].expand(w.cache.shape)),
        KVCacheWriteError, ("kv_cache.stride", "(0, 256, 16, 8, 1)", "its own memory")),
    Bad("write.path-unknown",
        lambda w: lambda: w.layer.kv_cache_writer.write(  # type: ignore[call-arg]
            w.k, w.v, w.cache, w.slots, KVQuant.unscaled(), path="cuda"),
        KVCacheWriteError, ("path", "'cuda'", "'torch', 'triton' or None")),
    Bad("write.legacy-paged-head-size",
        lambda w: lambda: LegacyPagedKVCacheWriter().write(
            rows(4, H, 4, dtype=torch.bfloat16), rows(4, H, 4, dtype=torch.bfloat16),
            split_cache(w, torch.bfloat16, 2, 4, BS * H * 4), w.slots, KVQuant.unscaled()),
        InvalidArgumentError, ("head_size", "4", "a multiple of x=8 (16 bytes of torch.bfloat16)")),
    Bad("write.aiter-block-size",
        lambda w: lambda: AiterShuffledKVCacheWriter().write(
            rows(4, H, D, dtype=torch.bfloat16), rows(4, H, D, dtype=torch.bfloat16),
            split_cache(w, torch.bfloat16, 2, 8, 4, H, D), w.slots, KVQuant.unscaled()),
        InvalidArgumentError, ("block_size", "4", "a multiple of x=8")),
    Bad("write.aiter-cache-strides",
        lambda w: lambda: AiterShuffledKVCacheWriter().write(
            rows(4, H, D, dtype=torch.bfloat16), rows(4, H, D, dtype=torch.bfloat16),
            split_cache(w, torch.bfloat16, 2, 4, H, BS, D).transpose(2, 3), w.slots,
            KVQuant.unscaled()),
        InvalidArgumentError, ("kv_cache.stride", "(256, 8, 128, 1)", "contiguous rows per block")),
    Bad("write.diffkv-value-head-size",
        lambda w: lambda: DiffKVCacheWriter().write(
            rows(4, H, D), rows(4, H, 4), split_cache(w, torch.float32, 4, BS, H, D + 8),
            w.slots, KVQuant.unscaled()),
        KVCacheWriteError, ("value.shape", "(4, 2, 4)", "[>= 4, 2, 8]")),
    Bad("write.per-token-head-cache-dtype",
        lambda w: lambda: PerTokenHeadKVCacheWriter().write(
            w.k, w.v, split_cache(w, torch.float32, 4, 2, BS, H, D + 4), w.slots,
            KVQuant("int8_per_token_head", torch.ones(1), torch.ones(1))),
        KVCacheWriteError, ("kv_cache.dtype", "torch.float32", "torch.uint8")),
    Bad("write.mla-cache-width",
        lambda w: lambda: MLALatentCacheWriter().write(**_mla_args(w, k_pe=rows(4, 16))),
        KVCacheWriteError, ("kv_cache.shape", "(4, 16, 40)", "kv_lora_rank + rope_dim = 32 + 16")),
    Bad("write.mla-k-pe-dtype",
        lambda w: lambda: MLALatentCacheWriter().write(
            **_mla_args(w, k_pe=rows(4, 8, dtype=torch.bfloat16))),
        KVCacheWriteError, ("k_pe.dtype", "torch.bfloat16", "torch.float32 (kv_c_normed's dtype)")),
    Bad("write.fp8-ds-mla-latent-width",
        lambda w: lambda: FP8DsMLACacheWriter().write(**_ds_args(w, kv_c_normed=rows(4, 256))),
        KVCacheWriteError, ("kv_c_normed.shape", "(4, 256)", "[>= num_tokens, 512]")),
    Bad("write.fp8-ds-mla-cache-dtype",
        lambda w: lambda: FP8DsMLACacheWriter().write(
            **_ds_args(w, kv_cache=split_cache(w, torch.bfloat16, 4, BS, 656))),
        KVCacheWriteError, ("kv_cache.dtype", "torch.bfloat16", "torch.uint8")),
    Bad("writers.mla-layout-not-a-kv-layout",
        lambda w: lambda: writer_for_layout(L.MLA_LATENT),
        KVCacheWriteError, ("layout", "'mla_latent'", "mla_writer_for_layout")),
    # ---------------------------------------------------------------- KVQuant
    Bad("quant.scale-dtype",
        lambda w: lambda: KVQuant("fp8", torch.ones(1, dtype=torch.float16), torch.ones(1)),
        InvalidArgumentError, ("k_scale.dtype", "torch.float16", "torch.float32")),
    Bad("quant.scale-not-tensor", lambda w: lambda: KVQuant("fp8", 1.0, torch.ones(1)),  # type: ignore[arg-type]
        InvalidArgumentError, ("k_scale", "'float'", "a float32 torch.Tensor")),
    Bad("quant.scale-rank", lambda w: lambda: KVQuant("fp8", torch.ones(1), torch.ones(1, 1)),
        InvalidArgumentError, ("v_scale.shape", "(1, 1)", "[1] or [num_kv_heads]")),
    Bad("quant.unknown-format",
        lambda w: lambda: KVQuant("fp4", torch.ones(1), torch.ones(1)),  # type: ignore[arg-type]
        InvalidArgumentError, ("KVQuant.kv_cache_dtype", "'fp4'", "one of auto, fp8")),
    # ---------------------------------------------------------------- checked mode
    Bad("checked.slot-past-cache", _out_of_range,
        KVCacheWriteError, ("slot_mapping", "1 slot(s) up to 48", "slots in [0, 48)")),
    Bad("checked.duplicate-slots", _duplicates,
        KVCacheWriteError, ("slot_mapping", "duplicate slots", "each non-negative slot at most once")),
    Bad("checked.env-variable", _env_checked,
        KVCacheWriteError, ("slot_mapping", "1 slot(s) up to 53", "slots in [0, 48)")),
    Bad("checked.unbound-cache", _unbound,
        InvalidArgumentError, ("kv_cache", "'unbound'", "bind_kv_cache() before forward")),
    # ---------------------------------------------------------------- the layer
    Bad("layer.metadata-wrong-class",
        lambda w: lambda: w.forward(attn_metadata={"l0": _OtherMetadata()}),
        InvalidTypeError, ("attn_metadata['l0']", "'_OtherMetadata'", "PagedAttentionMetadata")),
    Bad("layer.no-slot-mapping-for-layer",
        lambda w: lambda: w.forward(slot_mapping={"l1": w.slots}),
        ForwardContextError, ("slot_mapping has no entry for layer 'l0'", "layers present: ['l1']")),
    Bad("layer.no-metadata-for-layer",
        lambda w: lambda: w.forward(attn_metadata={"l1": w.meta}),
        ForwardContextError, ("attn_metadata has no entry for layer 'l0'", "layers present: ['l1']")),
    Bad("layer.outside-forward-context", lambda w: lambda: w.layer(w.q, w.k, w.v),
        ForwardContextError, ("outside a forward context", "set_forward_context")),
    Bad("layer.key-without-value", _key_without_value,
        InvalidArgumentError, ("key/value", "'one of them None'", "both tensors, or both None")),
    Bad("layer.block-size-for-backend",
        lambda w: lambda: Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.3,
                                    backend=_Bs16Backend, layer_name="x").bind_kv_cache(
            w.cache, 24),
        InvalidArgumentError, ("block_size", "24", "a multiple of 16 for TORCH_REF_BS16")),
    Bad("layer.cache-of-another-block-size", lambda w: lambda: w.layer.bind_kv_cache(w.cache, 32),
        InvalidArgumentError, ("kv_cache.shape", "(3, 2, 16, 2, 8)",
                               "TORCH_REF's cache shape for block_size=32", "(3, 2, 32, 2, 8)")),
    Bad("layer.cache-not-tensor", lambda w: lambda: w.layer.bind_kv_cache([0.0], BS),  # type: ignore[arg-type]
        InvalidTypeError, ("kv_cache", "'list'", "a torch.Tensor")),
    Bad("layer.head-size-for-backend",
        lambda w: lambda: Attention(num_heads=2, head_size=7, scale=1.0,
                                    backend=registry.get_backend("FLASH_ATTN"), layer_name="x"),
        UnsupportedBackendError, ("FLASH_ATTN", "head_size=7", "a multiple of 8 up to 256")),
    Bad("layer.kv-cache-dtype-for-backend",
        lambda w: lambda: Attention(num_heads=2, head_size=64, scale=1.0, kv_cache_dtype="fp8_e5m2",
                                    backend=registry.get_backend("FLASH_ATTN"), layer_name="x"),
        UnsupportedBackendError, ("FLASH_ATTN", "kv_cache_dtype='fp8_e5m2'", "one of auto, fp8")),
    Bad("layer.k-scale",
        lambda w: lambda: Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=1.0,
                                    backend=TorchRefBackend, layer_name="x", k_scale=-1.0),
        InvalidArgumentError, ("k_scale", "-1.0", "a positive finite float")),
    Bad("layer.scale",
        lambda w: lambda: Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.0,
                                    backend=TorchRefBackend, layer_name="x"),
        InvalidArgumentError, ("scale", "0.0", "a positive finite float")),
    Bad("layer.unknown-kv-cache-dtype",
        lambda w: lambda: Attention(num_heads=4, head_size=D, scale=1.0, backend=TorchRefBackend,
                                    layer_name="x", kv_cache_dtype="fp4"),
        InvalidArgumentError, ("kv_cache_dtype", "'fp4'", "one of auto, fp8")),
    Bad("layer.backend-not-a-class",
        lambda w: lambda: Attention(num_heads=4, head_size=D, scale=1.0,
                                    backend="TORCH_REF", layer_name="x"),  # type: ignore[arg-type]
        InvalidTypeError, ("backend", "'TORCH_REF'", "an AttentionBackend subclass")),
    Bad("layer.num-heads-vs-kv-heads",
        lambda w: lambda: Attention(num_heads=4, num_kv_heads=3, head_size=D, scale=1.0,
                                    backend=TorchRefBackend, layer_name="x"),
        InvalidArgumentError, ("num_heads", "4", "a multiple of num_kv_heads=3")),
    # ---------------------------------------------------------------- forward context
    Bad("context.outside", lambda w: get_forward_context,
        ForwardContextError, ("get_forward_context()", "outside a forward context",
                              "set_forward_context(attn_metadata=..., slot_mapping=...)")),
    Bad("context.slot-mapping-int32",
        lambda w: _enter_context(w, slot_mapping={"l0": w.slots.int()}),
        InvalidArgumentError, ("slot_mapping['l0'].dtype", "torch.int32", "torch.int64")),
    Bad("context.slot-mapping-not-tensor",
        lambda w: _enter_context(w, slot_mapping={"l0": [1, 2]}),
        InvalidTypeError, ("slot_mapping['l0']", "'list'", "a torch.Tensor")),
    Bad("context.slot-mapping-2d",
        lambda w: _enter_context(w, slot_mapping={"l0": w.slots.view(2, 2)}),
        InvalidArgumentError, ("slot_mapping['l0'].shape", "(2, 2)", "[num_tokens]")),
    # ---------------------------------------------------------------- registry
    Bad("registry.unknown-name", lambda w: lambda: registry.get_backend("NOPE"),
        BackendNotFoundError, ("'NOPE'", "registered:", "TORCH_REF")),
    Bad("registry.plugin-fails-to-import", _broken_plugin,
        PluginLoadError, ("'BROKEN_PLUGIN'", "tests.no_such_plugin_module:Backend",
                          "ModuleNotFoundError")),
    Bad("registry.module-class-fails-to-import",
        lambda w: lambda: registry.get_backend("no_such_module:Backend"),
        PluginLoadError, ("'no_such_module:Backend'", "ModuleNotFoundError", "no_such_module")),
    Bad("registry.malformed-target", lambda w: lambda: registry.get_backend("some.module:"),
        InvalidArgumentError, ("backend", "'some.module:'", "a registered name or 'module:Class'")),
    Bad("registry.name-not-a-string", lambda w: lambda: registry.get_backend(3),  # type: ignore[arg-type]
        InvalidArgumentError, ("name", "3", "a backend name string")),
    Bad("registry.preferred-cannot-run",
        lambda w: lambda: registry.select_backend(dtype=torch.float32, head_size=64,
                                                  block_size=16, use_mla=True,
                                                  preferred="TORCH_REF"),
        UnsupportedBackendError, ("TORCH_REF", "use_mla=True", "is not an MLA backend")),
    Bad("registry.no-backend-fits",
        lambda w: lambda: registry.select_backend(dtype=torch.float64, head_size=7, block_size=3),
        NoBackendError, ("no attention backend can run this configuration", "dtype=float64",
                         "FLASH_ATTN needs one of bfloat16, float16")),
    Bad("registry.register-not-a-backend", lambda w: lambda: registry.register_backend(int),
        BackendRegistrationError, ("register_backend", "<class 'int'>",
                                   "an AttentionBackend subclass or a legacy backend")),
    Bad("registry.register-duplicate-name",
        lambda w: lambda: registry.register_backend(type("Twin", (TorchRefBackend,), {})),
        BackendRegistrationError, ("'TORCH_REF'", "already registered", "replace=True")),
    # ---------------------------------------------------------------- allocation
    Bad("allocate.block-size-for-backend",
        lambda w: lambda: allocate_kv_cache(registry.get_backend("FLASH_ATTN"), num_blocks=2,
                                            block_size=24, num_kv_heads=2, head_size=64,
                                            model_dtype=torch.float16, device="cpu"),
        UnsupportedBackendError, ("FLASH_ATTN", "block_size=24", "a multiple of 16")),
    Bad("allocate.head-size-for-backend",
        lambda w: lambda: allocate_kv_cache(registry.get_backend("FLASH_ATTN"), num_blocks=2,
                                            block_size=16, num_kv_heads=2, head_size=300,
                                            model_dtype=torch.float16, device="cpu"),
        UnsupportedBackendError, ("FLASH_ATTN", "head_size=300", "a multiple of 8 up to 256")),
    Bad("allocate.num-blocks",
        lambda w: lambda: allocate_kv_cache(TorchRefBackend, num_blocks=0, block_size=16,
                                            num_kv_heads=2, head_size=8,
                                            model_dtype=torch.float32, device="cpu"),
        InvalidArgumentError, ("num_blocks", "0", "a positive int")),
    Bad("allocate.unknown-cache-dtype",
        lambda w: lambda: allocate_kv_cache(TorchRefBackend, num_blocks=1, block_size=16,
                                            num_kv_heads=2, head_size=8, cache_dtype="fp4",
                                            model_dtype=torch.float32, device="cpu"),
        InvalidArgumentError, ("cache_dtype", "'fp4'", "one of auto, fp8")),
    Bad("allocate.model-dtype-for-backend",
        lambda w: lambda: allocate_kv_cache(TorchRefBackend, num_blocks=1, block_size=16,
                                            num_kv_heads=2, head_size=8,
                                            model_dtype=torch.float64, device="cpu"),
        UnsupportedBackendError, ("TORCH_REF", "dtype=float64", "bfloat16, float16, float32")),
    # ---------------------------------------------------------------- legacy backends
    Bad("shim.legacy-raises-mid-forward", _legacy_mid_forward,
        LegacyBackendRuntimeError, ("'EXPLODING_LEGACY'", "forward()", "ZeroDivisionError: legacy bug"),
        cache="written"),
    Bad("shim.legacy-update-raises", _legacy_update_raises,
        LegacyBackendRuntimeError, ("_RaisingUpdateImpl.do_kv_cache_update()", "KeyError",
                                    "legacy update bug")),
    Bad("shim.flag-without-update", lambda w: lambda: adapt_legacy_backend(_FlagWithoutUpdate),
        LegacyBackendError, ("forward_includes_kv_cache_update = False",
                             "no do_kv_cache_update(", "Add the method")),
    Bad("shim.not-a-class", lambda w: lambda: adapt_legacy_backend(42),  # type: ignore[arg-type]
        LegacyBackendError, ("adapt_legacy_backend", "42", "a legacy backend class")),
    Bad("shim.unknown-cache-layout", lambda w: lambda: adapt_legacy_backend(_UnknownLayoutLegacy),
        LegacyBackendError, ("get_kv_cache_shape(7, 16, 3, 8) = (7, 16, 3, 24)",
                             "declare kv_cache_layout")),
    # ---------------------------------------------------------------- readback
    Bad("read_slots.out-of-range",
        lambda w: lambda: read_slots(L.SPLIT_NHD, w.cache, torch.tensor([w.num_slots])),
        InvalidArgumentError, ("slots", "out-of-range slots [48]", "slots in [0, 48)")),
]

BY_ID = {b.id: b for b in CATALOGUE}


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    registry._reset_for_tests()
    monkeypatch.delenv("VLLM_KV_CHECKED", raising=False)
    shim.warnings._reset_for_tests()
    yield World(monkeypatch)
    registry._reset_for_tests()


def _expected_after_write(w: World) -> torch.Tensor:
    """The layer cache's bytes after this step's write alone."""
    cache = w.watched[-1][0].clone()  # called before the failing call: still the old bytes
    keep = w.slots >= 0
    s = w.slots[keep]
    # adapted fused legacy caches are (nb, 2, bs, H, D), like TORCH_REF's
    cache[s // BS, 0, s % BS] = w.k[keep]
    cache[s // BS, 1, s % BS] = w.v[keep]
    return raw(cache)


def _healthy(w: World) -> None:
    """A valid step through the same layer writes its rows and attends."""
    assert not is_forward_context_available(), "a forward context leaked out of a failed call"
    out = w.forward()
    assert bool(torch.isfinite(out).all())
    for i, slot in enumerate(w.slots.tolist()):
        assert torch.equal(w.cache[slot // BS, 0, slot % BS], w.k[i])
        assert torch.equal(w.cache[slot // BS, 1, slot % BS], w.v[i])


@pytest.mark.filterwarnings("ignore::shim.LegacyBackendWarning")
@pytest.mark.parametrize("bad", CATALOGUE, ids=[b.id for b in CATALOGUE])
def test_bad_input_is_rejected_clearly_and_harmlessly(bad: Bad, world: World) -> None:
    call = bad.setup(world)
    expected_written = _expected_after_write(world) if bad.cache == "written" else None
    with pytest.raises(bad.error) as info:
        call()
    err = info.value
    assert isinstance(err, AttentionError)
    assert isinstance(err, (ValueError, TypeError, LookupError, RuntimeError, ImportError))
    text = str(err)
    for fragment in bad.mentions:
        assert fragment in text, f"{bad.id}: {fragment!r} not in the message {text!r}"
    if isinstance(err, (InvalidArgumentError, InvalidTypeError)):
        assert text.startswith(f"{err.argument}: got "), text
        assert bad.mentions[0] == err.argument, (bad.mentions[0], err.argument)
    watched = world.watched
    if bad.cache == "written":
        assert expected_written is not None
        assert torch.equal(raw(watched[-1][0]), expected_written), "the cache is not the write"
        watched = watched[:-1]
    for i, (t, before) in enumerate(watched):
        assert torch.equal(raw(t), before), f"{bad.id}: watched cache #{i} changed"
    _healthy(world)


def test_catalogue_has_thirty_distinct_entries() -> None:
    assert len(BY_ID) == len(CATALOGUE) >= 30


def _documented() -> dict[str, str]:
    """``id -> error class`` from the catalogue table of docs/errors.md."""
    rows: dict[str, str] = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"^\|\s*`([a-z_0-9.-]+)`\s*\|.*\|\s*`(\w+)`\s*\|\s*$", line)
        if m:
            assert m.group(1) not in rows, f"docs/errors.md lists {m.group(1)!r} twice"
            rows[m.group(1)] = m.group(2)
    return rows


def test_docs_and_catalogue_agree() -> None:
    documented = _documented()
    assert set(documented) == set(BY_ID), (
        f"only in docs/errors.md: {sorted(set(documented) - set(BY_ID))}; "
        f"only in tests/test_bad_inputs.py: {sorted(set(BY_ID) - set(documented))}"
    )
    for id_, cls in documented.items():
        assert BY_ID[id_].error.__name__ == cls, (id_, cls, BY_ID[id_].error.__name__)


def test_every_error_class_is_documented() -> None:
    from vllm.attention import errors

    text = DOCS.read_text()
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, AttentionError)]
    classes += [LegacyBackendRuntimeError]
    for cls in classes:
        assert f"`{cls.__name__}`" in text, f"docs/errors.md does not describe {cls.__name__}"
