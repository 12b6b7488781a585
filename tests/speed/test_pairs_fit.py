"""``pairs_fit``: the two-element inline PTX of the writer kernels (``PACKED_WIDEN``)
only for tiles of at least two elements a thread; ``tools/triton_compile_check.py``
compiles the small tiles for sm_90 (``tests/ops/test_triton_compile.py``), this checks
the rule and where it is applied, on CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vllm.attention.layouts import split_kv_views
from vllm.attention.types import KVCacheLayout
from vllm.attention.writers import kernels as tw


def _targets(h: int, d: int) -> list[tw.ScatterTarget]:
    cache = torch.zeros(64, 2, 16, h, d, dtype=torch.float8_e4m3fn)
    return [tw.ScatterTarget.token_major(x) for x in split_kv_views(cache, KVCacheLayout.SPLIT_NHD)]


def test_pairs_fit_needs_two_elements_per_thread_of_every_tile() -> None:
    assert tw.pairs_fit([256, 512], 4)
    assert not tw.pairs_fit([256, 128], 4)
    assert not tw.pairs_fit([256], 8)
    assert tw.pairs_fit([128], 2)
    assert tw.pairs_fit([], 4)


def test_input_tiles_of_the_launches() -> None:
    key = torch.zeros(4096, 8, 128, dtype=torch.bfloat16)
    slots = torch.zeros(4096, dtype=torch.int64)
    one = torch.ones(1)
    kt, vt = _targets(8, 128)
    plain = tw.scatter_kv_launch(key, key, kt, vt, slots, 1, one, one)
    c = plain.constexprs
    assert tw.input_tiles(plain.kernel, c) == [c["BLOCK_T"] * 8 * 128] * 2
    rope = tw.rope_kv_launch(None, key, key, kt, vt, slots, slots, torch.zeros(4096, 64),
                             True, 1, one, one)
    c = rope.constexprs
    assert c["PASS_K"]  # rotary dim 64 of 128: the unrotated half is a tile of its own
    assert tw.input_tiles(rope.kernel, c) == [c["BLOCK_T"] * 8 * n for n in (32, 128, 64)]


def test_small_tiles_drop_packed_widen_in_the_launch_and_the_sweep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import tune_writers  # type: ignore[import-not-found]  # benchmarks/ is no package

    small = torch.zeros(7, 1, 2, dtype=torch.bfloat16)
    slots = torch.zeros(7, dtype=torch.int64)
    one = torch.ones(1)
    st = _targets(1, 2)
    launch = tw.scatter_kv_launch(small, small, st[0], st[1], slots, 1, one, one)
    consts = {**launch.constexprs, "HW_CVT": True}  # as built on an sm_89+ GPU
    consts["PACKED_WIDEN"] = tw.packed_widen(launch.kernel, consts, tw.TRITON_DEFAULT_WARPS)
    assert not consts["PACKED_WIDEN"]

    key = torch.zeros(8192, 8, 128, dtype=torch.bfloat16)
    slots = torch.zeros(8192, dtype=torch.int64)
    kt, vt = _targets(8, 128)
    rope = tw.rope_kv_launch(None, key, key, kt, vt, slots, slots, torch.zeros(4096, 128),
                             True, 1, one, one)
    base = dataclasses.replace(rope, constexprs={**rope.constexprs, "HW_CVT": True,
                                                 "PACKED_WIDEN": True})
    assert tune_writers.launch_variant(base, "bt=1,warps=8", 8192).constexprs["PACKED_WIDEN"]
    assert not tune_writers.launch_variant(base, "bt=1,warps=16", 8192).constexprs[
        "PACKED_WIDEN"]
    assert tune_writers.launch_variant(base, "packed=1,bt=1,warps=16", 8192).constexprs[
        "PACKED_WIDEN"]
