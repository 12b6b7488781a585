"""The backends' Triton path, run on CPU by Triton's interpreter (small shapes): the
layouts and options only a backend combines (per-token-head int8, the legacy and
AITER layouts with fp8, a draft tree, DiffKV). Skipped without Triton, or when Triton
or the kernels were already imported without the interpreter in this process."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest
import torch

from tests.backends.grid import Case
from tests.backends.test_compute import run_case
from vllm.attention.backends.standard import StandardBackend

KERNELS = "vllm.attention.ops.triton_paged_kernels"


@pytest.fixture
def triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the GPU tests run the real kernels")
    mod = sys.modules.get(KERNELS)
    if mod is not None and type(mod.paged_attention_kernel).__name__ != "InterpretedFunction":
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 in this process")
    if mod is None and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "") != "1":
        # triton.language read the variable at import: interpreted kernels would fail on tl.zeros
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process")
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def triton_here(cls: Any, device: torch.device) -> str:
        return "triton"

    monkeypatch.setattr(StandardBackend, "fallback_path", classmethod(triton_here))


@pytest.mark.parametrize("case", [
    Case("TRITON_ATTN", "cpu", torch.float32, "int8_per_token_head", 16, 8, 2),
    Case("ROCM_ATTN", "cpu", torch.float16, "fp8_e4m3", 16, 8, 1),
    Case("ROCM_AITER_FA", "cpu", torch.bfloat16, "fp8", 32, 2, 2),
    Case("FLASH_ATTN_DIFFKV", "cpu", torch.bfloat16, "auto", 48, 8, 2),
], ids=lambda c: c.id)
def test_triton_path_through_the_backend(case: Case, triton_on_cpu: None) -> None:
    assert run_case(case, seed=3, interpreted=True) == "triton"


def test_tree_attention_triton(triton_on_cpu: None) -> None:
    from tests.backends.test_tree_attn import PARENTS, _ancestors, _run

    tree = _ancestors(PARENTS)
    assert _run("cpu", {"draft_tree": PARENTS}, {}, [tree, None, None, None]) == "triton"
