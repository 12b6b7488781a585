"""The writer properties on CUDA: a seeded sweep of the random cases of
``tests/property/model.py`` through the compiled Triton kernels (the default path
on CUDA) and, for every fourth case, the torch reference on the GPU.

Seeds are fixed (``crc32("<family>-<i>")``), so a failure names a case that
reproduces with ``run_case(draw_case(RandomChooser(seed), family), "cuda")``.
``VLLM_KV_GPU_SWEEP`` sets the cases per family (default 200: 1,400 in all; the
first run compiles one kernel variant per new shape class, later runs hit
Triton's cache). Marked ``gpu``: skipped, with the reason, without CUDA.
"""

from __future__ import annotations

import os
import time
import zlib

import pytest
import torch

from tests.property.model import FAMILIES, RandomChooser, build, draw_case, run_case
from vllm.attention import KVCacheWriteError
from vllm.attention.writers.kernels import triton_importable
from vllm.attention.writers.validation import check_slots_in_range

pytestmark = pytest.mark.gpu

CASES_PER_FAMILY = int(os.environ.get("VLLM_KV_GPU_SWEEP", "200"))


def sweep_seed(family: str, i: int) -> int:
    return zlib.crc32(f"{family}-{i}".encode())


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable: no kernels")
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_writers_seeded_sweep_cuda(family: str) -> None:
    start = time.perf_counter()
    for i in range(CASES_PER_FAMILY):
        seed = sweep_seed(family, i)
        case = draw_case(RandomChooser(seed), family)
        try:
            run_case(case, "cuda", None)  # None: the default path, Triton on CUDA
            if i % 4 == 0:
                run_case(case, "cuda", "torch")
        except AssertionError as exc:
            raise AssertionError(f"sweep seed {seed} (family {family}, case {i}):\n{exc}") from None
    elapsed = time.perf_counter() - start
    print(f"{family}: {CASES_PER_FAMILY} cases on {torch.cuda.get_device_name()} "
          f"in {elapsed:.1f}s")


@pytest.mark.parametrize("family", FAMILIES)
def test_checked_mode_on_cuda_rejects_exactly_duplicates(family: str) -> None:
    """``check_slots_in_range`` on device tensors: rejects iff a slot lies past the
    cache (checked first) or repeats."""
    for i in range(50):
        case = draw_case(RandomChooser(sweep_seed(family, 10_000 + i)), family, max_tokens=512)
        b = build(case, "cuda")
        kept = b.slots[b.slots >= 0]
        if bool((kept >= case.num_slots).any()):
            with pytest.raises(KVCacheWriteError, match=r"slot\(s\) up to"):
                check_slots_in_range(b.slots, case.num_slots)
        elif kept.unique().numel() != kept.numel():
            with pytest.raises(KVCacheWriteError, match="duplicate"):
                check_slots_in_range(b.slots, case.num_slots)
        else:
            check_slots_in_range(b.slots, case.num_slots)
