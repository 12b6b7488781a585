"""The torch paged-attention path over every layout, against float64 attention
over the dequantised K/V (``tests/ops/paged_cases.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.paged_cases import TOLERANCE, Case, build, layout_cases, option_cases, rel_err, shape_cases
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.paged_attention import (
    attend_masked,
    pack_tree_masks,
    paged_attention,
    paged_attention_torch,
    resolve_path,
    tree_ancestor_mask,
    tree_visibility,
)
from vllm.attention.ops.reference import attend, visibility_mask
from vllm.attention.types import KVCacheLayout, KVQuant

CASES = layout_cases() + shape_cases() + option_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_torch_path_matches_float64_reference(case: Case) -> None:
    b = build(case)
    out = b.new_output()
    before = b.kv_cache.clone() if b.kv_cache.dtype.is_floating_point and b.kv_cache.element_size() > 1 else None
    raw_before = b.kv_cache.view(torch.uint8).clone() if b.kv_cache.element_size() == 1 else None
    res = paged_attention_torch(b.query, b.kv, b.batch.common, scale=case.scale, output=out,
                                causal=case.causal, sliding_window=case.sliding_window,
                                logits_soft_cap=case.logits_soft_cap, tree_mask=b.tree_mask)
    assert res is out
    assert not out.isnan().any(), "every output element is written"
    err = rel_err(out, b.reference)
    tol = TOLERANCE[case.dtype]
    assert err <= tol, f"relative error {err:.3g} > {tol:g}"
    # compute never writes the cache
    if before is not None:
        assert torch.equal(b.kv_cache.isnan(), before.isnan())
        assert torch.equal(b.kv_cache.nan_to_num(), before.nan_to_num())
    if raw_before is not None:
        assert torch.equal(b.kv_cache.view(torch.uint8), raw_before)


def test_auto_path_is_torch_on_cpu() -> None:
    assert resolve_path(torch.device("cpu")) == "torch"
    from vllm.attention.ops.triton_paged_attention import triton_unavailable_reason

    if triton_unavailable_reason(torch.device("cpu")) is not None:  # no interpreter here
        with pytest.raises(InvalidArgumentError, match="path"):
            resolve_path(torch.device("cpu"), "triton")
    b = build(Case())
    out = b.new_output()
    paged_attention(b.query, b.kv, b.batch.common, scale=b.case.scale, output=out)
    assert rel_err(out, b.reference) <= TOLERANCE[torch.float32]


def test_padding_rows_are_left_alone() -> None:
    b = build(Case())
    n = b.query.shape[0]
    q = torch.cat([b.query, torch.randn(3, *b.query.shape[1:])])
    out = torch.full((n + 3, b.case.num_heads, b.case.dv), 7.0)
    paged_attention_torch(q, b.kv, b.batch.common, scale=b.case.scale, output=out)
    assert rel_err(out[:n], b.reference) <= 1e-5
    assert bool((out[n:] == 7.0).all())


def test_tree_ancestor_mask() -> None:
    #      0
    #     / \
    #    1   2
    #   / \   \
    #  3   4   5
    m = tree_ancestor_mask([-1, 0, 0, 1, 1, 2])
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, expected)
    with pytest.raises(InvalidArgumentError, match=r"parents\[2\]"):
        tree_ancestor_mask([-1, 0, 2])


def test_pack_tree_masks_and_chain_tree_is_causal() -> None:
    chain = tree_ancestor_mask([-1, 0, 1, 2])
    packed = pack_tree_masks([chain, None, None], [4, 2, 1])
    assert packed.shape == (7, 4)
    assert torch.equal(packed[:4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(packed[4:6, :2], torch.ones(2, 2, dtype=torch.bool).tril())
    assert not packed[4:6, 2:].any() and bool(packed[6, 0]) and not packed[6, 1:].any()
    with pytest.raises(InvalidArgumentError, match=r"masks\[0\].shape"):
        pack_tree_masks([torch.ones(2, 3)], [2])
    # a chain-shaped tree is plain causal attention
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(9, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    vis = tree_visibility(chain, 9)
    assert torch.equal(vis, visibility_mask(4, 9, causal=True, sliding_window=None, device=q.device))
    torch.testing.assert_close(attend_masked(q, k, v, vis, scale=0.3, logits_soft_cap=2.0),
                               attend(q, k, v, scale=0.3, causal=True, logits_soft_cap=2.0))


def test_argument_errors_name_the_argument() -> None:
    b = build(Case())
    out = b.new_output()
    with pytest.raises(InvalidArgumentError, match="output.shape"):
        paged_attention_torch(b.query, b.kv, b.batch.common, scale=1.0, output=out[:, :, :4])
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        paged_attention_torch(b.query, b.kv, b.batch.common, scale=1.0, output=out,
                              sliding_window=4, tree_mask=torch.ones(b.query.shape[0], 19, dtype=torch.bool))
    with pytest.raises(InvalidArgumentError, match="tree_mask.shape"):
        paged_attention_torch(b.query, b.kv, b.batch.common, scale=1.0, output=out,
                              tree_mask=torch.ones(2, 2, dtype=torch.bool))
    from vllm.attention.ops.paged_kv import PagedKV

    with pytest.raises(InvalidArgumentError, match="kv_cache.shape"):
        PagedKV.from_cache(b.kv_cache, KVCacheLayout.SPLIT_NHD, KVQuant.unscaled(), block_size=32,
                           num_kv_heads=2, head_size=32)
    with pytest.raises(InvalidArgumentError, match="quant.kv_cache_dtype"):
        PagedKV.from_cache(b.kv_cache, KVCacheLayout.SPLIT_NHD, KVQuant.unscaled("int8_per_token_head"),
                           block_size=16, num_kv_heads=2, head_size=32)
    with pytest.raises(InvalidArgumentError, match="kv_cache.dtype"):
        PagedKV.from_cache(b.kv_cache, KVCacheLayout.SPLIT_NHD, KVQuant.unscaled("fp8_e4m3"),
                           block_size=16, num_kv_heads=2, head_size=32)


@pytest.mark.parametrize("case", layout_cases(), ids=[c.id() for c in layout_cases()])
def test_kernel_address_math_matches_readback(case: Case) -> None:
    """The strides and splits the Triton kernels address by (``PagedOperand.gather``,
    the same formula in torch) select exactly the rows the writers' readback reads:
    this checks the kernels' addressing on machines without Triton."""
    from vllm.attention.writers.readback import PerTokenHeadRows, read_slots

    b = build(case)
    kv = b.kv
    for i, length in enumerate(b.batch.common.seq_lens_cpu.tolist()):
        blocks = b.batch.common.block_table[i]
        pos = torch.arange(length)
        slots = blocks[pos // kv.block_size].long() * kv.block_size + pos % kv.block_size
        rows = read_slots(kv.layout, kv.cache, slots, quant=kv.quant, num_kv_heads=kv.num_kv_heads,
                          head_size=kv.head_size, head_size_v=kv.head_size_v)
        for op, stored in ((kv.key, rows[0]), (kv.value, rows[1])):
            got = op.gather(blocks, length)
            assert got.dtype == stored.dtype or got.element_size() == stored.element_size()
            assert torch.equal(got.contiguous().view(torch.uint8), stored.contiguous().view(torch.uint8))
        if isinstance(rows, PerTokenHeadRows):
            assert torch.equal(kv.key.gather_scales(blocks, length), rows.key_scale)
            assert torch.equal(kv.value.gather_scales(blocks, length), rows.value_scale)


def test_cross_attention_queries_longer_than_keys() -> None:
    """Non-causal (encoder-decoder): 9 decoder queries over 5 encoder keys is fine."""
    from tests.ops.paged_cases import cross_attention_case

    b, batch, q, ref = cross_attention_case()
    out = torch.full((q.shape[0], b.case.num_heads, b.case.dv), float("nan"))
    paged_attention_torch(q, b.kv, batch, scale=b.case.scale, output=out, causal=False)
    assert rel_err(out, ref) <= 1e-5
    with pytest.raises(InvalidArgumentError, match=r"seq_lens\[0\]"):
        paged_attention_torch(q, b.kv, batch, scale=b.case.scale, output=out, causal=True)
