"""MLA on a real GPU (skipped without CUDA): the kit on every backend (its default
path there: the vendor kernel where importable and supported, else Triton), and the
Triton kernels against the torch path at long contexts (many splits)."""

from __future__ import annotations

import pytest
import torch

from tests.mla.helpers import MLA_NAMES
from vllm.attention.conformance_mla import check_mla_backend
from vllm.attention.ops.mla_attention import DecodeGroup, LatentFormat, mla_decode_torch
from vllm.attention.registry import get_backend

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", MLA_NAMES)
def test_conformance_cuda(name: str) -> None:
    backend = get_backend(name)
    print(name, "decode path on cuda:", backend.compute_path(torch.device("cuda")),
          backend.compute_path_notes(torch.device("cuda")))
    assert check_mla_backend(backend, "cuda") == []


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
def test_triton_long_context_split_k(cache_dtype: str) -> None:
    from vllm.attention.ops.triton_mla import mla_decode_triton, mla_sparse_triton
    from vllm.attention.ops.mla_attention import mla_sparse_torch
    from vllm.attention.writers.fp8_ds_mla import ds_mla_entries

    g = torch.Generator().manual_seed(0)
    dev, L, R, n, bs = "cuda", 512, 64, 16, 64
    seq = [8191, 3000, 17, 4096]
    nb = sum(-(-s // bs) for s in seq) + 1
    rows = torch.randn(nb * bs, L + R, generator=g)
    if cache_dtype == "fp8_ds_mla":
        cache = ds_mla_entries(rows[:, :L].bfloat16(), rows[:, L:].bfloat16()).view(nb, bs, -1)
    elif cache_dtype == "fp8":
        cache = (rows / 0.5).to(torch.float8_e4m3fn).view(nb, bs, -1)
    else:
        cache = rows.bfloat16().view(nb, bs, -1)
    cache = cache.to(dev)
    perm = torch.randperm(nb, generator=g)
    width = max(-(-s // bs) for s in seq)
    bt = torch.zeros(len(seq), width, dtype=torch.int32)
    at = 0
    for i, s in enumerate(seq):
        k = -(-s // bs)
        bt[i, :k] = perm[at: at + k].to(torch.int32)
        at += k
    bt = bt.to(dev)
    fmt = LatentFormat(cache_dtype, L, R, torch.tensor([0.5], device=dev), torch.bfloat16)  # type: ignore[arg-type]
    q = torch.randn(len(seq), n, L + R, generator=g).bfloat16().to(dev)
    req = torch.arange(len(seq), dtype=torch.int32, device=dev)
    pos = torch.tensor(seq, dtype=torch.int32, device=dev) - 1
    groups = [DecodeGroup(i, s, slice(i, i + 1)) for i, s in enumerate(seq)]
    ref = mla_decode_torch(q, cache, bt, groups, fmt, scale=0.1)
    out = mla_decode_triton(q, cache, bt, req, pos, fmt, scale=0.1, max_seq_len=max(seq))
    assert float((out - ref).norm() / ref.norm()) < 1e-2
    topk = torch.stack([torch.randperm(s, generator=g)[:2048] if s >= 2048 else
                        torch.cat([torch.randperm(s, generator=g),
                                   torch.full((2048 - s,), -1)]) for s in seq]).to(torch.int32)
    topk = topk.to(dev)
    ref_s = mla_sparse_torch(q, cache, topk, req, pos, bt, fmt, scale=0.1)
    out_s = mla_sparse_triton(q, cache, topk, req, pos, bt, fmt, scale=0.1)
    assert float((out_s - ref_s).norm() / ref_s.norm()) < 1e-2
