"""MLA compute on the torch path: the absorbed/expanded identity, chunking, the batch
split, sparse semantics, the layer's write-then-compute order and its errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.mla.helpers import make_spec, rel_err, setup
from vllm.attention import InvalidArgumentError, InvalidTypeError
from vllm.attention.backends.mla.common import MLAProjection, MLALayerSpec, MLASparseMetadata
from vllm.attention.conformance_mla import expand_latent, reference_rows
from vllm.attention.ops.mla_attention import merge_attn_states
from vllm.attention.ops.reference import attend
from vllm.forward_context import set_forward_context


def _run(s, meta=None, **ctx):  # type: ignore[no-untyped-def]
    meta = s.meta if meta is None else meta
    with set_forward_context(attn_metadata={"mla": meta}, slot_mapping={"mla": s.batch.new_slots},
                             **ctx):
        return s.layer(s.q, s.kv_c_new, s.k_pe_new)


def _reference(s) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = []
    ctx_at = new_at = 0
    for c, qn in zip(s.batch.context_lens, s.batch.query_lens):
        slots = torch.cat([s.batch.context_slots[ctx_at: ctx_at + c],
                           s.batch.new_slots[new_at: new_at + qn]])
        k, v = expand_latent(reference_rows(s.cache, slots, s.layer.kv_quant,
                                            s.spec.kv_lora_rank, torch.bfloat16), s.spec)
        out.append(attend(s.q[new_at: new_at + qn].double(), k, v, scale=s.spec.scale,
                          causal=True))
        ctx_at, new_at = ctx_at + c, new_at + qn
    return torch.cat(out).flatten(1)


def test_absorbed_decode_equals_expanded_prefill() -> None:
    """The MLA identity: the same tokens through the absorbed path (threshold high, all
    decode) and the expanded path (threshold 0, all prefill) agree."""
    spec = make_spec()
    s = setup("TRITON_MLA", [3, 1, 2], [17, 5, 30], block_size=16, spec=spec)
    b = s.layer.backend.get_builder_cls()(spec, torch.device("cpu"))
    b.decode_threshold = 0  # type: ignore[attr-defined]
    all_prefill = b.build(s.batch.common)
    b.decode_threshold = 8  # type: ignore[attr-defined]
    all_decode = b.build(s.batch.common)
    assert all_prefill.num_decode_tokens == 0 and all_decode.num_prefill_tokens == 0
    out_p = _run(s, all_prefill)
    out_d = _run(s, all_decode)
    ref = _reference(s)
    assert rel_err(out_p, ref) < 1e-5 and rel_err(out_d, ref) < 1e-5
    assert s.layer.impl.last_path == "torch"  # type: ignore[attr-defined]


def test_prefill_chunking_matches_one_chunk() -> None:
    spec = make_spec()
    s = setup("TRITON_MLA", [40, 1], [37, 12], block_size=16, spec=spec)
    b = s.layer.backend.get_builder_cls()(spec, torch.device("cpu"))
    b.prefill_chunk_tokens = 7  # type: ignore[attr-defined]
    small = b.build(s.batch.common)
    assert small.prefill_chunk_tokens == 7
    out_small = _run(s, small).clone()
    out_big = _run(s)
    assert rel_err(out_small, out_big) < 1e-5
    assert rel_err(out_big, _reference(s)) < 1e-5


def test_batch_split_any_order() -> None:
    spec = make_spec()
    s = setup("FLASHMLA", [1, 70, 1, 2, 1], [64, 0, 3, 10, 130], block_size=64, spec=spec,
              dtype=torch.bfloat16)
    m = s.meta
    assert [g.req for g in m.decode_groups] == [0, 2, 4]
    assert [g.req for g in m.prefill_groups] == [1, 3]
    assert m.decode_token_idx.tolist() == [0, 71, 74]
    assert m.decode_rows is None  # scattered: gathered and scattered back
    assert m.uniform_single_token_decode and m.max_decode_seq_len == 131
    assert m.token_pos.tolist()[:3] == [64, 0, 1]
    assert rel_err(_run(s), _reference(s)) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_contiguous_decode_rows_are_read_and_written_in_place(dtype: torch.dtype) -> None:
    """Decode requests first (as vLLM orders them): their rows are one slice, the query
    is read and the output written through views, with the result the gather/scatter
    path gives and the rows of the prefill left to it."""
    spec = make_spec(dtype=dtype)
    s = setup("TRITON_MLA", [1, 1, 1, 40], [64, 3, 130, 9], block_size=16, spec=spec,
              dtype=dtype)
    assert s.meta.decode_rows == slice(0, 3)
    in_place = _run(s)
    gathered = _run(s, dataclasses.replace(s.meta, decode_rows=None))
    torch.testing.assert_close(in_place, gathered, rtol=0, atol=0)
    assert rel_err(in_place, _reference(s)) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("cache_dtype,k_scale", [("fp8", 0.37), ("auto", None)])
def test_fp8_cache_against_dequantised_reference(cache_dtype: str, k_scale: float | None) -> None:
    spec = make_spec(dtype=torch.bfloat16, cache_dtype=cache_dtype)
    s = setup("ROCM_AITER_MLA", [5, 1], [20, 33], block_size=8, spec=spec, dtype=torch.bfloat16,
              k_scale=k_scale)
    assert rel_err(_run(s), _reference(s)) < 2e-2


def test_kv_sharing_layer_does_not_write() -> None:
    spec = dataclasses.replace(make_spec(), kv_sharing_target_layer_name="other")
    s = setup("TRITON_MLA", [2], [5], block_size=16, spec=spec)
    before = s.cache.clone()
    _run(s)
    assert torch.equal(s.cache.view(torch.uint8), before.view(torch.uint8))


def test_connector_sees_the_write_before_compute() -> None:
    seen: list[str] = []

    class Conn:
        def on_kv_written(self, layer_name: str, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
            seen.append(layer_name)

    s = setup("TRITON_MLA", [2], [5], block_size=16, spec=make_spec())
    _run(s, kv_connector=Conn())
    assert seen == ["mla"]


def test_sparse_all_positions_equals_dense() -> None:
    spec = make_spec(dtype=torch.bfloat16)
    s = setup("ROCM_AITER_MLA_SPARSE", [3, 1], [9, 20], block_size=1, spec=spec,
              dtype=torch.bfloat16)
    pos = s.meta.token_pos
    k = 24
    # every position 0..pos, shuffled, padded with -1 and with positions past the token
    rows = []
    for p in pos.tolist():
        r = torch.cat([torch.arange(p + 1), torch.full((k - p - 1,), -1)])
        r[p + 1:][:2] = p + 1  # past the token: ignored (causal)
        rows.append(r[torch.randperm(k)])
    meta = s.meta.with_topk_indices(torch.stack(rows).to(torch.int32))
    assert rel_err(_run(s, meta), _reference(s)) < 1e-2


def test_sparse_without_valid_index_gives_zeros_and_errors_name_argument() -> None:
    s = setup("FLASHMLA_SPARSE", [2], [3], block_size=64, spec=make_spec(dtype=torch.bfloat16),
              dtype=torch.bfloat16)
    assert isinstance(s.meta, MLASparseMetadata)
    with pytest.raises(InvalidArgumentError, match="attn_metadata.topk_indices: got None"):
        _run(s)
    none = s.meta.with_topk_indices(torch.full((2, 4), -1, dtype=torch.int32))
    assert torch.count_nonzero(_run(s, none)) == 0
    with pytest.raises(InvalidArgumentError, match=r"topk_indices.dtype: got torch.int64"):
        s.meta.with_topk_indices(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(InvalidArgumentError, match=r"topk_indices.shape"):
        s.meta.with_topk_indices(torch.zeros(1, 4, dtype=torch.int32))


def test_merge_attn_states_handles_empty_side() -> None:
    o = torch.randn(3, 4)
    lse = torch.randn(3)
    empty = torch.full((3,), -math.inf)
    m, l = merge_attn_states(o, lse, torch.zeros(3, 4), empty)
    assert torch.allclose(m, o) and torch.allclose(l, lse)


def test_spec_errors_name_argument() -> None:
    proj = MLAProjection(w_uk=torch.zeros(2, 16, 64), w_uv=torch.zeros(2, 64, 8))
    with pytest.raises(InvalidArgumentError, match=r"projection.w_uk.shape: got \(2, 16, 64\)"):
        MLALayerSpec.create(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=8, projection=proj)
    with pytest.raises(InvalidArgumentError, match="w_uv.shape"):
        MLAProjection(w_uk=torch.zeros(2, 16, 64), w_uv=torch.zeros(2, 32, 8))
    w = torch.randn(2 * (16 + 8), 64)
    p = MLAProjection.from_kv_b_proj(w, num_heads=2, qk_nope_head_dim=16, v_head_dim=8)
    assert p.w_uk.shape == (2, 16, 64) and p.w_uv.shape == (2, 64, 8)
    kv_c = torch.randn(64)
    assert torch.allclose(p.w_uk[1] @ kv_c, (w @ kv_c)[24:40], atol=1e-5)
    assert torch.allclose(kv_c @ p.w_uv[1], (w @ kv_c)[40:48], atol=1e-5)


def test_layer_errors_name_argument() -> None:
    s = setup("TRITON_MLA", [2], [5], block_size=16, spec=make_spec())
    from vllm.attention.layer import MLAAttention
    from vllm.attention.registry import get_backend
    from vllm.attention.backend import AttentionLayerSpec

    plain = AttentionLayerSpec(num_heads=2, head_size=576, num_kv_heads=1, scale=1.0)
    with pytest.raises(InvalidTypeError, match="spec: got 'AttentionLayerSpec'"):
        MLAAttention(spec=plain, backend=get_backend("TRITON_MLA"), layer_name="x")
    bad_q = torch.zeros(2, 2, 7)
    with set_forward_context(attn_metadata={"mla": s.meta}, slot_mapping={"mla": s.batch.new_slots}):
        with pytest.raises(InvalidArgumentError, match=r"query.shape: got \(2, 2, 7\)"):
            s.layer(bad_q, s.kv_c_new, s.k_pe_new)
