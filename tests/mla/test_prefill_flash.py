"""MLA prefill on torch's flash kernel (``ops/mla_prefill_flash.py``): its chunking
against the float32 torch path, on torch's CPU flash kernel here and on the CUDA one on a
GPU, through the layer, and its refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.mla.helpers import make_spec, rel_err, setup, shuffled_block_table
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops import mla_prefill_flash as mpf
from vllm.attention.ops.mla_attention import LatentFormat, PrefillGroup, mla_prefill_torch
from vllm.attention.writers.fp8_ds_mla import ds_mla_entries
from vllm.forward_context import set_forward_context

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
"""Against the float32 torch path: the expansion and the attention in the model dtype
(float32 accumulation, one rounding of K, V and P each)."""


def _case(cache_dtype: str, dtype: torch.dtype, device: str, *, n: int, L: int, R: int,
          P: int, V: int, seqs: list[tuple[int, int]], seed: int = 0):  # type: ignore[no-untyped-def]
    """A cache holding random rows for requests of ``(seq_len, new tokens)``, the
    prefill rows' query and groups, and the projection weights."""
    g = torch.Generator().manual_seed(seed)
    page = 16
    bt, nb = shuffled_block_table([s for s, _ in seqs], page, g)
    rows = torch.randn(nb * page, L + R, generator=g)
    if cache_dtype == "fp8_ds_mla":
        cache = ds_mla_entries(rows[:, :L].to(dtype), rows[:, L:].to(dtype)).view(nb, page, -1)
        k_scale = torch.ones(1)
    elif cache_dtype == "fp8":
        cache = (rows / 0.5).to(torch.float8_e4m3fn).view(nb, page, L + R)
        k_scale = torch.tensor([0.5])
    else:
        cache = rows.to(dtype).view(nb, page, L + R)
        k_scale = torch.ones(1)
    groups, r0 = [], 0
    for i, (s, tq) in enumerate(seqs):
        groups.append(PrefillGroup(i, s, slice(r0, r0 + tq)))
        r0 += tq
    q = torch.randn(r0, n, P + R, generator=g).to(dtype)
    w_uk = (torch.randn(n, P, L, generator=g) * L ** -0.5).to(dtype)
    w_uv = (torch.randn(n, L, V, generator=g) * L ** -0.5).to(dtype)
    fmt = LatentFormat(cache_dtype, L, R, k_scale.to(device), dtype)  # type: ignore[arg-type]
    return (q.to(device), cache.to(device), bt.to(device), groups, fmt, w_uk.to(device),
            w_uv.to(device))


SEQS = [(37, 37), (50, 13), (9, 9), (100, 1), (70, 0)]
"""(sequence length, new tokens): a fresh prompt, a chunk after context, a short one, a
single token after context, a request with nothing to prefill."""


@pytest.mark.parametrize("chunk", [1000, 16, 7])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_chunks_match_the_torch_path_on_cpu(dtype: torch.dtype, cache_dtype: str,
                                            chunk: int) -> None:
    """Queries and keys in chunks of ``chunk`` (blocks before a query block unmasked, its
    own block causal), merged by log-sum-exp: the float32 torch path's result within
    the model dtype's rounding, with the value size padded to the query's (24 to 48)."""
    L, R = (512, 64) if cache_dtype == "fp8_ds_mla" else (64, 16)
    args = _case(cache_dtype, dtype, "cpu", n=4, L=L, R=R, P=32, V=24, seqs=SEQS)
    ref = mla_prefill_torch(*args, scale=0.1, chunk_tokens=1000)
    out = mpf.mla_prefill_flash(*args, scale=0.1, chunk_tokens=chunk)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


def test_a_value_wider_than_the_query_is_padded_the_other_way() -> None:
    args = _case("auto", torch.bfloat16, "cpu", n=2, L=64, R=16, P=16, V=40,
                 seqs=[(30, 30), (41, 5)])
    ref = mla_prefill_torch(*args, scale=0.2, chunk_tokens=1000)
    out = mpf.mla_prefill_flash(*args, scale=0.2, chunk_tokens=8)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


def test_bad_arguments_name_themselves() -> None:
    args = _case("auto", torch.bfloat16, "cpu", n=2, L=64, R=16, P=16, V=16, seqs=[(8, 8)])
    with pytest.raises(InvalidArgumentError, match="chunk_tokens: got 0"):
        mpf.mla_prefill_flash(*args, scale=0.1, chunk_tokens=0)
    q32 = (args[0].float(), *args[1:])
    with pytest.raises(InvalidArgumentError, match="q.dtype"):
        mpf.mla_prefill_flash(*q32, scale=0.1, chunk_tokens=8)
    short = (args[0][..., :-1], *args[1:])
    with pytest.raises(InvalidArgumentError, match="q.shape"):
        mpf.mla_prefill_flash(*short, scale=0.1, chunk_tokens=8)


