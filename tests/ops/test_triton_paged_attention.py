"""The Triton paged-attention kernels against float64 attention over the
dequantised K/V: under Triton's CPU interpreter (small shapes) and on CUDA (gpu).

Without Triton these tests skip with the import error as the reason. The
interpreter is chosen when a kernel module is first imported, so this module sets
``TRITON_INTERPRET=1`` before any kernel import on machines without CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from vllm.attention.errors import InvalidArgumentError
from tests.ops.paged_cases import (
    TOLERANCE,
    Case,
    L,
    build,
    layout_cases,
    option_cases,
    rel_err,
    shape_cases,
)

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _skip_reason(device: str) -> str | None:
    if not HAVE_TRITON:
        return "triton is not installed (pip install triton)"
    from vllm.attention.ops.triton_paged_attention import triton_unavailable_reason

    return triton_unavailable_reason(torch.device(device))


def _require(device: str) -> None:
    reason = _skip_reason(device)
    if reason is not None:
        pytest.skip(reason)


def _run(case: Case, device: str, **kwargs: object) -> float:
    from vllm.attention.ops.triton_paged_attention import paged_attention_triton

    b = build(case, device)
    out = b.new_output()
    snapshot = b.kv_cache.view(torch.uint8).clone() if b.kv_cache.element_size() == 1 else b.kv_cache.clone()
    paged_attention_triton(b.query, b.kv, b.batch.common, scale=case.scale, output=out,
                           causal=case.causal, sliding_window=case.sliding_window,
                           logits_soft_cap=case.logits_soft_cap, tree_mask=b.tree_mask,
                           **kwargs)  # type: ignore[arg-type]
    assert not out.isnan().any(), "every output element is written"
    cache_now = b.kv_cache.view(torch.uint8) if b.kv_cache.element_size() == 1 else b.kv_cache
    assert torch.equal(cache_now.nan_to_num(), snapshot.nan_to_num()), "compute never writes the cache"
    return rel_err(out, b.reference)


def _triton_takes(c: Case) -> bool:
    """fp8 DiffKV is refused by the Triton path (see ``triton_rejects``)."""
    return not (c.layout is L.DIFFKV_PACKED and c.cache_dtype != "auto")


# -- interpreter: small shapes -------------------------------------------------------

SMALL = dict(query_lens=(1, 5, 1, 9), context_lens=(0, 20, 35, 11))
INTERP_CASES = (
    [c.with_(**SMALL) for c in layout_cases() if _triton_takes(c)]
    + [c.with_(query_lens=(1, 5, 1, 9), context_lens=(0, 20, 70, 11)) for c in shape_cases()
       if c.layout is L.SPLIT_NHD or c.block_size == 16]
    + [c if c.tree else c.with_(**SMALL) for c in option_cases()]
)


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c.id() for c in INTERP_CASES])
def test_interpreter_matches_float64_reference(case: Case) -> None:
    _require("cpu")
    err = _run(case, "cpu")
    tol = TOLERANCE[case.dtype]
    assert err <= tol, f"relative error {err:.3g} > {tol:g}"


SPLIT_CASES = [
    Case(L.SPLIT_NHD, "auto", query_lens=(1, 1, 1), context_lens=(70, 3, 40)),
    Case(L.LEGACY_PAGED, "fp8_e4m3", query_lens=(1, 2, 1), context_lens=(70, 30, 0), per_head_scale=True),
    Case(L.AITER_SHUFFLED, "auto", dtype=torch.bfloat16, query_lens=(1, 1), context_lens=(90, 33),
         sliding_window=40),
    Case(L.PER_TOKEN_HEAD_QUANT, "int8_per_token_head", query_lens=(1, 1), context_lens=(64, 17),
         logits_soft_cap=3.0),
    Case(L.SPLIT_KV_FIRST, "auto", tree=True, query_lens=(4, 3), context_lens=(60, 21)),
]


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.id() for c in SPLIT_CASES])
def test_interpreter_split_k_matches_reference(case: Case, num_splits: int) -> None:
    """Split-K, including splits with no keys (more splits than key tiles)."""
    _require("cpu")
    err = _run(case, "cpu", num_splits=num_splits)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


def test_interpreter_tile_spanning_pages_and_non_pow2_group() -> None:
    """block_n larger than the page (per-token block lookup) and GQA 6 (padded rows)."""
    _require("cpu")
    from vllm.attention.ops.triton_paged_attention import TritonLaunchConfig

    case = Case(L.SPLIT_HND, "auto", block_size=16, group=6, num_kv_heads=1, **SMALL)  # type: ignore[arg-type]
    for cfg in (TritonLaunchConfig(block_m=16, block_n=32, num_splits=1),
                TritonLaunchConfig(block_m=32, block_n=64, num_splits=2)):
        assert _run(case, "cpu", config=cfg) <= TOLERANCE[torch.float32]


# -- CUDA ------------------------------------------------------------------------------

GPU_CASES = (
    [c.with_(dtype=torch.bfloat16) for c in layout_cases() if _triton_takes(c)]
    + [c.with_(dtype=torch.bfloat16, query_lens=(1, 300, 1, 64, 1), context_lens=(4000, 0, 1500, 700, 33))
       for c in shape_cases()]
    + option_cases()
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id() for c in GPU_CASES])
def test_cuda_matches_float64_reference(case: Case) -> None:
    _require("cuda")
    err = _run(case, "cuda")
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_cuda_long_decode_split_k(num_splits: int) -> None:
    _require("cuda")
    case = Case(L.SPLIT_NHD, "auto", dtype=torch.bfloat16, num_kv_heads=8, group=4, head_size=128,
                query_lens=(1,) * 8, context_lens=(4095, 4000, 17, 2048, 1, 3333, 4095, 100))
    assert _run(case, "cuda", num_splits=num_splits) <= TOLERANCE[torch.bfloat16]


# -- launch heuristic (pure Python: runs without Triton) ------------------------------

def test_split_heuristic_fills_the_last_wave() -> None:
    from vllm.attention.ops.triton_paged_attention import split_heuristic

    assert split_heuristic(programs=512, num_sms=132, max_splits=16) == 1  # 3.9 waves: fine
    assert split_heuristic(programs=64, num_sms=132, max_splits=16) == 2
    assert split_heuristic(programs=8, num_sms=132, max_splits=16) >= 8
    assert split_heuristic(programs=8, num_sms=132, max_splits=1) == 1


def test_choose_config_decode_and_prefill() -> None:
    from vllm.attention.ops.triton_paged_attention import choose_config

    kv = build(Case(L.SPLIT_NHD, num_kv_heads=2, group=4, head_size=32)).kv
    dec = choose_config(kv, num_heads=8, num_reqs=2, max_query_len=1, max_seq_len=8192,
                        query_dtype=torch.bfloat16)
    assert dec.block_m == 16 and dec.num_splits > 1
    short = choose_config(kv, num_heads=8, num_reqs=2, max_query_len=1, max_seq_len=100,
                          query_dtype=torch.bfloat16)
    assert short.num_splits == 1
    pre = choose_config(kv, num_heads=8, num_reqs=2, max_query_len=512, max_seq_len=8192,
                        query_dtype=torch.bfloat16)
    assert pre.block_m >= 64 and pre.num_splits == 1
    forced = choose_config(kv, num_heads=8, num_reqs=2, max_query_len=1, max_seq_len=8192,
                           query_dtype=torch.float32, num_splits=3)
    assert forced.num_splits == 3 and forced.block_n == 32


def test_interpreter_cross_attention() -> None:
    _require("cpu")
    from tests.ops.paged_cases import cross_attention_case
    from vllm.attention.ops.triton_paged_attention import paged_attention_triton

    b, batch, q, ref = cross_attention_case()
    out = torch.full((q.shape[0], b.case.num_heads, b.case.dv), float("nan"))
    paged_attention_triton(q, b.kv, batch, scale=b.case.scale, output=out, causal=False)
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


@pytest.mark.gpu
def test_cuda_cross_attention() -> None:
    _require("cuda")
    from tests.ops.paged_cases import cross_attention_case
    from vllm.attention.ops.triton_paged_attention import paged_attention_triton

    b, batch, q, ref = cross_attention_case("cuda")
    out = torch.full((q.shape[0], b.case.num_heads, b.case.dv), float("nan"), device="cuda")
    paged_attention_triton(q, b.kv, batch, scale=b.case.scale, output=out, causal=False)
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


def test_triton_refuses_fp8_diffkv_and_auto_falls_back_to_torch() -> None:
    from vllm.attention.ops.paged_attention import paged_attention
    from vllm.attention.ops.triton_paged_attention import triton_rejects

    case = next(c for c in layout_cases() if not _triton_takes(c)).with_(**SMALL)
    b = build(case, "cpu")
    assert "fp8 DiffKV runs on torch" in str(triton_rejects(b.kv))
    if _skip_reason("cpu") is None:  # the interpreter path exists: it must refuse
        from vllm.attention.ops.triton_paged_attention import paged_attention_triton

        with pytest.raises(InvalidArgumentError, match="fp8 DiffKV runs on torch"):
            paged_attention_triton(b.query, b.kv, b.batch.common, scale=case.scale,
                                   output=b.new_output())
    out = b.new_output()
    paged_attention(b.query, b.kv, b.batch.common, scale=case.scale, output=out)
    assert rel_err(out, b.reference) <= TOLERANCE[case.dtype]
