"""The Triton kernel's long-prefill launches (``LONG_PREFILL``: 128-row tiles of 32 keys,
4 warps, 4 stages, for 16-bit queries and heads up to 128; ``WIDE_PREFILL``: 256-row
tiles of 64 keys, 8 warps, 3 stages, unquantised caches on the devices where it was
measured) and where they replace the
flash varlen path: the heuristic's choices (decode's unchanged), the launch's result
against float64 with NaN in unowned slots (interpreter; CUDA under the gpu marker), and
``choose_path`` on the device it was measured on."""

from __future__ import annotations

import pytest
import torch

from tests.ops.paged_cases import TOLERANCE, Case, L, build, rel_err
from tests.ops.test_triton_prefill import skip_unless_triton_runs_on

BF16, FP16 = torch.bfloat16, torch.float16


def _config(head_size: int, dtype: torch.dtype, max_query_len: int, group: int = 4) -> object:
    from vllm.attention.ops.triton_paged_attention import choose_config

    kv = build(Case(L.SPLIT_NHD, num_kv_heads=2, group=group, head_size=head_size,
                    query_lens=(1,), context_lens=(3,))).kv
    return choose_config(kv, num_heads=2 * group, num_reqs=2, max_query_len=max_query_len,
                         max_seq_len=8192, query_dtype=dtype)


def test_long_prefills_take_the_measured_launch() -> None:
    from vllm.attention.ops.triton_paged_attention import LONG_PREFILL, TritonLaunchConfig

    n, warps, stages = LONG_PREFILL
    for d, dtype in ((128, BF16), (64, FP16)):
        assert _config(d, dtype, 2048) == TritonLaunchConfig(
            block_m=128, block_n=n, num_splits=1, num_warps=warps, num_stages=stages,
            split_masks=True, reverse_tiles=True)
    # what was not measured keeps the earlier rule
    for d, dtype in ((256, BF16), (128, torch.float32)):
        assert _config(d, dtype, 2048) == TritonLaunchConfig(
            block_m=128, block_n=32, num_splits=1, num_warps=4, num_stages=3,
            split_masks=True, reverse_tiles=True)
    assert _config(128, BF16, 512) == TritonLaunchConfig(  # 2048 rows: 64-row tiles
        block_m=64, block_n=64, num_splits=1, num_warps=4, num_stages=3,
        split_masks=True, reverse_tiles=True)


