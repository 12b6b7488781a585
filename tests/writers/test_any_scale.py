"""What a checked ``KVQuant`` holds is not checked again inside a writer.

``KVQuant`` refuses zero, negative and non-finite scales in CPU tensors, but never reads
a device tensor back: a kernel can meet any scale there, and the GPU tests hold it to the
torch reference for them (``tests/writers/test_writers_gpu.py``). So the writers, which
re-bind a call's scale tensors into a ``KVQuant`` of their own on every call, must not
refuse what the caller's ``KVQuant`` let through.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import any_scale_quant, raw
from vllm.attention import InvalidArgumentError, KVQuant
from vllm.attention.types import KVCacheLayout as L
from vllm.attention.writers import reference_write
from vllm.attention.writers.mla import MLALatentCacheWriter
from vllm.attention.writers.split import SplitKVCacheWriter

SCALES = torch.tensor([1.0, 2.0**-126, -0.5, 0.0])


def test_the_public_constructor_refuses_them() -> None:
    with pytest.raises(InvalidArgumentError):
        KVQuant("fp8_e4m3", SCALES, SCALES)


def test_split_and_mla_writers_take_them_as_their_reference_does() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, 128, generator=g).bfloat16()
    v = x.flip(0).contiguous()
    slots = torch.randperm(24, generator=g)[:8]
    quant = any_scale_quant("fp8_e4m3", SCALES, SCALES.flip(0).contiguous())
    got = torch.zeros(2, 2, 16, 4, 128, dtype=torch.float8_e4m3fn)
    want = got.clone()
    SplitKVCacheWriter(L.SPLIT_NHD).write(x, v, got, slots, quant, path="torch")
    reference_write(L.SPLIT_NHD, x, v, want, slots, quant)
    assert torch.equal(raw(got), raw(want))

    kv_c = torch.randn(8, 512, generator=g).bfloat16()
    k_pe = torch.randn(8, 1, 64, generator=g).bfloat16()
    one = torch.tensor([-0.5])
    mla_quant = any_scale_quant("fp8_e4m3", one, one)
    got_mla = torch.zeros(2, 16, 576, dtype=torch.float8_e4m3fn)
    want_mla = got_mla.clone()
    MLALatentCacheWriter().write(kv_c, k_pe, got_mla, slots, mla_quant, path="torch")
    reference_write(L.MLA_LATENT, kv_c, k_pe, want_mla, slots, mla_quant)
    assert torch.equal(raw(got_mla), raw(want_mla))
