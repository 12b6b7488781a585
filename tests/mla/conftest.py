"""MLA test fixtures.

Every MLA test runs torch on one intra-op thread: on the shared 2-core machine,
torch's thread pool spinning against other processes made the CPU conformance
grid ~20x slower (84 s instead of 4.6 s measured).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests.helpers import torch_threads

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the Triton MLA kernels on CPU tensors under Triton's interpreter."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton): no interpreter to run")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        # triton.language's own @jit helpers (tl.zeros, tl.cdiv, ...) are built when
        # triton is first imported; the interpreter can call them only if it was on then
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process, "
                    "so its @jit helpers cannot run under the interpreter")
