"""The layer's write path: who writes, when, and what is rejected before writing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.helpers import fill_random_bytes, raw
from vllm.attention import (
    AttentionMetadata,
    ForwardContextError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheWriteError,
    KVQuant,
    allocate_kv_cache,
)
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.batch import make_paged_batch
from vllm.attention.conformance import null_block
from vllm.attention.layer import Attention
from vllm.attention.types import AttentionType
from vllm.forward_context import ForwardContext, set_forward_context

BS, H, D = 16, 2, 8


class RecordingConnector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def on_kv_written(self, layer_name: str, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        self.calls.append((layer_name, slot_mapping.tolist()))


def _setup(attn_type: AttentionType = AttentionType.DECODER, sharing: str | None = None,
           checked: bool = False, qlens: tuple[int, ...] = (3, 1),
           clens: tuple[int, ...] = (0, 5)):
    batch = make_paged_batch(list(qlens), list(clens), block_size=BS,
                             generator=torch.Generator().manual_seed(0),
                             causal=attn_type is AttentionType.DECODER)
    layer = Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.3,
                      backend=TorchRefBackend, layer_name="l0", attn_type=attn_type,
                      kv_sharing_target_layer_name=sharing, checked=checked)
    cache = allocate_kv_cache(TorchRefBackend, num_blocks=batch.num_blocks, block_size=BS,
                              num_kv_heads=H, head_size=D, model_dtype=torch.float32,
                              device="cpu")
    fill_random_bytes(cache, 5)
    null_block(TorchRefBackend, cache).zero_()  # vLLM's convention: block-table padding reads it
    layer.bind_kv_cache(cache, BS)
    ctx = torch.randn(batch.context_slots.numel(), H, D,
                      generator=torch.Generator().manual_seed(2))
    layer.kv_cache_writer.write(ctx, ctx, cache, batch.context_slots, layer.kv_quant)
    meta = TorchRefBackend.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
    n = batch.common.num_actual_tokens
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, 4, D, generator=g)
    k = torch.randn(n, H, D, generator=g)
    v = torch.randn(n, H, D, generator=g)
    return layer, cache, meta, batch, q, k, v


def test_decoder_writes_then_computes_and_calls_connector() -> None:
    layer, cache, meta, batch, q, k, v = _setup()
    conn = RecordingConnector()
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"l0": batch.new_slots},
                             kv_connector=conn):
        out = layer(q, k, v)
    assert out.shape == (q.shape[0], 4, D) and bool(torch.isfinite(out).all())
    for i, slot in enumerate(batch.new_slots.tolist()):
        assert torch.equal(cache[slot // BS, 0, slot % BS], k[i])
    assert conn.calls == [("l0", batch.new_slots.tolist())]


def test_flattened_query_round_trips() -> None:
    layer, cache, meta, batch, q, k, v = _setup()
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"l0": batch.new_slots}):
        flat = layer(q.flatten(1), k, v)
        full = layer(q, k, v)
    assert flat.shape == (q.shape[0], 4 * D) and torch.equal(flat, full.flatten(1))


def test_kv_sharing_layer_never_writes() -> None:
    layer, cache, meta, batch, q, k, v = _setup(sharing="l_target")
    before = raw(cache).clone()
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={}):
        layer(q, k, v)  # no slot mapping needed: nothing is written
    assert torch.equal(raw(cache), before)


def test_encoder_only_has_no_cache() -> None:
    layer, _, meta, batch, q, k, v = _setup(AttentionType.ENCODER_ONLY, clens=(0, 0))
    layer.kv_cache = torch.empty(0)
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={}):
        out = layer(q, k, v)
    assert bool(torch.isfinite(out).all())
    assert not layer.writes_kv_cache


def test_cross_attention_writes_encoder_kv_once() -> None:
    layer, cache, meta, batch, q, k, v = _setup(AttentionType.ENCODER_DECODER, clens=(0, 0))
    ctx = dict(attn_metadata={"l0": meta}, slot_mapping={"l0": batch.new_slots})
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        first = layer(q, k, v)
    after_first = raw(cache).clone()
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        second = layer(q, None, None)  # later steps: no encoder K/V, no write
    assert torch.equal(raw(cache), after_first)
    assert torch.equal(first, second)


def test_write_path_is_the_only_reader_of_slot_mapping() -> None:
    """Without this layer's slot mapping, the write fails; compute alone never asks."""
    layer, _, meta, batch, q, k, v = _setup()
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"other": batch.new_slots}):
        with pytest.raises(ForwardContextError, match="'l0'"):
            layer(q, k, v)


@dataclass(frozen=True)
class OtherMetadata(AttentionMetadata):
    pass


