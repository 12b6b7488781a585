"""One intra-op thread for these small-shape tests: on a shared 2-core machine torch's
thread pool costs more in contention than it gains (4x on the compute grid)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import torch_threads


@pytest.fixture(autouse=True, scope="package")
def _one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield
