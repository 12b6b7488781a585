"""The ten standard backends on a real GPU (skipped without CUDA).

* the conformance kit on every backend, on its default CUDA path;
* each vendor kernel that imports here runs (``last_compute_path`` names it) on a call
  it declares it takes, within the backend's tolerance of float64;
* the paths each backend reports on this GPU, printed for the run log.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.grid import STANDARD, Case, head_sizes
from tests.backends.test_compute import run_case
from vllm.attention.backends.standard import StandardBackend
from vllm.attention.conformance import check_backend
from vllm.attention.registry import get_backend

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", STANDARD)
def test_conformance_cuda(name: str) -> None:
    backend = get_backend(name)
    print(f"{name}: compute={backend.compute_path(CUDA)} notes={backend.compute_path_notes(CUDA)}")
    report = check_backend(name, "cuda")
    assert report.ok, "\n".join(report.failures)
    assert report.passed


def _vendor_cases() -> list[object]:
    params = []
    for name in STANDARD:
        b = get_backend(name)
        assert issubclass(b, StandardBackend)
        for kernel in b.vendor_kernels:
            bs = next(x for x in (16, 32, 256) if kernel.block_sizes.admits(x)
                      and b.block_sizes.admits(x))
            for cd in sorted(kernel.cache_dtypes & b.supported_kv_cache_dtypes):
                for dt in (torch.bfloat16, torch.float16):
                    case = Case(name, "cuda", dt, cd, bs)
                    params.append(pytest.param(b, kernel.name, case, id=f"{kernel.name}-{case.id}"))
    return params


@pytest.mark.parametrize(("backend", "kernel_name", "case"), _vendor_cases())
def test_vendor_kernel_runs_where_it_imports(backend: type[StandardBackend[object]],  # type: ignore[type-var]
                                             kernel_name: str, case: Case) -> None:
    kernel = next(k for k in backend.vendor_kernels if k.name == kernel_name)
    reason = kernel.unavailable_reason(CUDA)
    if reason is not None:
        pytest.skip(f"{kernel_name}: {reason}")
    d, dv = head_sizes(backend)
    if not kernel.head_sizes.admits(d) or (dv is not None and not kernel.head_sizes.admits(dv)):
        pytest.skip(f"{kernel_name} does not take head size {d}/{dv}")
    path = run_case(case, seed=5, per_head_scales=kernel.per_head_scales)
    assert path == kernel_name
    for window, cap in ((13, None), (None, 5.0)):
        if (window and kernel.sliding_window and backend.supports_sliding_window) or (
                cap and kernel.softcap and backend.supports_logits_soft_cap):
            assert run_case(case, seed=6, sliding_window=window, soft_cap=cap,
                            per_head_scales=kernel.per_head_scales) == kernel_name
