"""The writers on CUDA: the Triton kernels (the default there) and the torch
reference, each against the independent oracle; the two byte-identical on
rounding edges; int64 addressing past 2**31 elements; CUDA-graph capture.

Marked ``gpu``: skipped (with the reason) without CUDA. The Triton tests also skip,
with the reason, where Triton is not importable.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.writers.oracle import Case, L, all_cases, check, edge_values, prepare, write
from vllm.attention import KVQuant
from vllm.attention.ops.triton_writers import triton_importable
from vllm.attention.writers import (
    FP8DsMLACacheWriter,
    PerTokenHeadKVCacheWriter,
    SplitKVCacheWriter,
    mla_writer_for_layout,
    writer_for_layout,
)
from vllm.attention.writers.readback import read_slots

pytestmark = pytest.mark.gpu

CASES = all_cases()
needs_triton = pytest.mark.skipif(not triton_importable(),
                                  reason="triton is not importable: no Triton kernels to test")


def _writer_path(case: Case) -> str:
    dev = torch.device("cuda")
    if case.mla:
        return mla_writer_for_layout(case.layout).path(dev)  # type: ignore[attr-defined, no-any-return]
    return writer_for_layout(case.layout).path(dev)  # type: ignore[attr-defined, no-any-return]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_writer_cuda(case: Case) -> None:
    assert _writer_path(case) == "triton"
    w = prepare(case, "cuda", seed=zlib.crc32(case.id.encode()))
    write(w, None)
    check(w)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_torch_reference_cuda(case: Case) -> None:
    w = prepare(case, "cuda", seed=zlib.crc32(case.id.encode()))
    write(w, "torch")
    check(w)


@needs_triton
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_rounding_edges_cuda(cache_dtype: str) -> None:
    d = 128
    x = edge_values()
    rows = -(-x.numel() // d)
    key = torch.cat([x, torch.ones(rows * d - x.numel())]).view(rows, 1, d)
    fp8 = torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    writer = SplitKVCacheWriter(L.SPLIT_NHD)
    slots = torch.arange(rows, dtype=torch.int64)
    out = {}
    for device, path in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        quant = KVQuant(cache_dtype, torch.ones(1, device=device),  # type: ignore[arg-type]
                        torch.ones(1, device=device))
        cache = torch.zeros(rows, 2, 1, 1, d, dtype=torch.uint8, device=device).view(fp8)
        writer.write(key.to(device), key.to(device), cache, slots.to(device), quant,
                     path=path)  # type: ignore[arg-type]
        out[(device, path)] = cache.view(torch.uint8).cpu()
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "torch")])
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "triton")])


@needs_triton
@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_edges_cuda(cache_dtype: str) -> None:
    h, d = 8, 16
    x = edge_values()
    key = x[: x.numel() // (h * d) * (h * d)].view(-1, h, d)
    rows = key.shape[0]
    slots = torch.arange(rows, dtype=torch.int64)
    out = {}
    for device, path in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        quant = KVQuant(cache_dtype, torch.ones(1, device=device),  # type: ignore[arg-type]
                        torch.ones(1, device=device))
        cache = torch.zeros(rows, 2, 1, h, d + 4, dtype=torch.uint8, device=device)
        PerTokenHeadKVCacheWriter().write(key.to(device), key.to(device), cache,
                                          slots.to(device), quant, path=path)  # type: ignore[arg-type]
        out[(device, path)] = cache.cpu()
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "torch")])
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "triton")])


@needs_triton
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_fp8_ds_mla_edges_cuda(in_dtype: torch.dtype) -> None:
    x = edge_values()
    x = x[: x.numel() // 512 * 512].view(-1, 512).to(in_dtype)
    pe = edge_values()[: x.shape[0] * 64].view(-1, 64).to(in_dtype)
    rows = x.shape[0]
    slots = torch.arange(rows, dtype=torch.int64)
    out = {}
    for device, path in (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")):
        quant = KVQuant("fp8_ds_mla", torch.ones(1, device=device), torch.ones(1, device=device))
        cache = torch.zeros(rows, 1, 656, dtype=torch.uint8, device=device)
        FP8DsMLACacheWriter().write(x.to(device), pe.to(device), cache, slots.to(device), quant,
                                    path=path)  # type: ignore[arg-type]
        out[(device, path)] = cache.cpu()
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "torch")])
    assert torch.equal(out[("cpu", "torch")], out[("cuda", "triton")])


@needs_triton
def test_cache_past_2_pow_31_elements() -> None:
    """Slots whose element offset does not fit in int32 land where they should."""
    bs, h, d = 16, 8, 128
    per_block = 2 * bs * h * d
    nb = 2**31 // per_block + 4
    cache = torch.zeros(nb, 2, bs, h, d, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    slots = torch.tensor([0, nb * bs - 1, (nb - 2) * bs + 3, -1], device="cuda")
    key = torch.randn(4, h, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(4, h, d, device="cuda", dtype=torch.bfloat16)
    quant = KVQuant("fp8_e4m3", torch.ones(1, device="cuda"), torch.ones(1, device="cuda"))
    SplitKVCacheWriter(L.SPLIT_NHD).write(key, value, cache, slots, quant)
    got = read_slots(L.SPLIT_NHD, cache, slots[:3])
    want_k = key[:3].float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    want_v = value[:3].float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got[0].view(torch.uint8), want_k)
    assert torch.equal(got[1].view(torch.uint8), want_v)
    # and nothing else: every other byte of the 2 GiB cache is still zero
    nonzero = int(cache.view(torch.uint8).count_nonzero())
    assert nonzero == int(want_k.count_nonzero()) + int(want_v.count_nonzero())
    del cache
    torch.cuda.empty_cache()


@needs_triton
def test_triton_write_captures_in_a_cuda_graph() -> None:
    """The Triton write has no host sync: it can be captured and replayed with new slots."""
    case = Case(L.SPLIT_NHD, "bf16", "fp8_e4m3", 16, "scale_per_head")
    w = prepare(case, "cuda", seed=3)
    writer = writer_for_layout(case.layout)
    slots = w.slots.clone()
    writer.write(w.key, w.value, w.cache, slots, w.quant)  # compile outside the capture
    w.storage.copy_(w.before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        writer.write(w.key, w.value, w.cache, slots, w.quant)
    w.storage.copy_(w.before)
    graph.replay()
    check(w)
    other = prepare(case, "cuda", seed=4)  # same shapes, other slots
    slots.copy_(other.slots)
    w.storage.copy_(w.before)
    w.slots = other.slots
    graph.replay()
    check(w)