def test_metadata_of_the_wrong_class_is_rejected_before_writing() -> None:
    layer, cache, _, batch, q, k, v = _setup()
    before = raw(cache).clone()
    with set_forward_context(attn_metadata={"l0": OtherMetadata()},
                             slot_mapping={"l0": batch.new_slots}):
        with pytest.raises(InvalidTypeError, match="OtherMetadata.*PagedAttentionMetadata"):
            layer(q, k, v)
    assert torch.equal(raw(cache), before)


def test_checked_mode_rejects_out_of_range_and_duplicate_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, cache, meta, batch, q, k, v = _setup(checked=True)
    before = raw(cache).clone()
    n_slots = batch.num_blocks * BS
    bad = batch.new_slots.clone()
    bad[0] = n_slots
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"l0": bad}):
        with pytest.raises(KVCacheWriteError, match=rf"slot_mapping.*\[0, {n_slots}\)"):
            layer(q, k, v)
    dup = batch.new_slots.clone()
    dup[1] = dup[0]
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"l0": dup}):
        with pytest.raises(KVCacheWriteError, match="duplicate"):
            layer(q, k, v)
    assert torch.equal(raw(cache), before)
    monkeypatch.setenv("VLLM_KV_CHECKED", "1")
    assert Attention(num_heads=2, head_size=8, scale=1.0, backend=TorchRefBackend,
                     layer_name="x").checked


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(key=a["key"].to(torch.float64)), KVCacheWriteError, "key.dtype"),
        (lambda a: a.update(key=a["key"][:, :1]), KVCacheWriteError, "key.shape"),
        (lambda a: a.update(value=a["value"].half()), KVCacheWriteError, "value.dtype"),
        (lambda a: a.update(key=a["key"][:1]), KVCacheWriteError, r"num_tokens"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), KVCacheWriteError,
         "slot_mapping.dtype"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), KVCacheWriteError,
         "slot_mapping.dtype"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].view(1, -1)), KVCacheWriteError,
         "slot_mapping.shape"),
        (lambda a: a.update(key=a["key"].to("meta")), KVCacheWriteError, "key.device"),
        (lambda a: a.update(quant=KVQuant("fp8_e4m3", torch.ones(3), torch.ones(1))),
         KVCacheWriteError, "k_scale.shape"),
        (lambda a: a.update(quant=KVQuant("fp8_e4m3", torch.ones(1), torch.ones(1))),
         KVCacheWriteError, "kv_cache.dtype"),
        (lambda a: a.update(quant="auto"), InvalidTypeError, "quant"),
        (lambda a: a.update(kv_cache=a["kv_cache"][:, 0]), InvalidArgumentError, "kv_cache.shape"),
    ],
    ids=["key_fp64", "key_heads", "value_dtype_mismatch", "too_few_rows", "slots_int32",
         "slots_float", "slots_2d", "key_device", "scale_shape", "cache_dtype_vs_quant",
         "quant_not_kvquant", "cache_rank"],
)
def test_bad_write_arguments_leave_cache_unchanged(mutate, exc, match) -> None:  # type: ignore[no-untyped-def]
    layer, cache, _, batch, _, k, v = _setup()
    before = raw(cache).clone()
    args = dict(key=k, value=v, kv_cache=cache, slot_mapping=batch.new_slots,
                quant=KVQuant.unscaled())
    mutate(args)
    with pytest.raises(exc, match=match):
        layer.kv_cache_writer.write(**args)  # type: ignore[arg-type]
    assert torch.equal(raw(cache), before)
    # the process keeps working
    layer.kv_cache_writer.write(k, v, cache, batch.new_slots, KVQuant.unscaled())


def test_bad_layer_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="num_heads.*multiple of num_kv_heads=3"):
        Attention(num_heads=4, num_kv_heads=3, head_size=8, scale=1.0, backend=TorchRefBackend,
                  layer_name="x")
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype.*one of auto"):
        Attention(num_heads=4, head_size=8, scale=1.0, backend=TorchRefBackend,
                  layer_name="x", kv_cache_dtype="fp4")
    with pytest.raises(InvalidTypeError, match="backend"):
        Attention(num_heads=4, head_size=8, scale=1.0, backend="TORCH_REF",  # type: ignore[arg-type]
                  layer_name="x")
    with pytest.raises(InvalidArgumentError, match="k_scale"):
        Attention(num_heads=4, num_kv_heads=2, head_size=8, scale=1.0, backend=TorchRefBackend,
                  layer_name="x", k_scale=torch.ones(3))


def test_unused_context_type_is_frozen() -> None:
    with set_forward_context(attn_metadata={}, slot_mapping={}) as ctx:
        assert isinstance(ctx, ForwardContext)
        with pytest.raises(TypeError):
            ctx.slot_mapping["x"] = torch.zeros(1)  # type: ignore[index]
