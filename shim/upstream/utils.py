"""``vllm.utils`` / ``vllm.utils.math_utils`` and
``vllm.model_executor.layers.batch_invariant``: the small helpers backends import."""

from __future__ import annotations

import os

__all__ = ["cdiv", "round_up", "vllm_is_batch_invariant"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(a // -b)


def round_up(x: int, y: int) -> int:
    return cdiv(x, y) * y


def vllm_is_batch_invariant() -> bool:
    """True when ``VLLM_BATCH_INVARIANT=1`` asks for batch-invariant kernels."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() == "1"
