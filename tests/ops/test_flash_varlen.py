"""The flash varlen prefill path: its glue (gather, cu_seqlens, seqused_k, window)
checked on CPU with a float64 stand-in of the kernel, the real
``aten._flash_attention_forward`` on CUDA (gpu), which calls it takes and which it
does not, and when ``choose_path`` picks it. Every output against float64
attention over what the cache holds; unowned slots are NaN."""

from __future__ import annotations

import pytest
import torch

from tests.ops.paged_cases import TOLERANCE, Case, L, build, cross_attention_case, rel_err
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.flash_varlen import (
    flash_varlen_rejects,
    flash_varlen_unavailable,
    flash_varlen_worth_it,
    gather_blocks,
    paged_attention_flash_varlen,
    reference_kernel,
)
from vllm.attention.ops.paged_attention import choose_path

BF16, FP16 = torch.bfloat16, torch.float16
PREFILL = dict(query_lens=(37, 1, 64, 5), context_lens=(0, 40, 29, 0))
CASES = [
    Case(L.SPLIT_NHD, dtype=BF16, **PREFILL),  # type: ignore[arg-type]
    Case(L.SPLIT_NHD, dtype=FP16, group=1, block_size=32, **PREFILL),  # type: ignore[arg-type]
    Case(L.SPLIT_NHD, dtype=BF16, group=8, num_kv_heads=1, sliding_window=19, **PREFILL),  # type: ignore[arg-type]
    Case(L.SPLIT_HND, dtype=FP16, sliding_window=1, **PREFILL),  # type: ignore[arg-type]
    Case(L.SPLIT_KV_FIRST, dtype=BF16, block_size=64, **PREFILL),  # type: ignore[arg-type]
    Case(L.SPLIT_BLOCK_INTERLEAVED, dtype=BF16, **PREFILL),  # type: ignore[arg-type]
    Case(L.LEGACY_PAGED, dtype=FP16, **PREFILL),  # type: ignore[arg-type]
    Case(L.AITER_SHUFFLED, dtype=BF16, **PREFILL),  # type: ignore[arg-type]
    Case(L.SPLIT_NHD, dtype=BF16, causal=False, **PREFILL),  # type: ignore[arg-type]
]


def _run(case: Case, device: str, *, strided_out: bool = False, stand_in: bool = True) -> float:
    b = build(case, device)
    out = b.new_output()
    if strided_out:  # every other row of a wider buffer: the kernel cannot write it directly
        wide = torch.full((out.shape[0] * 2, *out.shape[1:]), float("nan"), dtype=out.dtype,
                          device=out.device)
        out = wide[::2]
    before = b.kv_cache.clone()
    paged_attention_flash_varlen(
        b.query, b.kv, b.batch.common, scale=case.scale, output=out, causal=case.causal,
        sliding_window=case.sliding_window, kernel=reference_kernel if stand_in else None)
    assert not out.isnan().any(), "every output row is written"
    assert torch.equal(b.kv_cache.nan_to_num(), before.nan_to_num()), "the cache is read only"
    return rel_err(out, b.reference)


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_glue_with_float64_stand_in(case: Case) -> None:
    err = _run(case, "cpu")
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


def test_strided_output_is_filled_through_a_copy() -> None:
    assert _run(CASES[0], "cpu", strided_out=True) <= TOLERANCE[BF16]


def test_cross_attention_with_fewer_keys_than_queries() -> None:
    b, batch, q, ref = cross_attention_case(query_lens=(9, 3, 1))
    # the case's cache is fp32: the same values in bf16, as a bf16 model would store them
    kv = b.kv.__class__.from_cache(b.kv_cache.to(BF16), b.case.layout, b.quant,
                                   block_size=b.case.block_size,
                                   num_kv_heads=b.case.num_kv_heads, head_size=b.case.head_size)
    out = torch.full((q.shape[0], b.case.num_heads, b.case.dv), float("nan"), dtype=BF16)
    paged_attention_flash_varlen(q.to(BF16), kv, batch, scale=b.case.scale, output=out,
                                 causal=False, kernel=reference_kernel)
    assert rel_err(out, ref) <= TOLERANCE[BF16]