def test_rejects_say_why() -> None:
    cpu = torch.device("cpu")
    assert any("device=cpu" in r for r in mpf.mla_prefill_flash_rejects(
        cpu, torch.bfloat16, qk_head_dim=192, v_head_dim=128))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mpf, "flash_varlen_unavailable", lambda device: None)
        assert mpf.mla_prefill_flash_rejects(cpu, torch.bfloat16, qk_head_dim=192,
                                             v_head_dim=128) == []
        assert any("float32" in r for r in mpf.mla_prefill_flash_rejects(
            cpu, torch.float32, qk_head_dim=192, v_head_dim=128))
        assert any("264" in r for r in mpf.mla_prefill_flash_rejects(
            cpu, torch.bfloat16, qk_head_dim=264, v_head_dim=128))


@pytest.mark.parametrize("query_lens, sliced", [([1, 20, 1, 9], False), ([1, 1, 20, 9], True)],
                         ids=["interleaved", "decode-first"])
def test_the_layer_takes_it_where_it_runs(query_lens: list[int], sliced: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``MLAAttention``: where the flash path runs (here made to, on torch's CPU
    flash kernel) the prefill rows take it (``last_path``) and match the torch path;
    ``force_path = "torch"`` keeps the torch path; on a CPU it does not run. Prefill rows
    after the decode rows are read and written as one slice (``prefill_rows``), others
    gathered and scattered; rows of the output are each written once either way."""
    spec = make_spec(n=4, L=64, R=16, P=32, V=24, dtype=torch.bfloat16)
    s = setup("TRITON_MLA", query_lens, [30, 5, 12, 0], block_size=16, spec=spec,
              dtype=torch.bfloat16)
    assert (s.meta.prefill_rows is not None) is sliced
    if sliced:
        assert s.meta.prefill_rows == slice(2, 31)
    impl = s.layer.impl
    with set_forward_context(attn_metadata={"mla": s.meta},
                             slot_mapping={"mla": s.batch.new_slots}):
        ref = s.layer(s.q, s.kv_c_new, s.k_pe_new).clone()
        assert impl.last_path == "torch+torch-prefill"  # type: ignore[attr-defined]
        monkeypatch.setattr(mpf, "flash_varlen_unavailable", lambda device: None)
        out = s.layer(s.q, s.kv_c_new, s.k_pe_new).clone()
        assert impl.last_path == "torch+flash-prefill"  # type: ignore[attr-defined]
        impl.force_path = "torch"  # type: ignore[attr-defined]
        again = s.layer(s.q, s.kv_c_new, s.k_pe_new).clone()
        assert impl.last_path == "torch+torch-prefill"  # type: ignore[attr-defined]
    assert torch.equal(again, ref)
    assert not torch.equal(out, ref)  # (another rounding: the path really changed)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    if sliced:  # the slice reads and writes what gathering and scattering would
        gathered = dataclasses.replace(s.meta, prefill_rows=None, decode_rows=None)
        with set_forward_context(attn_metadata={"mla": gathered},
                                 slot_mapping={"mla": s.batch.new_slots}):
            assert torch.equal(s.layer(s.q, s.kv_c_new, s.k_pe_new), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [4096, 1000], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_deepseek_shape_on_the_gpu(dtype: torch.dtype, cache_dtype: str, chunk: int) -> None:
    """DeepSeek-V3's dims (128 heads, latent 512 + rope 64, P 128, V 128), a fresh prompt
    and chunks after long contexts, on the CUDA flash kernel: the float32 torch path's
    result within the model dtype's rounding."""
    if mpf.mla_prefill_flash_rejects(torch.device("cuda"), dtype, qk_head_dim=192,
                                     v_head_dim=128):
        pytest.skip("; ".join(mpf.mla_prefill_flash_rejects(
            torch.device("cuda"), dtype, qk_head_dim=192, v_head_dim=128)))
    args = _case(cache_dtype, dtype, "cuda", n=128, L=512, R=64, P=128, V=128,
                 seqs=[(1500, 1500), (3000, 700), (2100, 1)])
    ref = mla_prefill_torch(*args, scale=192 ** -0.5, chunk_tokens=4096)
    out = mpf.mla_prefill_flash(*args, scale=192 ** -0.5, chunk_tokens=chunk)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
