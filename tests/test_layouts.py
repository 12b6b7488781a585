"""``empty_in_stride_order``: the one allocation every cache, benchmark and test case of
a layout goes through."""

from __future__ import annotations

import pytest
import torch

from vllm.attention.layouts import empty_in_stride_order, kv_cache_shape, kv_cache_stride_order
from vllm.attention.types import KVCacheLayout


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.value)
def test_logical_shape_physical_order(layout: KVCacheLayout) -> None:
    heads = 1 if layout in (KVCacheLayout.MLA_LATENT, KVCacheLayout.MLA_FP8_DS) else 3
    shape = kv_cache_shape(layout, 5, 16, heads, 24)
    order = kv_cache_stride_order(layout)
    t = empty_in_stride_order(shape, order, dtype=torch.float32, device="cpu")
    assert tuple(t.shape) == tuple(shape)
    # dense: the storage holds exactly the elements, and the strides, read in the
    # physical order, are those of a contiguous tensor of the permuted shape
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    physical = [shape[i] for i in order]
    assert [t.stride(i) for i in order] == list(torch.empty(physical).stride())
    # every element its own address, in the physical order
    flat = torch.arange(t.numel(), dtype=torch.float32).reshape(physical)
    t.copy_(flat.permute(*sorted(range(len(order)), key=order.__getitem__)))
    assert torch.equal(t.permute(*order).contiguous().reshape(-1),
                       torch.arange(t.numel(), dtype=torch.float32))
