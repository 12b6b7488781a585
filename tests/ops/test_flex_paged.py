"""FlexAttention over paged caches (eager on CPU), against float64 attention over
the dequantised K/V. Runs under ``filterwarnings=error``: the eager-mode
``UserWarning`` of torch's flex_attention must not escape the op."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.ops.paged_cases import TOLERANCE, Case, L, build, layout_cases, option_cases, rel_err
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.flex_paged import flex_paged_attention, page_table_supported

SMALL = dict(query_lens=(1, 5, 1, 9), context_lens=(0, 20, 35, 11))
GATHER_CASES = (
    [c.with_(**SMALL) for c in layout_cases()]
    + [Case(L.SPLIT_BLOCK_INTERLEAVED, group=g, block_size=bs, num_kv_heads=2 if g < 8 else 1,
            context_lens=(0, 26, 47, 70, 30), seed=g + bs)
       for g in (1, 4, 8) for bs in (16, 32, 64)]
    + [c if c.tree else c.with_(**SMALL) for c in option_cases()]
)


def _run(case: Case, mode: str, zero_unused: bool = False) -> float:
    b = build(case)
    if zero_unused:  # page_table mode multiplies unowned slots by p = 0: make them finite
        b.kv_cache.nan_to_num_(0.0)
    out = b.new_output()
    flex_paged_attention(b.query, b.kv, b.batch.common, scale=case.scale, output=out,
                         causal=case.causal, sliding_window=case.sliding_window,
                         logits_soft_cap=case.logits_soft_cap, tree_mask=b.tree_mask,
                         mode=mode)  # type: ignore[arg-type]
    assert not out.isnan().any(), "every output element is written"
    return rel_err(out, b.reference)


@pytest.mark.parametrize("case", GATHER_CASES, ids=[c.id() for c in GATHER_CASES])
def test_flex_gather_matches_float64_reference(case: Case) -> None:
    err = _run(case, "gather")
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


PAGE_TABLE_CASES = [
    Case(L.SPLIT_BLOCK_INTERLEAVED, **SMALL),  # type: ignore[arg-type]
    Case(L.SPLIT_BLOCK_INTERLEAVED, dtype=torch.bfloat16, sliding_window=9, logits_soft_cap=4.0, **SMALL),  # type: ignore[arg-type]
    Case(L.SPLIT_KV_FIRST, block_size=32, group=8, num_kv_heads=1, **SMALL),  # type: ignore[arg-type]
    Case(L.DIFFKV_PACKED, head_size=32, head_size_v=16, **SMALL),  # type: ignore[arg-type]
    Case(L.SPLIT_KV_FIRST, tree=True, query_lens=(4, 1, 7, 12, 5), context_lens=(20, 33, 0, 9, 16)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, causal=False, **SMALL),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("case", PAGE_TABLE_CASES, ids=[c.id() for c in PAGE_TABLE_CASES])
def test_flex_page_table_matches_float64_reference(case: Case) -> None:
    err = _run(case, "page_table", zero_unused=True)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


def test_page_table_mode_says_why_not() -> None:
    b = build(Case(L.SPLIT_NHD, **SMALL))  # type: ignore[arg-type]
    reason = page_table_supported(b.kv, torch.float32)
    assert reason is not None and "layout=split_nhd" in reason
    with pytest.raises(InvalidArgumentError, match="mode"):
        flex_paged_attention(b.query, b.kv, b.batch.common, scale=1.0, output=b.new_output(),
                             mode="page_table")
    fp8 = build(Case(L.SPLIT_KV_FIRST, "fp8_e4m3", **SMALL))  # type: ignore[arg-type]
    assert "kv_cache_dtype" in (page_table_supported(fp8.kv, torch.float32) or "")


def test_eager_warning_is_silenced_only_inside_the_op() -> None:
    b = build(Case(**SMALL))  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        flex_paged_attention(b.query, b.kv, b.batch.common, scale=b.case.scale, output=b.new_output())
        assert list(warnings.filters) == before, "the op restores the filters it changed"
    assert not [w for w in seen if "flex_attention" in str(w.message)]


@pytest.mark.parametrize("mode", ["gather", "page_table"])
def test_flex_cross_attention(mode: str) -> None:
    """Non-causal with more queries than keys (encoder-decoder)."""
    from tests.ops.paged_cases import cross_attention_case

    b, batch, q, ref = cross_attention_case(layout=L.SPLIT_KV_FIRST)
    b.kv_cache.nan_to_num_(0.0)
    out = torch.full((q.shape[0], b.case.num_heads, b.case.dv), float("nan"))
    flex_paged_attention(q, b.kv, batch, scale=b.case.scale, output=out, causal=False,
                         mode=mode)  # type: ignore[arg-type]
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


def test_inductor_failure_falls_back_to_eager_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H200, Inductor could not lower some flex shapes (GQA 8); the op then runs
    the eager flex_attention, which computes the same function."""
    from vllm.attention.ops import flex_paged

    class InductorError(RuntimeError):
        pass

    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        raise InductorError("LoweringException: NoValidChoicesError")

    monkeypatch.setattr(flex_paged, "_compiled_flex", lambda: failing)
    case = Case(L.SPLIT_BLOCK_INTERLEAVED, "auto", query_lens=(1, 5), context_lens=(20, 0))
    b = build(case, "cpu")
    out = b.new_output()
    flex_paged_attention(b.query, b.kv, b.batch.common, scale=case.scale, output=out,
                         compiled=True)
    assert rel_err(out, b.reference) <= TOLERANCE[case.dtype]

    def other(*args: object, **kwargs: object) -> torch.Tensor:
        raise ValueError("a real error in the call")

    monkeypatch.setattr(flex_paged, "_compiled_flex", lambda: other)
    with pytest.raises(ValueError, match="real error"):
        flex_paged_attention(b.query, b.kv, b.batch.common, scale=case.scale,
                             output=b.new_output(), compiled=True)
