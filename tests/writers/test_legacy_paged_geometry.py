"""The legacy paged cache ``(2, nb, bs*H*D)`` does not carry ``H`` and ``D``: a key of
another head count or size fits it. The layer binds its writer to its geometry, so
such a key is an error naming the shape and the geometry, and nothing is written;
keys of the layer's geometry are written bit-exact, and nothing else changes."""

from __future__ import annotations

import pytest
import torch

from vllm.attention import allocate_kv_cache
from vllm.attention.backends.rocm_attn import RocmAttentionBackend
from vllm.attention.batch import make_paged_batch
from vllm.attention.conformance import raw_bytes
from vllm.attention.errors import InvalidArgumentError, KVCacheWriteError
from vllm.attention.layer import Attention
from vllm.attention.writers import LegacyPagedKVCacheWriter
from vllm.forward_context import set_forward_context

H, D, BS, NB = 2, 64, 16, 4


def _triton_device() -> str:
    pytest.importorskip("triton", reason="triton is not installed: the kernel cannot run here")
    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter


def _layer(cache_dtype: str, device: str) -> tuple[Attention, torch.Tensor]:
    layer = Attention(num_heads=2 * H, num_kv_heads=H, head_size=D, scale=D ** -0.5,
                      backend=RocmAttentionBackend, layer_name="model.layers.0.attn",
                      kv_cache_dtype=cache_dtype, k_scale=0.5, v_scale=0.75).to(device)
    cache = allocate_kv_cache(RocmAttentionBackend, num_blocks=NB, block_size=BS,
                              num_kv_heads=H, head_size=D, cache_dtype=cache_dtype,
                              model_dtype=torch.bfloat16, device=device)
    gen = torch.Generator().manual_seed(3)
    raw = raw_bytes(cache)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    layer.bind_kv_cache(cache, BS)
    return layer, cache


def _inputs(num_tokens: int, heads: int, size: int, device: str,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens + 2, heads, size, generator=gen).bfloat16().to(device)
    value = torch.randn(num_tokens + 2, heads, size, generator=gen).bfloat16().to(device)
    slots = torch.randperm(NB * BS, generator=gen)[:num_tokens]
    slots[::5] = -1
    return key, value, slots.to(device)


def _expected(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """The cache after the write, from the layout's formulas: ``K[b, h, d // x, o, d % x]``
    and ``V[b, h, d, o]`` for ``(b, o) = divmod(slot, bs)``."""
    want = cache.clone()
    x = 16 // cache.element_size()
    k5 = want[0].view(NB, H, D // x, BS, x)
    v4 = want[1].view(NB, H, D, BS)
    scale_k, scale_v = (0.5, 0.75) if cache_dtype != "auto" else (1.0, 1.0)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, BS)
        k = (key[i].float() / scale_k).to(cache.dtype) if cache_dtype != "auto" else key[i]
        v = (value[i].float() / scale_v).to(cache.dtype) if cache_dtype != "auto" else value[i]
        k5[b, :, :, o, :] = k.reshape(H, D // x, x)
        v4[b, :, :, o] = v
    return want


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_the_layers_geometry_is_written_bit_exact(cache_dtype: str, path: str) -> None:
    device = "cpu" if path == "torch" else _triton_device()
    layer, cache = _layer(cache_dtype, device)
    writer = layer.kv_cache_writer
    assert isinstance(writer, LegacyPagedKVCacheWriter)
    assert (writer.num_kv_heads, writer.head_size) == (H, D)
    key, value, slots = _inputs(23, H, D, device, seed=1)
    want = _expected(cache, key, value, slots, cache_dtype)
    writer.write(key, value, cache, slots, layer.kv_quant, path=path)  # type: ignore[call-arg]
    assert torch.equal(raw_bytes(cache), raw_bytes(want))  # also: nothing else changed


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize(("heads", "size"), [(2, 32), (1, 128), (4, 64), (4, 16)],
                         ids=["half_head_size", "one_wide_head", "twice_the_heads",
                              "four_small_heads"])
def test_a_key_of_another_geometry_is_rejected_before_writing(
        heads: int, size: int, path: str) -> None:
    device = "cpu" if path == "torch" else _triton_device()
    layer, cache = _layer("auto", device)
    key, value, slots = _inputs(9, heads, size, device, seed=2)
    assert cache.shape[2] % (heads * size) == 0  # the cache alone cannot tell
    before = raw_bytes(cache).clone()
    with pytest.raises(KVCacheWriteError) as info:
        layer.kv_cache_writer.write(key, value, cache, slots, layer.kv_quant,
                                    path=path)  # type: ignore[call-arg]
    message = str(info.value)
    assert f"key.shape: got {tuple(key.shape)}" in message
    assert f"num_kv_heads={H}, head_size={D}" in message
    assert torch.equal(raw_bytes(cache), before)


def test_the_layers_forward_rejects_another_geometry_and_writes_nothing() -> None:
    layer, cache = _layer("auto", "cpu")
    batch = make_paged_batch([5, 1], [0, 20], block_size=BS)
    meta = RocmAttentionBackend.get_builder_cls()(layer.spec, torch.device("cpu")).build(
        batch.common)
    n = batch.common.num_actual_tokens
    query = torch.randn(n, 2 * H, D).bfloat16()
    key, value, _ = _inputs(n, H // 2, 2 * D, "cpu", seed=4)
    before = raw_bytes(cache).clone()
    with set_forward_context(attn_metadata={layer.layer_name: meta},
                             slot_mapping={layer.layer_name: batch.new_slots}):
        with pytest.raises(KVCacheWriteError, match=r"key\.shape: got \(8, 1, 128\)"):
            layer(query, key, value)
    assert torch.equal(raw_bytes(cache), before)


def test_a_value_of_another_geometry_is_rejected_too() -> None:
    layer, cache = _layer("auto", "cpu")
    key, _, slots = _inputs(9, H, D, "cpu", seed=5)
    _, value, _ = _inputs(9, 1, 2 * D, "cpu", seed=6)
    before = raw_bytes(cache).clone()
    with pytest.raises(KVCacheWriteError, match=r"value\.shape: got \(11, 1, 128\)"):
        layer.kv_cache_writer.write(key, value, cache, slots, layer.kv_quant)
    assert torch.equal(raw_bytes(cache), before)


@pytest.mark.parametrize(("kwargs", "argument"), [
    (dict(num_kv_heads=2), "num_kv_heads/head_size"),
    (dict(num_kv_heads=0, head_size=64), "num_kv_heads"),
    (dict(num_kv_heads=2, head_size=True), "head_size"),
])
def test_a_bad_geometry_is_refused(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^{argument}: got "):
        LegacyPagedKVCacheWriter(**kwargs)  # type: ignore[arg-type]


def test_binding_needs_one_head_size_for_k_and_v() -> None:
    writer = LegacyPagedKVCacheWriter()
    with pytest.raises(InvalidArgumentError, match="head_size_v: got 32, expected head_size=64"):
        writer.bound_to(num_kv_heads=2, head_size=64, head_size_v=32)
    bound = writer.bound_to(num_kv_heads=2, head_size=64, head_size_v=64)
    assert repr(bound) == ("LegacyPagedKVCacheWriter(legacy_paged, num_kv_heads=2, "
                           "head_size=64)")
    assert bound.cache_dtypes == writer.cache_dtypes and writer.num_kv_heads is None
