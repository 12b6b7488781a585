"""``torch.compile(fullgraph=True)`` of a small decoder layer has no graph break with
any backend (TORCH_REF and TRITON_ATTN here, torch paths on CPU; MLA too): the write
and the compute are single ``vllm_kv`` op nodes, and the compiled layer writes the
same cache bytes and returns the same output as the eager one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.helpers import fill_random_bytes
from tests.mla.helpers import make_spec
from tests.mla.helpers import setup as mla_setup
from vllm.attention import allocate_kv_cache
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.backends.triton_attn import TritonAttentionBackend
from vllm.attention.batch import make_paged_batch
from vllm.attention.layer import Attention, MLAAttention
from vllm.attention.rope import RoPE
from vllm.forward_context import set_forward_context

HIDDEN, HQ, HKV, D, BS = 32, 4, 2, 16, 16


class TinyDecoderLayer(torch.nn.Module):
    """RMS-normed input, fused QKV projection, RoPE, attention, output projection."""

    def __init__(self, backend: type, layer_name: str, *, rope: bool,
                 sharing: str | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.norm = torch.nn.RMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, (HQ + 2 * HKV) * D, bias=False)
        self.o = torch.nn.Linear(HQ * D, HIDDEN, bias=False)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.randn(self.qkv.weight.shape, generator=g) * 0.2)
            self.o.weight.copy_(torch.randn(self.o.weight.shape, generator=g) * 0.2)
        self.attn = Attention(num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=D ** -0.5,
                              backend=backend, layer_name=layer_name,
                              kv_sharing_target_layer_name=sharing)
        self.rope = RoPE.build(D, 64) if rope else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).split([HQ * D, HKV * D, HKV * D], dim=-1)
        q = q.reshape(-1, HQ, D).contiguous()
        k, v = k.reshape(-1, HKV, D), v.reshape(-1, HKV, D)
        if self.rope is None:
            o = self.attn(q, k, v)
        else:
            o = self.attn(q, k, v, positions=positions, rope=self.rope)
        out: torch.Tensor = x + self.o(o.flatten(1))
        return out


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(backend: type, *, rope: bool, sharing: bool = False
         ) -> tuple[TinyDecoderLayer, dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = make_paged_batch([3, 1], [0, 5], block_size=BS,
                             generator=torch.Generator().manual_seed(0))
    model = TinyDecoderLayer(backend, "dec.1" if sharing else "dec.0", rope=rope,
                             sharing="dec.0" if sharing else None)
    cache = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=BS,
                              num_kv_heads=HKV, head_size=D, model_dtype=torch.float32,
                              device="cpu")
    cache.normal_(generator=torch.Generator().manual_seed(2))
    model.attn.bind_kv_cache(cache, BS)
    meta = backend.get_builder_cls()(model.attn.spec, torch.device("cpu")).build(batch.common)
    n = batch.common.num_actual_tokens
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(3))
    name = model.attn.layer_name
    ctx = dict(attn_metadata={name: meta}, slot_mapping={name: batch.new_slots})
    return model, ctx, cache, x, torch.tensor([0, 1, 2, 9])


CASES = [(TorchRefBackend, False), (TorchRefBackend, True), (TritonAttentionBackend, True)]


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize(("backend", "rope"), CASES,
                         ids=[f"{b.name}-{'rope' if r else 'plain'}" for b, r in CASES])
def test_decoder_layer_compiles_fullgraph_and_matches_eager(backend: type, rope: bool,
                                                            compiler: str) -> None:
    model, ctx, cache, x, positions = _run(backend, rope=rope)
    start = cache.clone()
    with set_forward_context(**ctx), torch.no_grad():
        want = model(x, positions)
        want_cache = cache.clone()
        cache.copy_(start)
        got = torch.compile(model, fullgraph=True, backend=compiler)(x, positions)
    assert torch.equal(got, want)
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize(("backend", "rope"), CASES,
                         ids=[f"{b.name}-{'rope' if r else 'plain'}" for b, r in CASES])
def test_no_graph_break_and_one_node_per_op(backend: type, rope: bool) -> None:
    model, ctx, cache, x, positions = _run(backend, rope=rope)
    with set_forward_context(**ctx), torch.no_grad():
        explained = torch._dynamo.explain(model)(x, positions)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes
           if n.op == "call_function" and "vllm_kv" in str(n.target)]
    assert ops == (["vllm_kv.write_kv_rope", "vllm_kv.attention"] if rope
                   else ["vllm_kv.write_kv", "vllm_kv.attention"])


def test_kv_sharing_layer_with_rope_compiles_without_a_write() -> None:
    model, ctx, cache, x, positions = _run(TorchRefBackend, rope=True, sharing=True)
    fill_random_bytes(cache, 4)
    with set_forward_context(**ctx), torch.no_grad():
        want = model(x, positions)
        explained = torch._dynamo.explain(model)(x, positions)
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x, positions)
    assert explained.graph_break_count == 0
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_mla_layer_compiles_fullgraph() -> None:
    spec = make_spec(L=64, R=16, P=8, V=8)
    s = mla_setup("TRITON_MLA", [2, 1], [3, 6], block_size=16, spec=spec)
    rope = RoPE.build(16, 16, style="gptj")
    positions = torch.tensor([3, 4, 6])
    layer: MLAAttention = s.layer
    layer.checked = False

    def step(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
             pos: torch.Tensor) -> torch.Tensor:
        return layer(q.clone(), kv_c, k_pe, positions=pos, rope=rope)

    start = s.cache.clone()
    ctx = dict(attn_metadata={"mla": s.meta}, slot_mapping={"mla": s.batch.new_slots})
    with set_forward_context(**ctx), torch.no_grad():  # type: ignore[arg-type]
        want = step(s.q, s.kv_c_new, s.k_pe_new, positions)
        want_cache = s.cache.clone()
        s.cache.copy_(start)
        explained = torch._dynamo.explain(step)(s.q, s.kv_c_new, s.k_pe_new, positions)
        s.cache.copy_(start)
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(
            s.q, s.kv_c_new, s.k_pe_new, positions)
    assert explained.graph_break_count == 0
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(s.cache.view(torch.uint8), want_cache.view(torch.uint8))


def test_inductor_writes_the_cache_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor re-inplaces the write: the op gets the layer's own cache, not a copy."""
    model, ctx, cache, x, positions = _run(TorchRefBackend, rope=True)
    seen: list[int] = []
    real = Attention.write_rope_for_op

    def spy(self: Attention, *args: Any) -> None:
        seen.append(args[3].data_ptr())
        real(self, *args)

    monkeypatch.setattr(Attention, "write_rope_for_op", spy)
    start = cache.clone()
    with set_forward_context(**ctx), torch.no_grad():
        want = model(x, positions)
        want_cache = cache.clone()
        cache.copy_(start)
        got = torch.compile(model, fullgraph=True, backend="inductor")(x, positions)
    assert seen == [cache.data_ptr()]  # (the eager call does not go through the op)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)  # inductor's own matmul order
    assert torch.equal(cache, want_cache)
