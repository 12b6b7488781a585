"""FLASHINFER's planning, on CPU with a stand-in for the ``flashinfer`` package.

The stand-in's wrapper keeps what ``plan`` gives it the way FlashInfer does (a CUDA-graph
wrapper copies into the buffers it was built with, an ordinary one keeps its own copy)
and ``run`` attends through those arrays only, so an output is right only when the plan
it ran under describes the batch. What is checked:

* ``build`` plans every layer shape the builder has served, once per step, shared by
  the layers; ``forward`` plans only a shape it meets first;
* decode-only batches are planned into CUDA-graph wrappers whose buffers stay put from
  step to step; other batches into ordinary wrappers;
* metadata whose wrapper was planned again since is planned again before it runs;
* fp8 scales are read from the device once per version of the scale tensor.

The real package runs in ``tests/backends/test_gpu.py`` and ``tests/speed/test_gpu.py``.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from tests.backends.grid import dense, rel_err
from vllm.attention import allocate_kv_cache
from vllm.attention.backend import AttentionBackend
from vllm.attention.backends import flashinfer as fi_backend
from vllm.attention.backends.flashinfer import (
    FlashInferBackend,
    FlashInferHNDBackend,
    FlashInferMetadata,
    FlashInferPagedKernel,
)
from vllm.attention.batch import PagedBatch, make_paged_batch
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.layer import Attention
from vllm.attention.ops.paged_attention import read_request
from vllm.attention.types import host_scale
from vllm.forward_context import set_forward_context

CPU = torch.device("cpu")
HQ, HKV, D, BS = 4, 2, 64, 16


class _Wrapper:
    """Keeps the planned arrays as FlashInfer does and attends through them alone."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str, use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None) -> None:
        self.layout, self.graph = kv_layout, use_cuda_graph
        self.bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                     paged_kv_last_page_len_buf)
        self.num_plans = 0
        self.arrays: tuple[torch.Tensor, ...] = ()
        self.params: dict[str, Any] = {}
        _FAKE.wrappers.append(self)

    def plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
             last: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, **kw: Any) -> None:
        assert qo_indptr.device.type == "cpu" and indptr.device.type == "cpu"
        self.num_plans += 1
        self.params = dict(kw, heads=(num_qo_heads, num_kv_heads, head_dim, page_size))
        if self.graph:
            qo_b, ip_b, ix_b, last_b = self.bufs
            assert qo_b is not None and ip_b is not None and ix_b is not None and last_b is not None
            assert qo_b.numel() == qo_indptr.numel() and indices.numel() <= ix_b.numel()
            qo_b.copy_(qo_indptr)
            ip_b.copy_(indptr)
            ix_b[: indices.numel()].copy_(indices)
            last_b.copy_(last)
            self.arrays = (qo_b, ip_b, ix_b, last_b)
        else:
            self.arrays = (qo_indptr.clone(), indptr.clone(), indices.clone(), last.clone())

    def run(self, q: torch.Tensor, cache: torch.Tensor, *, k_scale: float | None,
            v_scale: float | None, out: torch.Tensor | None) -> torch.Tensor:
        qo, indptr, indices, last = (a.tolist() for a in self.arrays)
        hq, hkv, d, bs = self.params["heads"]
        k_all, v_all = cache[:, 0], cache[:, 1]
        if self.layout == "HND":  # (nb, H, bs, D) -> (nb, bs, H, D)
            k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)
        result = torch.zeros(q.shape[0], hq, d, dtype=q.dtype) if out is None else out
        for i in range(len(qo) - 1):
            pages = indices[indptr[i]:indptr[i + 1]]
            n = (len(pages) - 1) * bs + last[i]
            k = k_all[pages].reshape(-1, hkv, d)[:n].float() * (k_scale or 1.0)
            v = v_all[pages].reshape(-1, hkv, d)[:n].float() * (v_scale or 1.0)
            w = self.params["window_left"]
            got = dense(q[qo[i]:qo[i + 1]], k, v, scale=self.params["sm_scale"],
                        causal=self.params["causal"], window=None if w < 0 else w + 1,
                        cap=self.params["logits_soft_cap"])
            result[qo[i]:qo[i + 1]] = got.to(result.dtype)
        return result


