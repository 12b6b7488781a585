"""One intra-op thread: these are small shapes on a shared 2-core machine, where
torch's thread pool costs more in contention than it gains."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import torch_threads


@pytest.fixture(autouse=True, scope="package")
def _one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield
