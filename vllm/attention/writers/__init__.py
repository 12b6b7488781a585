"""One writer per cache-layout family; backends pick theirs from here.

``writer_for_layout(layout)`` returns the standard writer of a layout (torch
reference on CPU, the Triton kernel on CUDA when Triton is importable).
"""

from __future__ import annotations

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.types import KVCacheLayout
from vllm.attention.writer import KVCacheWriter
from vllm.attention.writers.split import SplitKVCacheWriter

_SPLIT = (
    KVCacheLayout.SPLIT_NHD,
    KVCacheLayout.SPLIT_HND,
    KVCacheLayout.SPLIT_KV_FIRST,
    KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
)


def writer_for_layout(layout: KVCacheLayout) -> KVCacheWriter:
    """The standard :class:`KVCacheWriter` of a non-MLA layout."""
    if layout in _SPLIT:
        return SplitKVCacheWriter(layout)
    raise InvalidArgumentError("layout", layout.value, f"one of {', '.join(l.value for l in _SPLIT)}")