class _FakeFlashInfer:
    def __init__(self) -> None:
        self.wrappers: list[_Wrapper] = []
        self.module = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Wrapper)

    @property
    def num_plans(self) -> int:
        return sum(w.num_plans for w in self.wrappers)


_FAKE = _FakeFlashInfer()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _FakeFlashInfer:
    _FAKE.wrappers.clear()
    monkeypatch.setattr(fi_backend, "_import_flashinfer", lambda: _FAKE.module)
    monkeypatch.setattr(FlashInferPagedKernel, "unavailable_reason", lambda self, device: None)
    monkeypatch.setattr(fi_backend, "_workspace", lambda device: torch.empty(0))
    return _FAKE


def _layers(backend: type[AttentionBackend[Any]], n: int, num_blocks: int,
            window: int | None = None) -> tuple[list[Attention], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    layers, caches = [], []
    for i in range(n):
        layer = Attention(num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=0.125,
                          backend=backend, layer_name=f"l{i}", sliding_window=window)
        cache = allocate_kv_cache(backend, num_blocks=num_blocks, block_size=BS,
                                  num_kv_heads=HKV, head_size=D, model_dtype=torch.bfloat16,
                                  device="cpu")
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
        layer.bind_kv_cache(cache, BS)
        layers.append(layer)
        caches.append(cache)
    return layers, caches


def _step(layers: list[Attention], caches: list[torch.Tensor], batch: PagedBatch,
          meta: FlashInferMetadata, seed: int, window: int | None = None) -> None:
    """One step through every layer; each output is checked against float64 attention
    over the K/V that the block table and sequence lengths (not the plan) name, read
    back through the writers' address decoder."""
    g = torch.Generator().manual_seed(seed)
    t = int(batch.common.query_start_loc_cpu[-1])
    names = [layer.layer_name for layer in layers]
    with set_forward_context(attn_metadata=dict.fromkeys(names, meta),
                             slot_mapping=dict.fromkeys(names, batch.new_slots)):
        for layer, cache in zip(layers, caches):
            q = torch.randn(t, HQ, D, generator=g).bfloat16()
            k = torch.randn(t, HKV, D, generator=g).bfloat16()
            v = torch.randn(t, HKV, D, generator=g).bfloat16()
            out = layer(q, k, v)
            assert layer.impl.last_compute_path == "flashinfer"
            qsl = batch.common.query_start_loc_cpu.tolist()
            kv = layer.impl.paged_kv(layer, cache, meta)
            for i, n in enumerate(batch.common.seq_lens_cpu.tolist()):
                kk, vv = read_request(kv, batch.common.block_table[i], n, torch.float64)
                want = dense(q[qsl[i]:qsl[i + 1]], kk, vv, scale=0.125, causal=True,
                             window=window)
                assert rel_err(out[qsl[i]:qsl[i + 1]], want) < 1e-2


@pytest.mark.parametrize("backend", [FlashInferBackend, FlashInferHNDBackend])
def test_build_plans_once_per_step_and_forward_only_a_new_shape(
        fake: _FakeFlashInfer, backend: type[AttentionBackend[Any]]) -> None:
    g = torch.Generator().manual_seed(0)
    prefill = make_paged_batch([5, 9], [0, 20], block_size=BS, num_blocks=40, generator=g)
    layers, caches = _layers(backend, 3, 40)
    builder = backend.get_builder_cls()(layers[0].spec, CPU)
    meta = builder.build(prefill.common)
    assert fake.num_plans == 0 and not meta.cuda_graph_safe  # no shape served yet
    _step(layers, caches, prefill, meta, seed=1)
    assert fake.num_plans == 1  # the first layer planned; the other two reused it
    decode = make_paged_batch([1, 1, 1, 1], [17, 40, 3, 9], block_size=BS, num_blocks=40,
                              generator=g)
    meta = builder.build(decode.common)
    assert fake.num_plans == 2 and meta.cuda_graph_safe
    _step(layers, caches, decode, meta, seed=2)
    assert fake.num_plans == 2  # forward planned nothing
    graph_wrapper = fake.wrappers[-1]
    assert graph_wrapper.graph and graph_wrapper.layout == ("HND" if backend is FlashInferHNDBackend else "NHD")
    assert not fake.wrappers[0].graph


def test_graph_wrappers_keep_their_buffers_and_stale_metadata_is_planned_again(
        fake: _FakeFlashInfer) -> None:
    g = torch.Generator().manual_seed(3)
    layers, caches = _layers(FlashInferBackend, 1, 64)
    builder = FlashInferBackend.get_builder_cls()(layers[0].spec, CPU)
    first = make_paged_batch([1, 1], [30, 5], block_size=BS, num_blocks=64, generator=g)
    _step(layers, caches, first, builder.build(first.common), seed=4)  # learns the shape
    a = make_paged_batch([1, 1], [100, 2], block_size=BS, num_blocks=64, generator=g)
    b = make_paged_batch([1, 1], [7, 64], block_size=BS, num_blocks=64, generator=g)
    meta_a, meta_b = builder.build(a.common), builder.build(b.common)
    plan_a, plan_b = next(iter(meta_a.plans.values())), next(iter(meta_b.plans.values()))
    assert plan_a.wrapper is plan_b.wrapper  # one graph wrapper for two requests
    ptrs = [buf.data_ptr() for buf in plan_a.wrapper.bufs]
    plans = fake.num_plans
    _step(layers, caches, a, meta_a, seed=5)  # b was planned last: a is planned again
    assert fake.num_plans == plans + 1
    _step(layers, caches, b, meta_b, seed=6)
    assert fake.num_plans == plans + 2
    _step(layers, caches, b, meta_b, seed=7)  # still current
    assert fake.num_plans == plans + 2
    assert [buf.data_ptr() for buf in plan_a.wrapper.bufs] == ptrs
    four = make_paged_batch([1, 1, 1, 1], [1, 2, 3, 4], block_size=BS, num_blocks=64,
                            generator=g)
    meta4 = builder.build(four.common)
    assert next(iter(meta4.plans.values())).wrapper is not plan_a.wrapper  # one per size


def test_graph_wrappers_only_for_the_declared_request_counts(
        fake: _FakeFlashInfer, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(14)
    layers, caches = _layers(FlashInferBackend, 1, 64)
    builder = FlashInferBackend.get_builder_cls()(layers[0].spec, CPU)
    assert builder.cuda_graph_sizes == fi_backend.CUDA_GRAPH_SIZES and 3 not in builder.cuda_graph_sizes
    three = make_paged_batch([1, 1, 1], [30, 5, 60], block_size=BS, num_blocks=64, generator=g)
    _step(layers, caches, three, builder.build(three.common), seed=15)
    meta = builder.build(three.common)
    assert not meta.cuda_graph_safe and not fake.wrappers[-1].graph
    # a capture of it is refused by name, before FlashInfer sees it
    monkeypatch.setattr(fi_backend, "_capturing", lambda: True)
    with pytest.raises(InvalidArgumentError, match="attn_metadata.*cuda_graph_sizes"):
        _step(layers, caches, three, meta, seed=16)
    monkeypatch.setattr(fi_backend, "_capturing", lambda: False)
    builder.cuda_graph_sizes = [3]
    meta = builder.build(three.common)
    assert meta.cuda_graph_safe and fake.wrappers[-1].graph
    _step(layers, caches, three, meta, seed=17)
    with pytest.raises(InvalidArgumentError, match="cuda_graph_sizes"):
        builder.cuda_graph_sizes = [0, 2]


def test_planning_under_capture_is_refused_by_name(
        fake: _FakeFlashInfer, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(18)
    layers, caches = _layers(FlashInferBackend, 1, 64)
    builder = FlashInferBackend.get_builder_cls()(layers[0].spec, CPU)
    batch = make_paged_batch([1, 1], [30, 5], block_size=BS, num_blocks=64, generator=g)
    meta = builder.build(batch.common)  # the builder has not met the shape yet
    monkeypatch.setattr(fi_backend, "_capturing", lambda: True)
    with pytest.raises(InvalidArgumentError, match="run one step eagerly first"):
        _step(layers, caches, batch, meta, seed=19)
    assert fake.num_plans == 0


def test_a_decode_batch_past_the_graph_buffer_gets_an_ordinary_wrapper(
        fake: _FakeFlashInfer) -> None:
    g = torch.Generator().manual_seed(8)
    layers, caches = _layers(FlashInferBackend, 1, 64)
    builder = FlashInferBackend.get_builder_cls()(layers[0].spec, CPU)
    assert builder.planner is not None
    builder.planner.graph_max_pages = 4
    small = make_paged_batch([1], [40], block_size=BS, num_blocks=64, generator=g)  # 3 pages
    _step(layers, caches, small, builder.build(small.common), seed=9)
    big = make_paged_batch([1, 1], [40, 40], block_size=BS, num_blocks=64, generator=g)  # 6
    meta = builder.build(big.common)
    assert not meta.cuda_graph_safe and not fake.wrappers[-1].graph
    _step(layers, caches, big, meta, seed=10)


def test_window_and_scale_reach_the_plan(fake: _FakeFlashInfer) -> None:
    g = torch.Generator().manual_seed(11)
    layers, caches = _layers(FlashInferBackend, 1, 40, window=7)
    batch = make_paged_batch([6, 1], [10, 25], block_size=BS, num_blocks=40, generator=g)
    meta = FlashInferBackend.get_builder_cls()(layers[0].spec, CPU).build(batch.common)
    _step(layers, caches, batch, meta, seed=12, window=7)
    params = fake.wrappers[0].params
    assert params["window_left"] == 6 and params["sm_scale"] == 0.125 and params["causal"]
    assert params["q_data_type"] == torch.bfloat16 and params["kv_data_type"] == torch.bfloat16


def test_no_planner_where_flashinfer_cannot_run() -> None:
    batch = make_paged_batch([2], [3], block_size=BS)
    layers, _ = _layers(FlashInferBackend, 1, batch.num_blocks)
    builder = FlashInferBackend.get_builder_cls()(layers[0].spec, CPU)
    assert builder.planner is None
    meta = builder.build(batch.common)
    assert meta.plans == {} and not meta.cuda_graph_safe


def test_host_scale_is_read_once_per_version() -> None:
    t = torch.tensor([0.5])
    assert host_scale(t) == 0.5
    t.fill_(0.25)  # an in-place change bumps the version: read again
    assert host_scale(t) == 0.25
    u = torch.tensor([2.0])
    assert host_scale(u) == 2.0 and host_scale(t) == 0.25


def test_csr_pages_match_the_block_table_on_random_batches() -> None:
    from vllm.attention.backend import CommonAttentionMetadata

    g = torch.Generator().manual_seed(13)
    for _ in range(20):
        n = int(torch.randint(1, 6, (1,), generator=g))
        lens = torch.randint(0, 90, (n,), generator=g).to(torch.int32)
        width = int((lens.max() + BS - 1) // BS) + int(torch.randint(0, 3, (1,), generator=g))
        table = torch.randint(0, 1000, (n, max(width, 1)), generator=g, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=lens,
            block_table=table.t().contiguous().t(),  # a strided table, as a slice would be
            query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32), seq_lens_cpu=lens,
            num_reqs=n, num_actual_tokens=n, max_query_len=1,
            max_seq_len=max(int(lens.max()), 1), block_size=BS)
        csr = fi_backend._csr_pages(common)
        want: list[int] = []
        for i, s in enumerate(lens.tolist()):
            want += table[i, : -(-s // BS)].tolist()
        assert csr["paged_kv_indices"].tolist() == want
        assert csr["paged_kv_indptr_cpu"][-1] == len(want)
        used = [(s - 1) % BS + 1 if s else 0 for s in lens.tolist()]
        assert csr["paged_kv_last_page_len_cpu"].tolist() == used
