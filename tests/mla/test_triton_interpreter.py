"""The Triton MLA kernels under Triton's CPU interpreter (small shapes), against the
torch path over the same cache: dense split-K decode and sparse top-k, in every
cache format (native, scaled fp8 E4M3/E5M2, the 656-byte fp8_ds_mla entry)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.mla.helpers import make_spec, rel_err, setup
from vllm.attention.ops.mla_attention import (
    DecodeGroup,
    LatentFormat,
    mla_decode_torch,
    mla_sparse_torch,
)
from vllm.forward_context import set_forward_context

from tests.mla.conftest import HAVE_TRITON

if HAVE_TRITON and not torch.cuda.is_available():
    # at collection, before anything imports triton: the interpreter must be on when
    # triton.language builds its own @jit helpers (as tests/ops does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _cache(fmt: LatentFormat, nb: int, bs: int, dtype: torch.dtype,
           g: torch.Generator) -> torch.Tensor:
    """A cache of valid entries (random latent rows written in ``fmt``)."""
    from vllm.attention.writers.fp8_ds_mla import ds_mla_entries

    rows = torch.randn(nb * bs, fmt.kv_lora_rank + fmt.rope_dim, generator=g)
    if fmt.cache_dtype == "fp8_ds_mla":
        entries = ds_mla_entries(rows[:, :512].to(dtype), rows[:, 512:].to(dtype))
        return entries.view(nb, bs, -1)
    if fmt.cache_dtype == "fp8":
        return (rows / fmt.k_scale).to(torch.float8_e4m3fn).view(nb, bs, -1)
    if fmt.cache_dtype == "fp8_e5m2":
        return (rows / fmt.k_scale).to(torch.float8_e5m2).view(nb, bs, -1)
    return rows.to(dtype).view(nb, bs, -1)


CASES = [  # cache_dtype, model dtype, L, R, heads, splits
    ("auto", torch.float32, 24, 8, 3, 1),
    ("auto", torch.bfloat16, 32, 16, 2, 3),
    ("fp8", torch.float16, 32, 16, 3, 2),
    ("fp8_e5m2", torch.bfloat16, 32, 16, 2, 1),
    ("fp8_ds_mla", torch.bfloat16, 512, 64, 2, 2),
]


def _setup(cache_dtype: str, dtype: torch.dtype, L: int, R: int, n: int,
           seed: int = 0) -> tuple[LatentFormat, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    fmt = LatentFormat(cache_dtype, L, R, torch.tensor([0.6]), dtype)  # type: ignore[arg-type]
    bs, nb = 16, 6
    cache = _cache(fmt, nb, bs, dtype, g)
    block_table = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32)
    token_req = torch.tensor([0, 1, 1], dtype=torch.int32)
    token_pos = torch.tensor([38, 19, 20], dtype=torch.int32)  # req 1: 2 tokens (spec decode)
    q = torch.randn(3, n, L + R, generator=g).to(dtype)
    return fmt, cache, block_table, token_req, token_pos, q


@pytest.mark.parametrize("cache_dtype,dtype,L,R,n,splits", CASES)
def test_dense_decode(cache_dtype: str, dtype: torch.dtype, L: int, R: int, n: int,
                      splits: int) -> None:
    from vllm.attention.ops.triton_mla import mla_decode_triton

    fmt, cache, bt, req, pos, q = _setup(cache_dtype, dtype, L, R, n)
    groups = [DecodeGroup(0, 39, slice(0, 1)), DecodeGroup(1, 21, slice(1, 3))]
    ref = mla_decode_torch(q, cache, bt, groups, fmt, scale=0.2)
    before = cache.clone()
    out = mla_decode_triton(q, cache, bt, req, pos, fmt, scale=0.2, max_seq_len=39,
                            num_splits=splits)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("cache_dtype,dtype,L,R,n,splits", CASES)
def test_sparse(cache_dtype: str, dtype: torch.dtype, L: int, R: int, n: int,
                splits: int) -> None:
    from vllm.attention.ops.triton_mla import mla_sparse_triton

    fmt, cache, bt, req, pos, q = _setup(cache_dtype, dtype, L, R, n, seed=1)
    topk = torch.tensor([[0, 37, -1, 5, 38, 16, 40, -1],    # 40 > pos 38: ignored
                         [19, -1, 3, 20, 2, 17, -1, 11],     # 20 > pos 19: ignored
                         [-1, -1, -1, -1, -1, -1, -1, -1]],  # nothing: zeros
                        dtype=torch.int32)
    ref = mla_sparse_torch(q, cache, topk, req, pos, bt, fmt, scale=0.2)
    out = mla_sparse_triton(q, cache, topk, req, pos, bt, fmt, scale=0.2, num_splits=splits)
    assert torch.count_nonzero(out[2]) == 0
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-3)


def test_impl_forced_triton_matches_torch() -> None:
    spec = make_spec(n=2, L=32, R=16, P=16, V=8)
    s = setup("TRITON_MLA", [1, 4, 1], [21, 3, 40], block_size=16, spec=spec)
    with set_forward_context(attn_metadata={"mla": s.meta}, slot_mapping={"mla": s.batch.new_slots}):
        ref = s.layer(s.q, s.kv_c_new, s.k_pe_new).clone()
        s.layer.impl.force_path = "triton"  # type: ignore[attr-defined]
        out = s.layer(s.q, s.kv_c_new, s.k_pe_new)
    assert s.layer.impl.last_path == "triton+torch-prefill"  # type: ignore[attr-defined]
    assert rel_err(out, ref) < 1e-5
