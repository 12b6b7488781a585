"""The Triton kernel's prefill launches: key tiles every row of a query tile sees run
without masks (``split_masks``), only the edge tiles build them; query tiles run last
first (``reverse_tiles``). Against float64 attention over the dequantised cache, under
the interpreter (small) and on CUDA (gpu), with configs that put interior tiles before,
between and after masked ones: causal diagonals, window starts, draft trees, pages
smaller than a key tile, padded heads."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.ops.paged_cases import TOLERANCE, Case, L, build, rel_err

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def skip_unless_triton_runs_on(device: str) -> None:
    """Skip the test where Triton is not installed or cannot run on ``device``."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    from vllm.attention.ops.triton_paged_attention import triton_unavailable_reason

    reason = triton_unavailable_reason(torch.device(device))
    if reason is not None:
        pytest.skip(reason)


def _run(case: Case, device: str, *, block_m: int, block_n: int, split_masks: bool) -> float:
    from vllm.attention.ops.triton_paged_attention import TritonLaunchConfig, paged_attention_triton

    b = build(case, device)
    out = b.new_output()
    cfg = TritonLaunchConfig(block_m=block_m, block_n=block_n, num_splits=1,
                             num_warps=4, num_stages=2, split_masks=split_masks,
                             reverse_tiles=split_masks)
    paged_attention_triton(b.query, b.kv, b.batch.common, scale=case.scale, output=out,
                           causal=case.causal, sliding_window=case.sliding_window,
                           logits_soft_cap=case.logits_soft_cap, tree_mask=b.tree_mask,
                           config=cfg)
    assert not out.isnan().any(), "every output element is written"
    return rel_err(out, b.reference)


LONG = dict(query_lens=(40, 1, 23), context_lens=(25, 70, 0))
INTERP = [
    Case(L.SPLIT_NHD, "auto", **LONG),  # type: ignore[arg-type]
    Case(L.SPLIT_NHD, "auto", sliding_window=19, **LONG),  # type: ignore[arg-type]
    Case(L.SPLIT_HND, "auto", dtype=torch.bfloat16, group=2, logits_soft_cap=4.0, **LONG),  # type: ignore[arg-type]
    Case(L.LEGACY_PAGED, "fp8_e4m3", per_head_scale=True, **LONG),  # type: ignore[arg-type]
    Case(L.PER_TOKEN_HEAD_QUANT, "int8_per_token_head", sliding_window=30, **LONG),  # type: ignore[arg-type]
    Case(L.DIFFKV_PACKED, "auto", head_size=40, head_size_v=24, **LONG),  # type: ignore[arg-type]
    Case(L.SPLIT_KV_FIRST, "auto", tree=True, query_lens=(6, 30, 1), context_lens=(41, 0, 33)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, "auto", causal=False, **LONG),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("split_masks", [True, False], ids=["split", "masked"])
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 32)])
@pytest.mark.parametrize("case", INTERP, ids=[c.id() for c in INTERP])
def test_interpreter_prefill_tiles(case: Case, block_m: int, block_n: int,
                                   split_masks: bool) -> None:
    skip_unless_triton_runs_on("cpu")
    err = _run(case, "cpu", block_m=max(block_m, case.group), block_n=block_n,
               split_masks=split_masks)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


def test_prefill_launches_split_masks_decode_launches_do_not() -> None:
    from vllm.attention.ops.triton_paged_attention import choose_config

    kv = build(Case(L.SPLIT_NHD, num_kv_heads=2, group=4, head_size=32)).kv
    args = dict(num_heads=8, num_reqs=2, max_seq_len=8192, query_dtype=torch.bfloat16)
    pre = choose_config(kv, max_query_len=512, **args)  # type: ignore[arg-type]
    dec = choose_config(kv, max_query_len=1, **args)  # type: ignore[arg-type]
    assert pre.split_masks and pre.reverse_tiles
    assert not dec.split_masks and not dec.reverse_tiles


GPU = [
    Case(L.SPLIT_NHD, "auto", dtype=torch.bfloat16, num_kv_heads=2, group=4, head_size=128,
         query_lens=(1024, 1, 777), context_lens=(0, 3000, 1024)),
    Case(L.SPLIT_NHD, "fp8_e4m3", dtype=torch.bfloat16, num_kv_heads=2, group=4,
         head_size=128, block_size=64, sliding_window=300,
         query_lens=(1024, 513), context_lens=(1000, 0)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, "auto", dtype=torch.float16, num_kv_heads=1, group=8,
         head_size=64, block_size=128, query_lens=(900, 65), context_lens=(100, 2000)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("block_m", "block_n", "split_masks"),
                         [(128, 64, True), (128, 128, True), (64, 64, False)])
@pytest.mark.parametrize("case", GPU, ids=[c.id() for c in GPU])
def test_cuda_prefill_tiles(case: Case, block_m: int, block_n: int, split_masks: bool) -> None:
    skip_unless_triton_runs_on("cuda")
    err = _run(case, "cuda", block_m=block_m, block_n=block_n, split_masks=split_masks)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


def test_interpreter_negative_scale_keeps_masks() -> None:
    """Unmasked tiles fold the scale into ``max(s) * scale``, right for a positive scale
    only; with a negative one (logits large enough that a wrong running maximum
    overflows exp2) the launch keeps every tile masked."""
    skip_unless_triton_runs_on("cpu")
    from vllm.attention.ops.reference import attend
    from vllm.attention.ops.triton_paged_attention import TritonLaunchConfig, paged_attention_triton

    case = Case(L.SPLIT_NHD, "auto", **LONG)  # type: ignore[arg-type]
    b = build(case)
    scale = -8.0
    out = b.new_output()
    cfg = TritonLaunchConfig(block_m=16, block_n=16, num_splits=1, split_masks=True)
    paged_attention_triton(b.query, b.kv, b.batch.common, scale=scale, output=out, config=cfg)
    refs, at = [], 0
    for i, n in enumerate(case.query_lens):
        refs.append(attend(b.query[at:at + n].double(), b.keys[i], b.values[i], scale=scale,
                           causal=True))
        at += n
    assert rel_err(out, torch.cat(refs)) <= TOLERANCE[case.dtype]