def test_gather_packs_whole_blocks_of_each_request() -> None:
    b = build(CASES[0])
    k, v, cu_k = gather_blocks(b.kv, b.batch.common)
    bs = b.case.block_size
    lens = [q + c for q, c in zip(b.case.query_lens, b.case.context_lens)]
    blocks = [-(-n // bs) for n in lens]
    assert cu_k.tolist() == [bs * sum(blocks[:i]) for i in range(len(lens) + 1)]
    assert cu_k.dtype == torch.int32 and k.shape[0] == bs * sum(blocks)
    for i, n in enumerate(lens):
        start = int(cu_k[i])
        assert torch.equal(k[start:start + n].double(), b.keys[i])
        assert torch.equal(v[start:start + n].double(), b.values[i])


@pytest.mark.parametrize(("change", "needle"), [
    (dict(dtype=torch.float32), "dtype=torch.float32, takes float16/bfloat16"),
    (dict(cache_dtype="fp8_e4m3"), "kv_cache_dtype='fp8_e4m3', takes auto"),
    (dict(layout=L.DIFFKV_PACKED, head_size=32, head_size_v=16), "head_size_v=16"),
    (dict(head_size=20), "head_size=20, takes a multiple of 8"),
    (dict(logits_soft_cap=5.0), "logits_soft_cap=5.0, takes none"),
    (dict(tree=True), "a draft-tree mask"),
    (dict(causal=False, sliding_window=8), "sliding_window=8 on non-causal"),
])
def test_rejects_says_why(change: dict[str, object], needle: str) -> None:
    case = Case(L.SPLIT_NHD, dtype=BF16, query_lens=(4, 1), context_lens=(3, 9)).with_(**change)
    b = build(case)
    why = flash_varlen_rejects(b.query, b.kv, causal=case.causal,
                               sliding_window=case.sliding_window,
                               logits_soft_cap=case.logits_soft_cap, tree_mask=b.tree_mask)
    assert why is not None and needle in why, why
    with pytest.raises(InvalidArgumentError, match="flash varlen path takes"):
        paged_attention_flash_varlen(b.query, b.kv, b.batch.common, scale=case.scale,
                                     output=b.new_output(), causal=case.causal,
                                     sliding_window=case.sliding_window,
                                     logits_soft_cap=case.logits_soft_cap,
                                     tree_mask=b.tree_mask, kernel=reference_kernel)


def test_a_cache_in_another_dtype_is_rejected() -> None:
    b = build(Case(L.SPLIT_NHD, query_lens=(4,), context_lens=(3,)))  # fp32 cache
    why = flash_varlen_rejects(b.query.to(BF16), b.kv, causal=True, sliding_window=None,
                               logits_soft_cap=None, tree_mask=None)
    assert why is not None and "cache dtype torch.float32" in why


def test_worth_it_for_prefills_not_for_decodes() -> None:
    from vllm.attention.batch import make_paged_batch

    b = build(Case(L.SPLIT_NHD, dtype=BF16, query_lens=(4,), context_lens=(3,)))
    kv = b.kv
    fresh = make_paged_batch([2048] * 2, [0, 0], block_size=16).common
    chunked = make_paged_batch([2048] * 2, [2048] * 2, block_size=16).common
    decode = make_paged_batch([1] * 8, [4095] * 8, block_size=16).common
    common = dict(num_heads=8, element_size=2, causal=True, sliding_window=None)
    assert flash_varlen_worth_it(fresh, kv, **common) is None  # type: ignore[arg-type]
    assert flash_varlen_worth_it(chunked, kv, **common) is None  # type: ignore[arg-type]
    why = flash_varlen_worth_it(decode, kv, **common)  # type: ignore[arg-type]
    assert why is not None and "FLOPs per copied byte" in why


def test_off_cuda_the_path_is_never_chosen_and_says_why() -> None:
    b = build(CASES[0])
    assert choose_path(b.query, b.kv, b.batch.common) == "torch"
    reason = flash_varlen_unavailable(torch.device("cpu"))
    assert reason is not None and "device=cpu" in reason
    with pytest.raises(InvalidArgumentError, match="kv_cache.device"):
        paged_attention_flash_varlen(b.query, b.kv, b.batch.common, scale=1.0,
                                     output=b.new_output())


def test_causal_queries_need_their_keys() -> None:
    b = build(CASES[0])
    common = b.batch.common
    short = common.__class__(**{**common.__dict__,
                                "seq_lens_cpu": common.seq_lens_cpu.clone().fill_(1)})
    with pytest.raises(InvalidArgumentError, match=r"seq_lens\[0\]"):
        paged_attention_flash_varlen(b.query, b.kv, short, scale=1.0, output=b.new_output(),
                                     kernel=reference_kernel)


# -- the real kernel ---------------------------------------------------------------------

GPU_CASES = CASES + [
    Case(L.SPLIT_NHD, dtype=BF16, head_size=128, query_lens=(300, 1, 129), context_lens=(0, 500, 77)),
    Case(L.SPLIT_NHD, dtype=FP16, head_size=256, group=2, sliding_window=100,
         query_lens=(200, 3), context_lens=(150, 0)),
    Case(L.SPLIT_NHD, dtype=BF16, head_size=64, block_size=128,
         query_lens=(1000, 17), context_lens=(1000, 1500)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id() for c in GPU_CASES])
@pytest.mark.parametrize("strided", [False, True], ids=["direct", "strided-out"])
def test_aten_flash_kernel_on_cuda(case: Case, strided: bool) -> None:
    reason = flash_varlen_unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    err = _run(case, "cuda", strided_out=strided, stand_in=False)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


@pytest.mark.gpu
def test_choose_path_on_cuda() -> None:
    if flash_varlen_unavailable(torch.device("cuda")) is not None:
        pytest.skip("no flash varlen kernel here")
    prefill = build(Case(L.SPLIT_NHD, dtype=BF16, head_size=128, query_lens=(2048,),
                         context_lens=(0,)), "cuda")
    from vllm.attention.ops.flash_varlen import TRITON_MEASURED_ON

    # where the Triton long-prefill launch was measured faster, it keeps the prefill
    measured = torch.cuda.get_device_capability() in TRITON_MEASURED_ON
    assert choose_path(prefill.query, prefill.kv, prefill.batch.common) == (
        "triton" if measured else "flash_varlen")
    decode = build(Case(L.SPLIT_NHD, dtype=BF16, head_size=128, query_lens=(1,) * 4,
                        context_lens=(1000,) * 4), "cuda")
    assert choose_path(decode.query, decode.kv, decode.batch.common) == "triton"
    fp8 = build(Case(L.SPLIT_NHD, "fp8_e4m3", dtype=BF16, head_size=128, query_lens=(2048,),
                     context_lens=(0,)), "cuda")
    assert choose_path(fp8.query, fp8.kv, fp8.batch.common) == "triton"


def test_the_quick_bound_rejects_only_what_the_full_rule_would() -> None:
    """``flash_varlen_worth_it`` first rejects from ``max_query_len`` alone; whenever that
    bound rejects, the FLOPs per copied byte computed request by request are below the
    threshold too (so the bound never turns away a batch the full rule takes)."""
    import random

    from vllm.attention.batch import make_paged_batch
    from vllm.attention.ops.flash_varlen import FLOPS_PER_BYTE, MAX_COPY_SHARE

    b = build(Case(L.SPLIT_NHD, dtype=BF16, query_lens=(4,), context_lens=(3,)))
    kv = b.kv
    rng = random.Random(7)
    bound_rejected = 0
    for _ in range(60):
        n = rng.randint(1, 6)
        q = [rng.choice([1, 2, 16, 64, 130, 300, 700]) for _ in range(n)]
        c = [rng.choice([0, 5, 100, 4000]) for _ in range(n)]
        batch = make_paged_batch(q, c, block_size=16).common
        heads = rng.choice([kv.num_kv_heads, 4 * kv.num_kv_heads])
        why = flash_varlen_worth_it(batch, kv, heads, 2, causal=True, sliding_window=None)
        if why is None or not why.startswith("at most"):
            continue
        bound_rejected += 1
        d = kv.head_size + kv.head_size_v
        flops = sum(2 * qi * (qi + ci - (qi - 1) / 2) for qi, ci in zip(q, c)) * d * heads
        copied = sum(2 * -(-(qi + ci) // 16) * 16 * kv.num_kv_heads * d * 2
                     for qi, ci in zip(q, c))
        assert flops / copied < FLOPS_PER_BYTE / MAX_COPY_SHARE, (q, c, heads)
    assert bound_rejected > 10
