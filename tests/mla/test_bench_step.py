"""``benchmarks/bench_mla_decode.py``'s ``Step``: the step's own rows are written when it
is built, so the decode alone (``Step.kernel``, ``Step.check``) reads written slots
whether or not a layer call came first. The cache is allocated uninitialised: on a GPU
whose memory last held a bfloat16 cache, an E4M3 decode read before any layer call
produced NaN (bytes 0x7f and 0xff are E4M3 NaN)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``benchmarks/bench_mla_decode.py`` as a module (``benchmarks/`` on the path only
    while the test runs)."""
    monkeypatch.syspath_prepend(ROOT / "benchmarks")
    import bench_mla_decode

    return bench_mla_decode


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_a_layer_call_rewrites_the_same_bytes(cache_dtype: str, bench: Any) -> None:
    step = bench.Step("TRITON_MLA", 16, cache_dtype, 2, 64, torch.device("cpu"))
    slots = step.batch.new_slots
    rows = step.cache.view(-1, step.cache.shape[-1])
    before = rows[slots].view(torch.uint8).clone()
    whole = step.cache.view(torch.uint8).clone()
    with step.active():
        step.layer_call()
    # the layer's write of the step's K/V found its bytes already there, and nothing
    # else in the cache changed
    assert torch.equal(rows[slots].view(torch.uint8), before)
    assert torch.equal(step.cache.view(torch.uint8), whole)
    # and they are the step's rows, not whatever the allocation held: the latent part
    # of an auto cache is the step's kv_c itself
    if cache_dtype == "auto":
        assert torch.equal(rows[slots][:, :bench.L], step.kv_c)
