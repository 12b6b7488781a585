"""Shared fixtures; GPU tests skip cleanly (with the reason) where there is no CUDA."""

from __future__ import annotations

import pytest
import torch


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
