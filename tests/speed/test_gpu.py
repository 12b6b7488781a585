"""On CUDA: the cached launcher binds and writes the reference's bytes; the write and a
whole decode step (write + attention, fused RoPE) capture into a CUDA graph and replay
with -1 padding slots, on the Triton path and on each vendor path that imports here
(FlashInfer's graph wrappers also replay a later batch once it is built); the tiled kernel's hardware fp8 conversion equals the reference
on rounding edges; a compiled decoder layer matches eager.

Marked ``gpu`` (skipped with the reason without CUDA). Launch cost is measured by
``benchmarks/bench_launch.py``, not asserted here.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.backends.grid import dense, rel_err
from tests.helpers import any_scale_quant, every_16_bit_pattern, fill_random_bytes, raw
from tests.writers.oracle import edge_values
from vllm.attention import KVQuant, allocate_kv_cache
from vllm.attention.backends.triton_attn import TritonAttentionBackend
from vllm.attention.batch import PagedBatch, make_paged_batch
from vllm.attention.layer import Attention
from vllm.attention.layouts import split_kv_views
from vllm.attention.ops.paged_attention import read_request
from vllm.attention.rope import RoPE, rotate_reference
from vllm.attention.types import KVCacheLayout
from vllm.attention.writers import MLALatentCacheWriter, SplitKVCacheWriter, reference_write
from vllm.attention.writers import kernels as tw
from vllm.attention.writers.kernels import scatter
from vllm.forward_context import set_forward_context

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not tw.triton_importable(), reason="triton is not importable")]
L = KVCacheLayout
DEV = "cuda"


def _split_inputs(t: int, rows: int, cache_dtype: str, seed: int, dtype: torch.dtype = torch.bfloat16,
                  h: int = 8, d: int = 128, nb: int = 64, bs: int = 16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, KVQuant]:
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(rows, h, d, generator=g) * 3).to(dtype).to(DEV)
    value = torch.randn(rows, h, d, generator=g).to(dtype).to(DEV)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[1::3] = -1
    storage = {"auto": dtype, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    cache = torch.empty(nb, 2, bs, h, d, dtype=storage[cache_dtype], device=DEV)
    fill_random_bytes(cache, seed)
    quant = KVQuant(cache_dtype, (torch.rand(h, generator=g) + 0.5).to(DEV),  # type: ignore[arg-type]
                    (torch.rand(h, generator=g) + 0.5).to(DEV))
    return key, value, cache, slots.to(DEV), quant


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("t", [1, 7, 3000])
def test_cached_launch_binds_and_writes_the_reference_bytes(t: int, cache_dtype: str) -> None:
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    for seed in range(3):
        key, value, cache, slots, quant = _split_inputs(t, t + 2, cache_dtype, seed)
        want = cache.clone()
        w.write(key, value, cache, slots, quant)
        reference_write(L.SPLIT_NHD, key, value, want, slots, quant)
        assert torch.equal(raw(cache), raw(want))
    runner = next(iter(w._runners.values()))
    assert isinstance(runner, tw.CachedLaunch)
    _require_bound(runner)


def _require_bound(runner: tw.CachedLaunch) -> None:
    """The direct launch engaged (Triton 3.6 passes empty ``knobs.HookChain`` launch
    hooks, which ``BoundLaunch.bind`` accepts as no hooks)."""
    assert runner.bound, "the cached launch kept Triton's own launcher"
    assert runner.binding is not None and "knobs.launch_enter_hook" in runner.binding.source


@pytest.mark.parametrize("t", [33, 3000])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_fused_rope_cuda_equals_rotate_then_write(style: str, cache_dtype: str, t: int) -> None:
    """The fused RoPE + write at 33 and 3000 tokens, with and without a query, against
    rotate-then-reference-write, byte for byte."""
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    rope = RoPE.build(128, 4096, style=style, device=DEV)  # type: ignore[arg-type]
    for seed in range(4):  # the second call on runs through the bound launch
        key, value, cache, slots, quant = _split_inputs(t, t + 7, cache_dtype, seed,
                                                        nb=max(64, t // 8))
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(t + 7, 32, 128, generator=g).to(torch.bfloat16).to(DEV)
        positions = torch.randint(0, 4096, (t + 7,), generator=g).to(DEV)
        if seed >= 2:  # keys only: the query rotated elsewhere
            want = cache.clone()
            reference_write(L.SPLIT_NHD, rotate_reference(key, positions, rope), value, want,
                            slots, quant)
            w.write_with_rope(None, key, value, cache, slots, quant, positions, rope)
            assert torch.equal(raw(cache), raw(want))
            continue
        want = cache.clone()
        reference_write(L.SPLIT_NHD, rotate_reference(key, positions, rope), value, want, slots,
                        quant)
        q_got = q.clone()
        w.write_with_rope(q_got, key, value, cache, slots, quant, positions, rope)
        assert torch.equal(raw(cache), raw(want))
        assert torch.equal(q_got.view(torch.int16),
                           rotate_reference(q, positions, rope).view(torch.int16))


@pytest.mark.parametrize("t", [1, 3000])
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(("h", "d"), [(1, 2), (1, 4), (2, 16)])
def test_small_heads_cuda_take_the_one_element_code(h: int, d: int, cache_dtype: str,
                                                    t: int) -> None:
    """Tiles too small for two elements a thread (``tw.pairs_fit``; their two-element
    inline PTX does not compile): the fused RoPE + fp8 write and the plain write, byte
    for byte with the reference, through the one-element widening and rounding."""
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    rope = RoPE.build(d, 4096, device=DEV)
    for seed in range(2):
        key, value, cache, slots, quant = _split_inputs(t, t + 3, cache_dtype, seed, h=h, d=d,
                                                        nb=max(64, t // 8))
        positions = torch.randint(0, 4096, (t + 3,),
                                  generator=torch.Generator().manual_seed(seed)).to(DEV)
        want = cache.clone()
        reference_write(L.SPLIT_NHD, rotate_reference(key, positions, rope), value, want, slots,
                        quant)
        w.write_with_rope(None, key, value, cache, slots, quant, positions, rope)
        assert torch.equal(raw(cache), raw(want))
        reference_write(L.SPLIT_NHD, key, value, want, slots, quant)
        w.write(key, value, cache, slots, quant)
        assert torch.equal(raw(cache), raw(want))
    launch = tw.scatter_kv_launch(key, value, *(tw.ScatterTarget.token_major(x) for x in
                                  split_kv_views(cache, L.SPLIT_NHD)), slots, 1,
                                  quant.k_scale, quant.v_scale)
    assert launch.constexprs["HW_CVT"]
    if h * d <= 4:  # at most 16 tokens of 4 values a program: under 2 a thread of 128
        assert not launch.constexprs["PACKED_WIDEN"]


@pytest.mark.parametrize("scales_per", ["head", "tensor"])
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fused_rope_cuda_every_bf16_pattern(cache_dtype: str, scales_per: str,
                                            rope_tokens_per_program: str) -> None:
    """The fused RoPE + fp8 write on the GPU, byte for byte with rotate-then-reference-write
    on the CPU: every bf16 bit pattern as key and value rows at random positions, with
    scales of every class the kernel tells apart (powers of two: multiply; moderate
    non-powers of two: FAST_DIV; tiny or huge: IEEE division), per head and ``[1]``; one
    token and two tokens a program."""
    key = every_16_bit_pattern(torch.bfloat16, 8)
    value = key.flip(0).contiguous()
    n = key.shape[0]
    g = torch.Generator().manual_seed(zlib.crc32(f"{cache_dtype}{scales_per}".encode()))
    positions = torch.randint(0, 64, (n,), generator=g)
    rope_cpu, rope_dev = RoPE.build(128, 64), RoPE.build(128, 64, device=DEV)
    storage = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[cache_dtype]
    if scales_per == "head":
        # a negative or huge scale sends the program's heads to the IEEE division; the
        # second set keeps every head on FAST_DIV
        sets = [[0.5, 2.0, 1.0, 0.25, 4.0, 1.0, 2.0**-10, 8.0],
                [0.37, 3.0, 0.1, 1 / 3, 7.0, 448 / 3, 1.5, 1.5 * 2.0**-30],
                [0.37, 3.0, 0.1, 1 / 3, 7.0, 448 / 3, -1.5, 1.5 * 2.0**-30],
                [0.37, 3.0, 0.1, 1 / 3, 7.0, 448 / 3, -1.5, 2.0**127]]
    else:
        sets = [[v] for v in (0.25, 0.37, 7.0, 1e-3, 2.0**127, 1e-39)]
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    for scales in sets:
        ks = torch.tensor(scales, dtype=torch.float32)
        vs = ks.flip(0).contiguous()
        slots = torch.randperm(n + 16, generator=g)[:n]
        want = torch.zeros(-(-(n + 16) // 16), 2, 16, 8, 128, dtype=storage)
        reference_write(L.SPLIT_NHD, rotate_reference(key, positions, rope_cpu), value, want,
                        slots, any_scale_quant(cache_dtype, ks, vs))
        got = torch.zeros_like(want, device=DEV)
        w.write_with_rope(None, key.to(DEV), value.to(DEV), got, slots.to(DEV),
                          KVQuant(cache_dtype, ks.to(DEV), vs.to(DEV)),  # type: ignore[arg-type]
                          positions.to(DEV), rope_dev)
        diff = (raw(got).cpu() != raw(want)).nonzero()
        assert diff.numel() == 0, f"scales {scales}: {diff.shape[0]} byte(s) differ"


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("t", [33, 3000])
def test_fused_rope_cuda_fp16_fp32_inputs(dtype: str, scale: float, t: int) -> None:
    """The fused RoPE + fp8 write for fp16 and fp32 rows (the compiled kernel rounds the
    rotated keys by the hardware conversion for fp16 and not at all for fp32), a
    power-of-two and a FAST_DIV scale, one-token programs at 4 warps (T=33) and at 2
    (T=3000), with a query, against rotate-then-reference-write on the CPU."""
    torch_dtype = {"fp16": torch.float16, "fp32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(t)
    key = (torch.randn(t, 8, 128, generator=g) * 3).to(torch_dtype)
    value = torch.randn(t, 8, 128, generator=g).to(torch_dtype)
    q = torch.randn(t, 32, 128, generator=g).to(torch_dtype)
    slots = torch.randperm(t + 64, generator=g)[:t]
    slots[1::5] = -1
    positions = torch.randint(0, 4096, (t,), generator=g)
    rope_cpu, rope_dev = RoPE.build(128, 4096), RoPE.build(128, 4096, device=DEV)
    ks = torch.full((8,), scale) * torch.linspace(1.0, 1.0 if scale == 1.0 else 1.7, 8)
    quant = KVQuant("fp8_e4m3", ks, ks.flip(0).contiguous())
    want = torch.empty(-(-(t + 64) // 16), 2, 16, 8, 128, dtype=torch.float8_e4m3fn)
    fill_random_bytes(want, t)
    got = want.clone().to(DEV)
    reference_write(L.SPLIT_NHD, rotate_reference(key, positions, rope_cpu), value, want, slots,
                    quant)
    q_got = q.clone().to(DEV)
    SplitKVCacheWriter(L.SPLIT_NHD).write_with_rope(
        q_got, key.to(DEV), value.to(DEV), got, slots.to(DEV),
        KVQuant("fp8_e4m3", quant.k_scale.to(DEV), quant.v_scale.to(DEV)),
        positions.to(DEV), rope_dev)
    assert torch.equal(raw(got).cpu(), raw(want))
    q_want = rotate_reference(q, positions, rope_cpu)
    assert torch.equal(q_got.cpu().view(-1).view(torch.uint8), q_want.view(-1).view(torch.uint8))


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("t", [5, 3000])
def test_mla_fused_rope_cuda_fp8(scale: float, t: int) -> None:
    """The MLA fused RoPE + fp8 write on the GPU (``k_pe`` rotated as float32 into the
    rope part, the latent quantised alongside), against rotate-then-reference-write on
    the CPU, with the query's rope part rotated in place."""
    g = torch.Generator().manual_seed(t + 1)
    lora, r, heads = 512, 64, 16
    kv_c = torch.randn(t, lora, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(t, 1, r, generator=g).to(torch.bfloat16)
    q = torch.randn(t, heads, 128 + r, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 1024, (t,), generator=g)
    slots = torch.randperm(t + 32, generator=g)[:t]
    slots[::4] = -1
    rope_cpu = RoPE.build(r, 1024, style="gptj")
    rope_dev = RoPE.build(r, 1024, style="gptj", device=DEV)
    quant = KVQuant("fp8_e4m3", torch.tensor([scale]), torch.tensor([scale]))
    want = torch.empty(-(-(t + 32) // 16), 16, lora + r, dtype=torch.float8_e4m3fn)
    fill_random_bytes(want, t)
    got = want.clone().to(DEV)
    reference_write(L.MLA_LATENT, kv_c, rotate_reference(k_pe, positions, rope_cpu), want,
                    slots, quant)
    q_got = q.clone().to(DEV)
    MLALatentCacheWriter().write_with_rope(
        q_got[..., 128:], kv_c.to(DEV), k_pe.to(DEV), got, slots.to(DEV),
        KVQuant("fp8_e4m3", quant.k_scale.to(DEV), quant.v_scale.to(DEV)),
        positions.to(DEV), rope_dev)
    assert torch.equal(raw(got).cpu(), raw(want))
    q_want = q.clone()
    q_want[..., 128:] = rotate_reference(q[..., 128:].contiguous(), positions, rope_cpu)
    assert torch.equal(q_got.cpu().view(torch.int16), q_want.view(torch.int16))


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_tiled_hardware_fp8_equals_reference_on_edges(cache_dtype: str) -> None:
    assert tw.hardware_fp8(torch.device(DEV)) == (torch.cuda.get_device_capability() >= (8, 9))
    x = edge_values()
    d = 128
    rows = x.numel() // d
    key = x[: rows * d].view(rows, 1, d).to(DEV)
    slots = torch.arange(rows, dtype=torch.int64, device=DEV)
    fp8 = torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    quant = KVQuant(cache_dtype, torch.ones(1, device=DEV), torch.ones(1, device=DEV))  # type: ignore[arg-type]
    for min_tokens in (1, 10**9):  # several tokens per program, and one
        tw_min = scatter.TILED_MIN_TOKENS
        scatter.TILED_MIN_TOKENS = min_tokens
        try:
            got = torch.zeros(rows, 2, 1, 1, d, dtype=fp8, device=DEV)
            want = got.clone()
            SplitKVCacheWriter(L.SPLIT_NHD).write(key, key, got, slots, quant, path="triton")
            reference_write(L.SPLIT_NHD, key, key, want, slots, quant)
        finally:
            scatter.TILED_MIN_TOKENS = tw_min
        assert torch.equal(raw(got), raw(want))


def _graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile, bind, then run through the bound launch
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_write_replays_in_a_cuda_graph_with_padding(cache_dtype: str) -> None:
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    key, value, cache, slots, quant = _split_inputs(8, 8, cache_dtype, 0)
    graph = _graph(lambda: w.write(key, value, cache, slots, quant))
    for seed in (1, 2):
        k2, v2, _, s2, _ = _split_inputs(8, 8, cache_dtype, seed)
        s2[5:] = -1  # this step has 5 tokens; the rest of the captured batch is padding
        key.copy_(k2)
        value.copy_(v2)
        slots.copy_(s2)
        want = cache.clone()
        reference_write(L.SPLIT_NHD, key, value, want, slots, quant)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(raw(cache), raw(want))


def test_mla_write_replays_in_a_cuda_graph() -> None:
    w = MLALatentCacheWriter()
    g = torch.Generator().manual_seed(0)
    kv_c = torch.randn(4, 512, generator=g).to(torch.bfloat16).to(DEV)
    k_pe = torch.randn(4, 64, generator=g).to(torch.bfloat16).to(DEV)
    cache = torch.zeros(8, 64, 576, dtype=torch.bfloat16, device=DEV)
    slots = torch.tensor([3, 70, -1, -1], device=DEV)
    quant = KVQuant.unscaled(device=DEV)
    graph = _graph(lambda: w.write(kv_c, k_pe, cache, slots, quant))
    slots.copy_(torch.tensor([9, -1, 100, -1]))
    kv_c.normal_()
    want = cache.clone()
    reference_write(L.MLA_LATENT, kv_c, k_pe, want, slots, quant)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(raw(cache), raw(want))


# (backend, the compute path a decode step runs there): vendor rows skip where the
# vendor package does not import (or the GPU is not one it runs on).
_GRAPH_PATHS = [("TRITON_ATTN", "triton"), ("FLASHINFER", "flashinfer"),
                ("FLASHINFER_HND", "flashinfer"), ("FLASH_ATTN", "flash_attn.cute")]


def _graph_layer(name: str, path: str, batch: PagedBatch, bs: int, hq: int, hkv: int, d: int
                 ) -> tuple[Attention, torch.Tensor, Any]:
    from vllm.attention.backends.standard import StandardBackend
    from vllm.attention.registry import get_backend

    backend = get_backend(name)
    if path != "triton":
        assert issubclass(backend, StandardBackend)
        kernel = next(k for k in backend.vendor_kernels if k.name == path)
        reason = kernel.unavailable_reason(torch.device(DEV))
        if reason is not None:
            pytest.skip(f"{path}: {reason}")
    layer = Attention(num_heads=hq, num_kv_heads=hkv, head_size=d, scale=d ** -0.5,
                      backend=backend, layer_name="g0")
    cache = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=bs,
                              num_kv_heads=hkv, head_size=d, model_dtype=torch.bfloat16,
                              device=DEV)
    cache.normal_()
    layer.bind_kv_cache(cache, bs)
    builder = backend.get_builder_cls()(layer.spec, torch.device(DEV))
    if path == "flashinfer":  # the request count these graphs capture
        builder.cuda_graph_sizes = [batch.common.num_reqs]
    return layer, cache, builder


@pytest.mark.parametrize(("name", "path"), _GRAPH_PATHS)
def test_decode_step_replays_in_a_cuda_graph_with_padding(name: str, path: str) -> None:
    """Write (fused RoPE) + attention of one layer, 3 requests padded to 4 rows, on each
    compute path: the replay equals the eager step bit for bit."""
    bs, hq, hkv, d = 16, 8, 2, 128
    batch = make_paged_batch([1, 1, 1], [40, 17, 300], block_size=bs, device=DEV,
                             generator=torch.Generator().manual_seed(0))
    layer, cache, builder = _graph_layer(name, path, batch, bs, hq, hkv, d)
    meta = builder.build(batch.common)
    rope = RoPE.build(d, 1024, device=DEV)
    q = torch.zeros(4, hq, d, dtype=torch.bfloat16, device=DEV)
    k = torch.zeros(4, hkv, d, dtype=torch.bfloat16, device=DEV)
    v = torch.zeros_like(k)
    out = torch.zeros_like(q)
    slots = torch.full((4,), -1, dtype=torch.int64, device=DEV)
    positions = torch.zeros(4, dtype=torch.int64, device=DEV)
    ctx = dict(attn_metadata={"g0": meta}, slot_mapping={"g0": slots})

    def step() -> None:
        layer(q, k, v, out, positions=positions, rope=rope)

    with set_forward_context(**ctx):  # type: ignore[arg-type]
        graph = _graph(step)
    assert layer.impl.last_compute_path == path
    g = torch.Generator().manual_seed(1)
    q_in = torch.randn(4, hq, d, generator=g).to(torch.bfloat16).to(DEV)
    k_in = torch.randn(4, hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    v_in = torch.randn(4, hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    real_slots = torch.cat([batch.new_slots, torch.full((1,), -1, device=DEV)])
    real_pos = torch.cat([batch.positions, torch.zeros(1, dtype=torch.int64, device=DEV)])
    start = cache.clone()
    # eager, on the same inputs
    with set_forward_context(attn_metadata={"g0": meta}, slot_mapping={"g0": real_slots}):
        want = layer(q_in.clone(), k_in, v_in, positions=real_pos, rope=rope)
    assert layer.impl.last_compute_path == path
    want_cache = cache.clone()
    cache.copy_(start)
    for src, dst in ((q_in, q), (k_in, k), (v_in, v), (real_slots, slots), (real_pos, positions)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(raw(cache), raw(want_cache))
    assert torch.equal(out[:3].view(torch.int16), want[:3].view(torch.int16))


@pytest.mark.parametrize("name", ["FLASHINFER", "FLASHINFER_HND"])
def test_flashinfer_graph_replays_the_plan_of_the_last_build(name: str) -> None:
    """A graph captured over one decode batch replays another batch of as many requests
    once the builder has built (planned) it: other lengths, other blocks."""
    bs, hq, hkv, d = 16, 8, 2, 128
    g = torch.Generator().manual_seed(2)
    first = make_paged_batch([1, 1, 1], [40, 17, 300], block_size=bs, num_blocks=200,
                             device=DEV, generator=g)
    layer, cache, builder = _graph_layer(name, "flashinfer", first, bs, hq, hkv, d)
    q = torch.randn(3, hq, d, generator=g).to(torch.bfloat16).to(DEV)
    k = torch.randn(3, hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    v = torch.randn(3, hkv, d, generator=g).to(torch.bfloat16).to(DEV)
    out = torch.zeros_like(q)
    slots = first.new_slots.clone()
    meta = builder.build(first.common)
    with set_forward_context(attn_metadata={"g0": meta}, slot_mapping={"g0": slots}):
        graph = _graph(lambda: layer(q, k, v, out))
    second = make_paged_batch([1, 1, 1], [900, 3, 64], block_size=bs, num_blocks=200,
                              device=DEV, generator=g)
    meta2 = builder.build(second.common)
    assert meta2.cuda_graph_safe
    for src, dst in ((torch.randn(3, hq, d, generator=g), q), (torch.randn(3, hkv, d, generator=g), k),
                     (torch.randn(3, hkv, d, generator=g), v)):
        dst.copy_(src.to(torch.bfloat16))
    slots.copy_(second.new_slots)
    start = cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    got, got_cache = out.clone(), cache.clone()
    cache.copy_(start)
    with set_forward_context(attn_metadata={"g0": meta2}, slot_mapping={"g0": slots}):
        want = layer(q.clone(), k, v)
    assert torch.equal(raw(got_cache), raw(cache))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # and against float64 over the blocks the second batch names
    kv = layer.impl.paged_kv(layer, cache, meta2)
    for i, n in enumerate(second.common.seq_lens_cpu.tolist()):
        kk, vv = read_request(kv, second.common.block_table[i], n, torch.float64)
        ref = dense(q[i:i + 1], kk, vv, scale=d ** -0.5, causal=True)
        assert rel_err(got[i:i + 1], ref) < 1e-2


def test_compiled_decoder_layer_matches_eager_on_cuda() -> None:
    from tests.speed.test_compile import TinyDecoderLayer

    bs = 16
    batch = make_paged_batch([2, 1], [5, 30], block_size=bs, device=DEV,
                             generator=torch.Generator().manual_seed(0))
    model = TinyDecoderLayer(TritonAttentionBackend, "c0", rope=True).to(DEV)
    model.rope = RoPE.build(16, 64, device=DEV)
    cache = allocate_kv_cache(TritonAttentionBackend, num_blocks=batch.num_blocks,
                              block_size=bs, num_kv_heads=2, head_size=16,
                              model_dtype=torch.float32, device=DEV)
    cache.normal_()
    model.attn.bind_kv_cache(cache, bs)
    meta = TritonAttentionBackend.get_builder_cls()(model.attn.spec, torch.device(DEV)).build(
        batch.common)
    x = torch.randn(3, 32, device=DEV)
    start = cache.clone()
    torch._dynamo.reset()
    with set_forward_context(attn_metadata={"c0": meta}, slot_mapping={"c0": batch.new_slots}):
        want = model(x, batch.positions)
        want_cache = cache.clone()
        cache.copy_(start)
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x, batch.positions)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    assert torch.equal(cache, want_cache)
