"""Shared fixtures; GPU tests skip cleanly (with the reason) where there is no CUDA.

Without CUDA the Triton kernels run under Triton's interpreter, and Triton fixes
its own ``@jit`` helpers (``tl.max``, ``tl.sum``, ...) to compiled or interpreted
when it is first imported. So this file, which pytest loads before any test module,
sets ``TRITON_INTERPRET=1`` for the whole process on such machines: otherwise the
first test module to import Triton decides, and the kernel tests depend on the
order the modules run in. (Compile checks run in subprocesses without it.)
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_legacy_warnings() -> None:
    """Forget which legacy backends have warned, so a test can see the warning."""
    from shim.warnings import _reset_for_tests

    _reset_for_tests()
