"""The ``vllm_kv`` custom ops: schemas (what each mutates), fake implementations, and
``torch.library.opcheck`` on real layers (schema, fake tensors, AOT dispatch)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.helpers import fill_random_bytes
from vllm.attention import InvalidArgumentError, allocate_kv_cache
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.backends.triton_attn import TritonAttentionBackend
from vllm.attention.batch import make_paged_batch
from vllm.attention.layer import Attention
from vllm.attention.ops import custom_ops
from vllm.attention.rope import RoPE
from vllm.forward_context import set_forward_context

OPS = torch.ops.vllm_kv


def test_schemas_declare_what_is_mutated() -> None:
    assert str(OPS.write_kv.default._schema) == (
        "vllm_kv::write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, str layer) -> ()")
    assert str(OPS.write_kv_rope.default._schema) == (
        "vllm_kv::write_kv_rope(Tensor(a!) query, Tensor key, Tensor value, Tensor(b!) kv_cache, "
        "Tensor positions, Tensor cos_sin_cache, bool is_neox, str layer) -> ()")
    assert str(OPS.attention.default._schema) == (
        "vllm_kv::attention(Tensor query, Tensor? key, Tensor? value, Tensor kv_cache, "
        "Tensor(a!) output, str layer) -> ()")
    written = {op: [a.name for a in getattr(OPS, op).default._schema.arguments
                    if a.alias_info is not None and a.alias_info.is_write]
               for op in ("write_kv", "write_kv_rope", "attention")}
    assert written == {"write_kv": ["kv_cache"], "write_kv_rope": ["query", "kv_cache"],
                       "attention": ["output"]}


def test_fake_implementations_need_no_layer() -> None:
    with FakeTensorMode():
        q, k = torch.empty(4, 4, 16), torch.empty(4, 2, 16)
        cache = torch.empty(3, 2, 16, 2, 16)
        out = torch.empty(4, 4, 16)
        assert OPS.write_kv(k, k, cache, "no-such-layer") is None
        assert OPS.write_kv_rope(q, k, k, cache, torch.empty(4, dtype=torch.int64),
                                 torch.empty(8, 16), True, "no-such-layer") is None
        assert OPS.attention(q, k, k, cache, out, "no-such-layer") is None


def test_unknown_or_dead_layer_key_is_a_clear_error() -> None:
    layer = Attention(num_heads=2, head_size=8, scale=1.0, backend=TorchRefBackend,
                      layer_name="gone")
    key = layer._op_key
    assert custom_ops.layer_for(key) is layer
    del layer
    gc.collect()
    with pytest.raises(InvalidArgumentError) as info:
        custom_ops.layer_for(key)
    assert info.value.argument == "layer"


def _setup(backend: type) -> tuple[Attention, dict[str, object], torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor]:
    batch = make_paged_batch([3, 1], [0, 5], block_size=16,
                             generator=torch.Generator().manual_seed(0))
    layer = Attention(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, backend=backend,
                      layer_name="op0")
    cache = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=16,
                              num_kv_heads=2, head_size=16, model_dtype=torch.float32,
                              device="cpu")
    cache.normal_()
    layer.bind_kv_cache(cache, 16)
    meta = backend.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
    g = torch.Generator().manual_seed(1)
    n = batch.common.num_actual_tokens
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (4, 2, 2))
    ctx: dict[str, object] = dict(attn_metadata={"op0": meta},
                                  slot_mapping={"op0": batch.new_slots})
    return layer, ctx, q, k, v, cache


BACKENDS = [TorchRefBackend, TritonAttentionBackend]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_opcheck_write_kv(backend: type) -> None:
    layer, ctx, q, k, v, cache = _setup(backend)
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        torch.library.opcheck(OPS.write_kv.default, (k, v, cache, layer._op_key))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_opcheck_write_kv_rope(backend: type) -> None:
    layer, ctx, q, k, v, cache = _setup(backend)
    rope = RoPE.build(16, 32)
    positions = torch.tensor([0, 1, 2, 7])
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        torch.library.opcheck(OPS.write_kv_rope.default,
                              (q, k, v, cache, positions, rope.cos_sin_cache, True,
                               layer._op_key))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_opcheck_attention(backend: type) -> None:
    layer, ctx, q, k, v, cache = _setup(backend)
    out = torch.empty_like(q)
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        layer.write_kv(k, v, layer._context_and_metadata()[0])
        torch.library.opcheck(OPS.attention.default, (q, k, v, cache, out, layer._op_key))


def test_ops_run_eagerly_as_the_layer_does() -> None:
    layer, ctx, q, k, v, cache = _setup(TorchRefBackend)
    fill_random_bytes(cache, 3)
    start = cache.clone()
    with set_forward_context(**ctx):  # type: ignore[arg-type]
        want = layer(q, k, v)
        want_cache = cache.clone()
        cache.copy_(start)
        out = torch.empty_like(q)
        OPS.write_kv(k, v, cache, layer._op_key)
        OPS.attention(q, k, v, cache, out, layer._op_key)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