def test_on_measured_devices_unquantised_long_prefills_take_256_row_tiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``WIDE_PREFILL`` was measured (the device check patched to say so here):
    16-bit queries, an ``auto`` cache and heads of 65-128 take it; fp8 caches, heads of
    64 or 256, float32 and shorter prefills keep their earlier launches; decode too."""
    from vllm.attention.ops import triton_paged_attention as tpa
    from vllm.attention.ops.triton_paged_attention import (
        LONG_PREFILL,
        WIDE_PREFILL,
        choose_config,
        is_long_prefill_launch,
    )

    monkeypatch.setattr(tpa, "wide_prefill_measured", lambda device: True)

    def cfg(head_size: int, dtype: torch.dtype, max_query_len: int, cache: str = "auto",
            group: int = 4) -> tpa.TritonLaunchConfig:
        kv = build(Case(L.SPLIT_NHD, cache, dtype=dtype, num_kv_heads=2, group=group,
                        head_size=head_size, query_lens=(1,), context_lens=(3,))).kv
        return choose_config(kv, num_heads=2 * group, num_reqs=2, max_query_len=max_query_len,
                             max_seq_len=8192, query_dtype=dtype)

    for d, dtype, group in ((128, BF16, 4), (96, FP16, 8), (128, BF16, 1)):
        c = cfg(d, dtype, 4096, group=group)
        assert (c.block_m, c.block_n, c.num_warps, c.num_stages) == WIDE_PREFILL, (d, group)
        assert c.split_masks and c.reverse_tiles and is_long_prefill_launch(c)
    for d, dtype, cache in ((128, BF16, "fp8_e4m3"), (64, FP16, "auto")):
        c = cfg(d, dtype, 2048, cache)
        assert c.block_m == 128 and (c.block_n, c.num_warps, c.num_stages) == LONG_PREFILL
        assert is_long_prefill_launch(c)
    assert not is_long_prefill_launch(cfg(256, BF16, 2048))
    assert not is_long_prefill_launch(cfg(128, torch.float32, 2048))
    assert cfg(128, BF16, 512).block_m == 64
    assert cfg(128, BF16, 1).block_m == 16


def test_the_256_row_launch_is_never_taken_off_cuda_or_under_the_interpreter() -> None:
    from vllm.attention.ops.triton_paged_attention import wide_prefill_measured

    assert not wide_prefill_measured(torch.device("cpu"))


def test_decode_launches_are_unchanged() -> None:
    from vllm.attention.ops.triton_paged_attention import TritonLaunchConfig

    dec = _config(128, BF16, 1)
    assert (dec.block_m, dec.block_n, dec.num_warps, dec.num_stages) == (16, 64, 4, 3)  # type: ignore[attr-defined]
    assert not dec.split_masks and not dec.reverse_tiles  # type: ignore[attr-defined]
    assert isinstance(dec, TritonLaunchConfig) and dec.num_splits >= 1


INTERP = [
    Case(L.SPLIT_NHD, "auto", dtype=BF16, query_lens=(70, 1, 33), context_lens=(25, 70, 0)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, "auto", dtype=FP16, sliding_window=19,
         query_lens=(70, 1, 33), context_lens=(25, 70, 0)),
    Case(L.SPLIT_KV_FIRST, "auto", dtype=BF16, logits_soft_cap=4.0, query_lens=(65, 2),
         context_lens=(40, 100)),
]


@pytest.mark.parametrize("wide", [False, True], ids=["128rows", "256rows"])
@pytest.mark.parametrize("case", INTERP, ids=[c.id() for c in INTERP])
def test_interpreter_runs_the_long_prefill_tile(case: Case, wide: bool) -> None:
    """The launches' tile shapes (128 rows = 32 tokens x 4 heads with 32-key tiles;
    256 rows with 64-key tiles; edge-only masks, last-first) on small batches, under
    the interpreter."""
    skip_unless_triton_runs_on("cpu")
    from vllm.attention.ops.triton_paged_attention import (
        LONG_PREFILL,
        WIDE_PREFILL,
        TritonLaunchConfig,
        paged_attention_triton,
    )

    m, n, warps, stages = WIDE_PREFILL if wide else (128, *LONG_PREFILL)
    cfg = TritonLaunchConfig(block_m=m, block_n=n, num_splits=1, num_warps=warps,
                             num_stages=stages, split_masks=True, reverse_tiles=True)
    b = build(case)
    out = b.new_output()
    paged_attention_triton(b.query, b.kv, b.batch.common, scale=case.scale, output=out,
                           sliding_window=case.sliding_window,
                           logits_soft_cap=case.logits_soft_cap, config=cfg)
    assert not out.isnan().any()
    err = rel_err(out, b.reference)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


def test_off_the_measured_devices_flash_varlen_keeps_its_rule() -> None:
    from vllm.attention.batch import make_paged_batch
    from vllm.attention.ops.flash_varlen import flash_varlen_worth_it, triton_measured_faster

    kv = build(Case(L.SPLIT_NHD, dtype=BF16, head_size=128, query_lens=(4,), context_lens=(3,))).kv
    fresh = make_paged_batch([2048] * 2, [0, 0], block_size=16).common
    assert triton_measured_faster(fresh, kv, 8, 2) is None  # a CPU cache
    assert flash_varlen_worth_it(fresh, kv, 8, 2, causal=True, sliding_window=None) is None


# -- CUDA ----------------------------------------------------------------------------------

GPU = [
    Case(L.SPLIT_NHD, "auto", dtype=BF16, num_kv_heads=2, group=4, head_size=128,
         query_lens=(1024, 1, 1500), context_lens=(0, 3000, 1024)),
    Case(L.SPLIT_NHD, "fp8_e4m3", dtype=BF16, num_kv_heads=2, group=4, head_size=128,
         block_size=64, sliding_window=300, query_lens=(1024, 513), context_lens=(1000, 0)),
    Case(L.SPLIT_BLOCK_INTERLEAVED, "auto", dtype=FP16, num_kv_heads=1, group=8, head_size=64,
         block_size=128, logits_soft_cap=30.0, query_lens=(900, 65), context_lens=(100, 2000)),
    Case(L.SPLIT_KV_FIRST, "auto", dtype=BF16, num_kv_heads=8, group=4, head_size=128,
         query_lens=(2048,) * 2, context_lens=(0, 2048)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU, ids=[c.id() for c in GPU])
def test_cuda_default_long_prefill_launch(case: Case) -> None:
    skip_unless_triton_runs_on("cuda")
    from vllm.attention.ops.triton_paged_attention import (
        LONG_PREFILL,
        WIDE_PREFILL,
        choose_config,
        paged_attention_triton,
        wide_prefill_measured,
    )

    b = build(case, "cuda")
    meta = b.batch.common
    cfg = choose_config(b.kv, num_heads=case.num_heads, num_reqs=meta.num_reqs,
                        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                        query_dtype=case.dtype)
    launch = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    wide = (wide_prefill_measured(b.kv.device) and case.cache_dtype == "auto"
            and case.head_size > 64)
    assert launch == (WIDE_PREFILL if wide else (128, *LONG_PREFILL)), launch
    out = b.new_output()
    paged_attention_triton(b.query, b.kv, meta, scale=case.scale, output=out,
                           sliding_window=case.sliding_window,
                           logits_soft_cap=case.logits_soft_cap)
    assert not out.isnan().any()
    err = rel_err(out, b.reference)
    assert err <= TOLERANCE[case.dtype], f"relative error {err:.3g}"


@pytest.mark.gpu
def test_cuda_choose_path_for_long_prefills() -> None:
    """On the device the launch was measured on, long prefills run Triton; a prefill
    whose Triton launch was not measured (D=256) keeps the flash varlen path."""
    from vllm.attention.ops.flash_varlen import TRITON_MEASURED_ON, flash_varlen_unavailable
    from vllm.attention.ops.paged_attention import choose_path

    if flash_varlen_unavailable(torch.device("cuda")) is not None:
        pytest.skip("no flash varlen kernel here")
    long = build(Case(L.SPLIT_NHD, dtype=BF16, head_size=128, query_lens=(2048,),
                      context_lens=(0,)), "cuda")
    wide = build(Case(L.SPLIT_NHD, dtype=BF16, head_size=256, query_lens=(2048,),
                      context_lens=(0,)), "cuda")
    measured = torch.cuda.get_device_capability() in TRITON_MEASURED_ON
    assert choose_path(long.query, long.kv, long.batch.common) == (
        "triton" if measured else "flash_varlen")
    assert choose_path(wide.query, wide.kv, wide.batch.common) == "flash_varlen"


def test_the_compile_check_compiles_the_256_row_launch_for_sm_90_only() -> None:
    """``tools/triton_compile_check.py`` (run by CI without a GPU) records the 256-row
    launch for its sm_90 target and, like the launcher, for no other target. In a
    subprocess without ``TRITON_INTERPRET`` (the recorders load the compiled kernels)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="triton is not installed: the compile check needs it")
    from vllm.attention.ops.triton_paged_attention import WIDE_PREFILL

    root = Path(__file__).resolve().parents[2]
    script = (
        "import json, triton_compile_check as c\n"
        "print(json.dumps({n: sorted({(k[3].get('BLOCK_M'), k[3].get('BLOCK_N'),"
        " k[3].get('num_warps'), k[3].get('num_stages')) for k in c.record_paged(t)"
        " if k[0] == 'paged'}) for n, t in c.TARGETS.items()}))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tools"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    launches = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "sm_90" in launches
    for name, found in launches.items():
        assert (list(WIDE_PREFILL) in found) == (name == "sm_90"), (name, found)
