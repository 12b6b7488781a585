"""The block masks ``flex_paged_attention`` builds, as Inductor's kernels read them.

On CPU the compiled flex paths run through Dynamo with ``aot_eager``, which evaluates
``mask_mod`` densely and never reads the block lists; Inductor's CUDA kernels read only
the lists. These tests stand :func:`tests.ops.flex_block_sparse.block_sparse_attention`
(the kernels' function: listed blocks only, full blocks without ``mask_mod``, both lists
at the partial lists' offsets) in for the compiled call, so the lists decide the result
as on CUDA: every block mask of prefill, chunked, decode (page_table), mixed, GQA,
sliding window, soft cap, tree and cross-attention batches is checked against its
``mask_mod`` at block granularity, and the output against float64 with NaN in every
unowned cache slot (the stand-in reads only listed blocks, so nothing is poisoned with
finite values here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.ops.flex_block_sparse import (
    PageTablesSeen,
    block_list_errors,
    block_sparse_attention,
    live_rows,
)
from tests.ops.paged_cases import (
    TOLERANCE,
    Built,
    Case,
    L,
    build,
    cross_attention_case,
    rel_err,
)
from vllm.attention.ops import flex_paged

BF16, FP16 = torch.bfloat16, torch.float16


@dataclass
class Seen:
    """What the compiled call was given, per call, and what was wrong with its lists."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    query_lens: tuple[int, ...] = ()
    """The batch's query counts (set before the call): which query rows are real."""
    pages: PageTablesSeen | None = None
    """page_table mode's tables as built."""

    @property
    def tables(self) -> list[Any]:
        return [] if self.pages is None else self.pages.tables


@pytest.fixture
def block_sparse(monkeypatch: pytest.MonkeyPatch) -> Seen:
    """The compiled ``flex_attention`` call replaced by the block-sparse stand-in; the
    eager call (``compiled=False``) left alone."""
    pages = PageTablesSeen(monkeypatch)
    seen = Seen(pages=pages)
    eager = flex_paged._call_flex

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: Any,
             score_mod: Any, scale: float, compiled: bool, lse: bool,
             kernel_options: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not compiled:
            return eager(q, k, v, block_mask=block_mask, score_mod=score_mod, scale=scale,
                         compiled=False, lse=lse, kernel_options=kernel_options)
        errors = block_list_errors(block_mask, q_len=q.shape[2], kv_len=k.shape[2],
                                   batch=q.shape[0], live_rows=live_rows(q, seen.query_lens),
                                   mask_mod=pages.exact_mask(block_mask))
        out, out_lse = block_sparse_attention(q, k, v, block_mask, scale=scale,
                                              score_mod=score_mod)
        seen.calls.append(dict(errors=errors, block=block_mask.BLOCK_SIZE,
                               q_shape=tuple(q.shape), k_shape=tuple(k.shape)))
        return out.to(q.dtype), (out_lse.float() if lse else None)

    monkeypatch.setattr(flex_paged, "_call_flex", call)
    return seen


