"""``torch.compile(fullgraph=True)`` of a small decoder layer has no graph break with
any backend (TORCH_REF and TRITON_ATTN here, torch paths on CPU; MLA too): the write
and the compute are single ``vllm_kv`` op nodes. Under ``eager`` and ``aot_eager`` the
compiled layer runs the eager aten kernels (one thread, see conftest.py), so it writes
the same cache bytes and returns the same output bits. Inductor generates its own
code for the projections and RoPE, whose rounding differs by CPU: there the write is
checked bit-exact against the op's own inputs, and the inputs against eager within a
tolerance."""

from __future__ import annotations

import math
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
from vllm.attention.rope import RoPE, rotate_reference
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


def _expected_cache(start: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, positions: torch.Tensor, rope: RoPE) -> torch.Tensor:
    """``start`` (a TORCH_REF cache ``[nb, 2, bs, H, D]``) with token ``i``'s rotated key
    and its value in slot ``slots[i]``, every other byte as it was."""
    n = slots.shape[0]
    rotated = rotate_reference(key[:n], positions[:n], rope)
    want = start.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // BS, 0, slot % BS] = rotated[i]
            want[slot // BS, 1, slot % BS] = value[i]
    return want


def _assert_written_in_place(cache: torch.Tensor, want_eager: torch.Tensor,
                             expected: torch.Tensor) -> None:
    """The compiled write's cache is bit-for-bit ``start`` plus the op's own inputs in
    the named slots (so: in place, those slots, nothing else), and those inputs are the
    eager ones up to the compiler's rounding."""
    assert torch.equal(cache.view(torch.int32), expected.view(torch.int32)), (
        "the compiled layer's cache is not the op's inputs written into the named slots")
    # the K/V the compiled graph computed (inductor's own matmul and RoPE code), not
    # their bits: those differ by an ULP between CPUs
    torch.testing.assert_close(cache, want_eager, rtol=1e-5, atol=1e-6)


def test_written_in_place_check_catches_a_wrong_cache() -> None:
    """The check above fails on a cache a slot short, written twice, or touched elsewhere."""
    model, ctx, cache, x, positions = _run(TorchRefBackend, rope=True)
    slots = ctx["slot_mapping"][model.attn.layer_name]
    assert model.rope is not None
    key = torch.randn(slots.shape[0], HKV, D, generator=torch.Generator().manual_seed(5))
    value = torch.randn(slots.shape[0], HKV, D, generator=torch.Generator().manual_seed(6))
    start = cache.clone()
    expected = _expected_cache(start, slots, key, value, positions, model.rope)
    _assert_written_in_place(expected.clone(), expected, expected)
    first = int(slots[0])
    outside = next(s for s in range(start.shape[0] * BS) if s not in slots.tolist())
    unwritten = expected.clone()
    unwritten[first // BS, :, first % BS] = start[first // BS, :, first % BS]
    touched = expected.clone()
    touched[outside // BS, 1, outside % BS, 0, 0] += 1.0
    nudged = expected.clone()
    nudged[first // BS, 0, first % BS, 0, 0] = torch.nextafter(
        nudged[first // BS, 0, first % BS, 0, 0], torch.tensor(math.inf))
    for wrong in (unwritten, touched, nudged):
        with pytest.raises(AssertionError):
            _assert_written_in_place(wrong, expected, expected)


@pytest.mark.parametrize("rounding", ["as_compiled", "key_one_ulp_up"])
def test_inductor_writes_the_cache_in_place(monkeypatch: pytest.MonkeyPatch,
                                            rounding: str) -> None:
    """Inductor re-inplaces the write: the op gets the layer's own cache, not a copy, and
    writes exactly its inputs into the named slots. ``key_one_ulp_up`` hands the op keys
    one ULP off the compiled ones, as another CPU's inductor code may compute them: the
    test must not depend on that rounding."""
    model, ctx, cache, x, positions = _run(TorchRefBackend, rope=True)
    slots = ctx["slot_mapping"][model.attn.layer_name]
    seen: list[int] = []
    handed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, RoPE]] = []
    real = Attention.write_rope_for_op

    def spy(self: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            kv_cache: torch.Tensor, pos: torch.Tensor, cos_sin_cache: torch.Tensor,
            is_neox: bool) -> None:
        if rounding == "key_one_ulp_up":
            key = torch.nextafter(key, torch.full_like(key, math.inf))
        seen.append(kv_cache.data_ptr())
        handed.append((key.clone(), value.clone(), pos.clone(),
                       RoPE(cos_sin_cache.clone(), "neox" if is_neox else "gptj")))
        real(self, query, key, value, kv_cache, pos, cos_sin_cache, is_neox)

    monkeypatch.setattr(Attention, "write_rope_for_op", spy)
    start = cache.clone()
    with set_forward_context(**ctx), torch.no_grad():
        want = model(x, positions)
        want_cache = cache.clone()
        cache.copy_(start)
        got = torch.compile(model, fullgraph=True, backend="inductor")(x, positions)
    assert seen == [cache.data_ptr()]  # (the eager call does not go through the op)
    (key, value, pos, rope), = handed
    _assert_written_in_place(cache, want_cache, _expected_cache(start, slots, key, value,
                                                                pos, rope))
    if rounding == "key_one_ulp_up":
        assert not torch.equal(cache, want_cache)  # what a bit-equal check would reject
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # inductor's own matmul order
