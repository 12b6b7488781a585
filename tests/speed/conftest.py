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


@pytest.fixture(params=["one", "several"])
def rope_tokens_per_program(request: pytest.FixtureRequest,
                            monkeypatch: pytest.MonkeyPatch) -> str:
    """The fused RoPE kernel at one token a program (what small batches launch) and at
    two tokens a program from the first row on (what ``rope_geometry`` gives most large
    batches; the small test batches then end in a partial tile)."""
    from vllm.attention.writers.kernels import rope

    if request.param == "several":
        monkeypatch.setattr(rope, "rope_geometry", lambda rows, mode, tile: (2, 4))
    return str(request.param)