GATHER = [
    Case(L.SPLIT_BLOCK_INTERLEAVED, group=4, query_lens=(300, 200, 130), context_lens=(0, 0, 0)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, dtype=BF16, group=2, num_kv_heads=2, head_size=64,
         query_lens=(200, 150), context_lens=(200, 150)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, query_lens=(30, 1, 77, 100, 1), context_lens=(0, 90, 200, 100, 7)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, sliding_window=8, query_lens=(10, 40, 10, 60),
         context_lens=(100, 200, 3, 80)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, dtype=FP16, group=8, num_kv_heads=1, sliding_window=64,
         logits_soft_cap=20.0, query_lens=(150, 3), context_lens=(100, 40)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, causal=False, query_lens=(33, 7, 140), context_lens=(10, 50, 0)),
    Case(L.SPLIT_KV_FIRST, tree=True, query_lens=(4, 1, 7, 12, 5), context_lens=(20, 33, 0, 9, 16)),
    Case(L.SPLIT_NHD, "fp8_e4m3", group=1, query_lens=(129, 1), context_lens=(0, 300)),
]
PAGE_TABLE = [
    Case(L.SPLIT_BLOCK_INTERLEAVED, query_lens=(1,) * 6, context_lens=(400, 17, 204, 0, 300, 102)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, dtype=BF16, block_size=32, sliding_window=40,
         logits_soft_cap=20.0, query_lens=(1,) * 3, context_lens=(170, 31, 95)),
    Case(L.SPLIT_KV_FIRST, block_size=64, group=8, num_kv_heads=1, query_lens=(1,) * 5,
         context_lens=(63, 64, 0, 191, 300)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, query_lens=(1,) * 11, context_lens=tuple(range(3, 80, 7))),
    Case(L.DIFFKV_PACKED, head_size=32, head_size_v=16, query_lens=(1, 1, 1),
         context_lens=(40, 16, 79)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, sliding_window=20, query_lens=(9, 9), context_lens=(30, 7)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, query_lens=(130, 2), context_lens=(5, 300)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, causal=False, query_lens=(1, 5, 1, 9), context_lens=(0, 20, 35, 11)),
]
RUNS = [(c, "gather") for c in GATHER] + [(c, "page_table") for c in PAGE_TABLE]


def _run(case: Case, mode: str, seen: Seen,
         kernel_options: dict[str, Any] | None = None) -> tuple[Built, torch.Tensor]:
    seen.query_lens = case.query_lens
    b = build(case)
    out = b.new_output()
    flex_paged.flex_paged_attention(
        b.query, b.kv, b.batch.common, scale=case.scale, output=out, causal=case.causal,
        sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap,
        tree_mask=b.tree_mask, mode=mode, compiled=True,  # type: ignore[arg-type]
        kernel_options=kernel_options)
    assert flex_paged.last_run == flex_paged.FlexRun(mode, True)  # type: ignore[arg-type]
    return b, out


@pytest.mark.parametrize(("case", "mode"), RUNS, ids=[f"{m}-{c.id()}" for c, m in RUNS])
def test_block_lists_agree_with_mask_mod(case: Case, mode: str, block_sparse: Seen) -> None:
    """Full blocks all visible, partial blocks partly, unlisted blocks not at all; one
    shape for both lists; sizes as the call sees them."""
    _run(case, mode, block_sparse)
    assert len(block_sparse.calls) == 1
    assert block_sparse.calls[0]["errors"] == []


@pytest.mark.parametrize(("case", "mode"), RUNS, ids=[f"{m}-{c.id()}" for c, m in RUNS])
def test_block_sparse_result_matches_float64(case: Case, mode: str, block_sparse: Seen) -> None:
    """The kernels' function over the lists the op builds, unowned slots NaN."""
    b, out = _run(case, mode, block_sparse)
    assert b.kv_cache.isnan().any(), "the cache keeps its NaN poison"
    assert not out.isnan().any()
    err = rel_err(out, b.reference)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


@pytest.mark.parametrize("case", PAGE_TABLE, ids=[c.id() for c in PAGE_TABLE])
def test_split_decode_lists_every_page_as_partial(case: Case, block_sparse: Seen) -> None:
    """With SPLIT_KV > 1 (Inductor's decode kernel splits full lists by the cache's
    length, not the request's) every visible page is one partial list, still right
    against the mask_mod and float64; one split keeps the full lists, and so does a
    batch Inductor runs its forward kernel for (128 queries or more)."""
    decode_kernel = max(case.query_lens) < 128 and case.group & (case.group - 1) == 0
    b, out = _run(case, "page_table", block_sparse, {"SPLIT_KV": 4})
    one = block_sparse.tables[-1]
    assert (one.n_full is None) == decode_kernel
    assert (one.block_mask.full_kv_num_blocks is None) == decode_kernel
    assert block_sparse.calls[-1]["errors"] == []
    assert rel_err(out, b.reference) <= TOLERANCE[case.dtype]
    _run(case, "page_table", block_sparse, {"SPLIT_KV": 1})
    two = block_sparse.tables[-1]
    assert two.block_mask.full_kv_num_blocks is not None
    assert block_sparse.calls[-1]["errors"] == []
    # the same pages either way
    if not decode_kernel:
        return
    for z in range(one.rows):
        for qb in range(one.parts.shape[1]):
            listed = sorted(one.parts[z, qb, :int(one.n_part[z, qb])].tolist())
            split = (two.parts[z, qb, :int(two.n_part[z, qb])].tolist()
                     + two.fulls[z, qb, :int(two.n_full[z, qb])].tolist())
            assert listed == sorted(split)


@pytest.mark.parametrize("case", PAGE_TABLE, ids=[c.id() for c in PAGE_TABLE])
@pytest.mark.parametrize("splits", [1, 4])
def test_single_query_decode_lets_the_lists_alone_decide(
        case: Case, splits: int, block_sparse: Seen, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the compiled kernel reads only the listed pages (CUDA), a batch of single
    queries without a window carries a constant mask_mod (every listed page is whole
    and before its query); the lists stay exact against the real visibility, and the
    kernels' function over them, with NaN in every unowned slot, matches float64.
    Other batches keep the exact mask_mod; off CUDA every batch does."""
    from torch.nn.attention.flex_attention import noop_mask

    seen = block_sparse.tables
    b, out = _run(case, "page_table", block_sparse, {"SPLIT_KV": splits})
    assert seen[-1].block_mask.mask_mod is not noop_mask, "off CUDA the mask stays exact"
    monkeypatch.setattr(flex_paged, "lists_only", lambda device: True)
    b, out = _run(case, "page_table", block_sparse, {"SPLIT_KV": splits})
    constant = max(case.query_lens) == 1 and case.sliding_window is None
    assert (seen[-1].block_mask.mask_mod is noop_mask) == constant
    assert seen[-1].exact_mask is not noop_mask
    assert block_sparse.calls[-1]["errors"] == []
    assert b.kv_cache.isnan().any(), "the cache keeps its NaN poison"
    assert not out.isnan().any()
    err = rel_err(out, b.reference)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


TAILS = [PAGE_TABLE[0], PAGE_TABLE[1]]


@pytest.mark.parametrize("case", TAILS, ids=[c.id() for c in TAILS])
def test_compiled_tail_merge_matches_float64(case: Case, block_sparse: Seen,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The partly written last pages attended and merged as on CUDA, by Inductor (its
    CPU code here), with the kernel's part from the stand-in: unwritten rows NaN."""
    ran: list[bool] = []

    def compiled(*args: Any, **kwargs: Any) -> torch.Tensor:
        result = flex_paged._compiled_tail_merge()(*args, **kwargs)
        ran.append(True)  # not the eager fallback
        return result

    monkeypatch.setattr(flex_paged, "_tail_merger", lambda device: compiled)
    b, out = _run(case, "page_table", block_sparse)
    assert ran == [True]
    assert not out.isnan().any()
    err = rel_err(out, b.reference)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


def test_compiled_tail_merge_serves_every_bucket(block_sparse: Seen,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The page_table mode's batch is static for flex (one compile per power of two);
    the tail merge keeps batch entries and cache blocks symbolic: other buckets and
    caches compile nothing new."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(flex_paged, "_tail_merger",
                        lambda device: flex_paged._compiled_tail_merge())
    _run(PAGE_TABLE[0], "page_table", block_sparse)                  # 8 entries
    graphs = int(counters["stats"]["unique_graphs"])
    small = PAGE_TABLE[0].with_(query_lens=(1,) * 3, context_lens=(20, 3, 40))
    for case in (PAGE_TABLE[3], small):                               # 16 and 4 entries
        b, out = _run(case, "page_table", block_sparse)
        assert rel_err(out, b.reference) <= TOLERANCE[torch.float32]
    assert int(counters["stats"]["unique_graphs"]) == graphs


@pytest.mark.parametrize("mode", ["gather", "page_table"])
def test_cross_attention_block_lists(mode: str, block_sparse: Seen) -> None:
    """More queries than keys, non-causal (encoder-decoder)."""
    b, batch, q, ref = cross_attention_case(layout=L.SPLIT_KV_FIRST)
    block_sparse.query_lens = (9, 3, 1)
    out = torch.full((q.shape[0], b.case.num_heads, b.case.dv), float("nan"))
    flex_paged.flex_paged_attention(q, b.kv, batch, scale=b.case.scale, output=out,
                                    causal=False, mode=mode, compiled=True)  # type: ignore[arg-type]
    assert block_sparse.calls[0]["errors"] == []
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


def test_page_table_lists_pages_and_queries_as_the_call_sees_them(block_sparse: Seen) -> None:
    """page_table: one sparse block a page, batch entries a power of two, the cache's
    slots as keys."""
    case = PAGE_TABLE[3]
    b, _ = _run(case, "page_table", block_sparse)
    call = block_sparse.calls[0]
    assert call["block"] == (flex_paged.Q_BLOCK, case.block_size)
    assert call["q_shape"][0] == 16 and call["q_shape"][2] == 1
    assert call["k_shape"][2] == b.batch.num_blocks * case.block_size


def _torch_mask(b: int, q_len: int, kv_len: int, window: int) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    offset = torch.tensor([kv_len - q_len, kv_len - q_len - 37])

    def mask_mod(bi: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        p = q + offset[bi]
        return (k <= p) & (p - k < window)

    return create_block_mask(mask_mod, b, None, q_len, kv_len, device="cpu", BLOCK_SIZE=32)


def test_stand_in_matches_float64_on_torch_block_masks() -> None:
    """The stand-in itself, on a block mask torch builds (partial and full blocks of a
    causal window with per-entry offsets, GQA 4, soft cap), against float64 attention."""
    g = torch.Generator().manual_seed(3)
    b, hq, h, q_len, kv_len, d = 2, 8, 2, 70, 150, 16
    q = torch.randn(b, hq, q_len, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, kv_len, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, kv_len, d, generator=g, dtype=torch.float64)
    mask = _torch_mask(b, q_len, kv_len, window=100)
    assert int(mask.full_kv_num_blocks.sum()) > 0 and int(mask.kv_num_blocks.sum()) > 0

    def cap(s: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return 5.0 * torch.tanh(s / 5.0)

    out, lse = block_sparse_attention(q, k, v, mask, scale=d ** -0.5, score_mod=cap)
    dense = torch.stack([mask.mask_mod(torch.tensor(i), torch.tensor(0),
                                       torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :])
                         for i in range(b)])
    s = cap(torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(hq // h, 1)) * d ** -0.5)
    s = s.masked_fill(~dense[:, None], -math.inf)
    ref = torch.softmax(s, -1) @ v.repeat_interleave(hq // h, 1)
    assert float((out - ref).norm() / ref.norm()) < 1e-12
    assert torch.allclose(lse, torch.logsumexp(s, -1))
    assert block_list_errors(mask, q_len=q_len, kv_len=kv_len) == []


def test_stand_in_reads_full_lists_at_the_partial_lists_offsets() -> None:
    """Full lists of another width than the partial ones (what the op built before) are
    read at the wrong place, as Inductor's kernels read them: the stand-in's result is
    then wrong and the checker names the mismatch."""
    from torch.nn.attention.flex_attention import BlockMask

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 64, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 64, 16, generator=g, dtype=torch.float64)
    i32 = torch.int32
    # entry 0: keys 0..31 full; entry 1: keys 32..63 full; no partial blocks
    n_part = torch.zeros(2, 1, 1, dtype=i32)
    parts = torch.zeros(2, 1, 1, 2, dtype=i32)
    n_full = torch.full((2, 1, 1), 2, dtype=i32)
    fulls = torch.tensor([[0, 1, 0, 0], [2, 3, 0, 0]], dtype=i32).view(2, 1, 1, 4)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return ki // 32 == b

    wrong = BlockMask.from_kv_blocks(n_part, parts, n_full, fulls, BLOCK_SIZE=(8, 16),
                                     mask_mod=mask_mod, seq_lengths=(8, 64), compute_q_blocks=False)
    right = BlockMask.from_kv_blocks(n_part, torch.zeros(2, 1, 1, 4, dtype=i32), n_full, fulls,
                                     BLOCK_SIZE=(8, 16), mask_mod=mask_mod, seq_lengths=(8, 64),
                                     compute_q_blocks=False)
    ref, _ = block_sparse_attention(q, k, v, right, scale=0.25)
    bad, _ = block_sparse_attention(q, k, v, wrong, scale=0.25)
    assert block_list_errors(right, q_len=8, kv_len=64) == []
    assert not torch.allclose(bad[1], ref[1])  # entry 1 read entry 0's list, shifted
    assert any("differ in shape" in e for e in block_list_errors(wrong, q_len=8, kv_len=64))


def test_checker_names_each_kind_of_wrong_list() -> None:
    """The checker on a torch-built mask, then with a block dropped, a partial block
    listed as full and a block listed twice."""
    from torch.nn.attention.flex_attention import BlockMask

    mask = _torch_mask(2, 70, 150, window=100)
    assert block_list_errors(mask, q_len=70, kv_len=150) == []

    def variant(num: torch.Tensor, idx: torch.Tensor, fnum: torch.Tensor,
                fidx: torch.Tensor) -> list[str]:
        m = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=mask.BLOCK_SIZE,
                                     mask_mod=mask.mask_mod, seq_lengths=(70, 150),
                                     compute_q_blocks=False)
        return block_list_errors(m, q_len=70, kv_len=150)

    num, idx = mask.kv_num_blocks.clone(), mask.kv_indices.clone()
    fnum, fidx = mask.full_kv_num_blocks.clone(), mask.full_kv_indices.clone()
    z, q = 1, 0
    assert int(num[z, 0, q]) > 0 and int(fnum[z, 0, q]) > 0
    dropped = num.clone()
    dropped[z, 0, q] -= 1
    assert any("not listed" in e for e in variant(dropped, idx, fnum, fidx))
    as_full = fidx.clone()
    as_full[z, 0, q, int(fnum[z, 0, q])] = idx[z, 0, q, 0]
    more = fnum.clone()
    more[z, 0, q] += 1
    errors = variant(num, idx, more, as_full)
    assert any("has masked pairs" in e for e in errors)
    assert any("listed twice" in e for e in errors)


def test_block_lists_of_random_batches(block_sparse: Seen) -> None:
    """Random batches (1-6 requests, decodes and prefills up to 300 tokens, contexts up
    to 400, causal or not, windows, pages of 16-64) in both modes: no list error, and
    the stand-in's result within tolerance of float64."""
    import random

    rnd = random.Random(0)
    for i in range(24):
        n = rnd.randint(1, 6)
        case = Case(L.SPLIT_BLOCK_INTERLEAVED, head_size=16, group=2, num_kv_heads=1,
                    query_lens=tuple(rnd.choice([1, 1, rnd.randint(1, 300)]) for _ in range(n)),
                    context_lens=tuple(rnd.randint(0, 400) for _ in range(n)),
                    causal=rnd.random() < 0.8,
                    sliding_window=rnd.choice([None, None, rnd.randint(1, 200)]),
                    block_size=rnd.choice([16, 32, 64]), seed=i)
        mode = rnd.choice(["gather", "page_table"])
        block_sparse.calls.clear()
        b, out = _run(case, mode, block_sparse)
        assert block_sparse.calls[0]["errors"] == [], (mode, case)
        assert rel_err(out, b.reference) <= TOLERANCE[torch.float32], (mode, case)
