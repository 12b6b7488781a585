"""Every standard backend's compute against float64 dense attention, on a grid derived
from its declarations (dtype x cache dtype x block size, ids like
``TRITON_ATTN-cpu-bf16-fp8_e4m3-bs16``), with GQA ratios 1, 4 and 8 in each case.

The batch mixes a prefill, decodes and a chunked prefill whose lengths cross block
boundaries; the cache starts as random bytes, so reading past a sequence shows up.
The reference is built from the K/V the test generated (quantised as DESIGN.md
section 5 says), not read back from the cache.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.backends.grid import (
    DEVICES,
    GQA,
    STANDARD,
    Case,
    backend_cases,
    cases,
    dense,
    head_sizes,
    rel_err,
    stored,
    grid_block_sizes,
)
from tests.helpers import fill_random_bytes, raw
from vllm.attention import allocate_kv_cache
from vllm.attention.batch import make_paged_batch
from vllm.attention.layer import Attention
from vllm.attention.registry import get_backend
from vllm.forward_context import set_forward_context


def _query_and_context(bs: int) -> tuple[list[int], list[int]]:
    # prefill, decode, chunked prefill, decode at a block edge
    return [bs + 5, 1, 3, 1], [0, 2 * bs - 1, bs + 1, 3 * bs]


def run_case(case: Case, seed: int, *, sliding_window: int | None = None,
             soft_cap: float | None = None, per_head_scales: bool = True,
             interpreted: bool = False) -> str:
    """Run one case; returns the compute path that ran."""
    backend = get_backend(case.backend)
    dev = torch.device(case.device)
    num_heads, num_kv_heads = case.num_heads, case.num_kv_heads
    g = torch.Generator().manual_seed(seed)
    d, dv_opt = head_sizes(backend)
    dv = dv_opt or d
    qlens, clens = _query_and_context(case.block_size)
    batch = make_paged_batch(qlens, clens, block_size=case.block_size, device=dev, generator=g)
    scaled = case.cache_dtype != "auto"
    n_scales = num_kv_heads if per_head_scales else 1
    k_scale = (torch.rand(n_scales, generator=g) * 0.5 + 0.5) if scaled else None
    v_scale = (torch.rand(n_scales, generator=g) * 0.5 + 0.5) if scaled else None
    layer = Attention(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=d, head_size_v=dv_opt,
        scale=d ** -0.5, backend=backend, layer_name="l0", kv_cache_dtype=case.cache_dtype,
        k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
    ).to(dev)
    cache = allocate_kv_cache(
        backend, num_blocks=batch.num_blocks, block_size=case.block_size,
        num_kv_heads=num_kv_heads, head_size=d + (dv_opt or 0), cache_dtype=case.cache_dtype,
        model_dtype=case.dtype, device=dev,
    )
    fill_random_bytes(cache, seed)
    layer.bind_kv_cache(cache, case.block_size)

    total = [c + q for c, q in zip(clens, qlens)]
    ks = [torch.randn(t, num_kv_heads, d, generator=g).to(case.dtype) for t in total]
    vs = [torch.randn(t, num_kv_heads, dv, generator=g).to(case.dtype) for t in total]
    qs = [torch.randn(q, num_heads, d, generator=g).to(case.dtype) for q in qlens]
    k_ctx = torch.cat([k[:c] for k, c in zip(ks, clens)]).to(dev)
    v_ctx = torch.cat([v[:c] for v, c in zip(vs, clens)]).to(dev)
    layer.kv_cache_writer.write(k_ctx, v_ctx, cache, batch.context_slots, layer.kv_quant)
    k_new = torch.cat([k[c:] for k, c in zip(ks, clens)]).to(dev)
    v_new = torch.cat([v[c:] for v, c in zip(vs, clens)]).to(dev)
    query = torch.cat(qs).to(dev)

    meta = backend.get_builder_cls()(layer.spec, dev).build(batch.common)
    ctx = dict(attn_metadata={"l0": meta}, slot_mapping={"l0": batch.new_slots})
    with set_forward_context(**ctx):
        out = layer(query, k_new, v_new)  # writes this step's K/V, then computes

    # compute alone is read-only and repeatable
    before = raw(cache).clone()
    again = torch.full_like(out, math.nan)
    with set_forward_context(**ctx):
        layer.impl.forward(layer, query, k_new, v_new, cache, meta, again)
    assert torch.equal(raw(cache), before), "impl.forward changed the cache bytes"
    assert torch.equal(again, out)
    path = layer.impl.last_compute_path
    assert path in backend.runnable_paths(dev), path
    if dev.type == "cpu" and not interpreted:
        assert path == "torch"

    ones = torch.ones(1)
    at = 0
    errs = []
    for q, k, v in zip(qs, ks, vs):
        kr = stored(k, case.cache_dtype, layer.kv_quant.k_scale if scaled else ones)
        vr = stored(v, case.cache_dtype, layer.kv_quant.v_scale if scaled else ones)
        ref = dense(q, kr, vr, scale=d ** -0.5, causal=True, window=sliding_window,
                    cap=soft_cap)
        errs.append(rel_err(out[at: at + q.shape[0]], ref))
        at += q.shape[0]
    tol = backend.tolerances[case.dtype]  # type: ignore[attr-defined]
    assert max(errs) <= tol, f"{case.id} ({path}): {errs} > {tol}"
    assert path is not None
    return path


@pytest.mark.parametrize("name", STANDARD)
def test_grid_covers_the_declarations(name: str) -> None:
    b = get_backend(name)
    grid = backend_cases(name, "cpu")
    assert {c.dtype for c in grid} == set(b.supported_dtypes)
    assert {c.cache_dtype for c in grid} == set(b.supported_kv_cache_dtypes)
    assert {c.block_size for c in grid} == set(grid_block_sizes(b))
    assert {(c.num_heads, c.num_kv_heads) for c in grid} == set(GQA)
    assert all(b.supports(dtype=c.dtype, head_size=head_sizes(b)[0], block_size=c.block_size,
                          kv_cache_dtype=c.cache_dtype) for c in grid)


def test_case_ids() -> None:
    ids = {p.id for p in cases("cpu")}
    assert any(i.startswith("TRITON_ATTN-cpu-bf16-fp8_e4m3-bs16-gqa") for i in ids)
    assert any(i.startswith("TRITON_ATTN-cpu-fp32-int8_per_token_head-bs48-gqa") for i in ids)
    assert not any(i.startswith("FLASH_ATTN-cpu-fp32") for i in ids)


@pytest.mark.parametrize("case", cases("cpu") + cases("cuda"))
def test_compute_matches_float64(case: Case) -> None:
    run_case(case, seed=1000 + len(case.id))


def _features() -> list[object]:
    params = []
    for name in STANDARD:
        b = get_backend(name)
        first = backend_cases(name, "cpu")[0]
        for dev in DEVICES:
            c = Case(name, dev.values[0], first.dtype, "auto", first.block_size)
            if b.supports_sliding_window:
                params.append(pytest.param(c, 13, None, id=f"{c.id}-sw13", marks=dev.marks))
            if b.supports_logits_soft_cap:
                params.append(pytest.param(c, None, 5.0, id=f"{c.id}-softcap", marks=dev.marks))
    return params


@pytest.mark.parametrize(("case", "window", "cap"), _features())
def test_sliding_window_and_soft_cap(case: Case, window: int | None, cap: float | None) -> None:
    run_case(case, seed=7, sliding_window=window, soft_cap=cap)
