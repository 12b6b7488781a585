"""TORCH_REF, the oracle: its writer against an independent decoder, its compute
against float64 attention written out longhand here."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import fill_random_bytes, raw, rel_err
from vllm.attention import KVQuant, allocate_kv_cache
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.batch import make_paged_batch
from vllm.attention.layer import Attention
from vllm.attention.types import AttentionType
from vllm.forward_context import set_forward_context

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _expected_row(x: torch.Tensor, cache_dtype: str, scale: torch.Tensor,
                  storage: torch.dtype) -> torch.Tensor:
    """One token's stored row, per head, with explicit per-element math."""
    if cache_dtype == "auto":
        return x.to(storage)
    limit = torch.finfo(storage).max
    out = torch.empty(x.shape, dtype=storage)
    for h in range(x.shape[0]):
        s = scale[h if scale.numel() > 1 else 0].item()
        y = x[h].float() / torch.tensor(s, dtype=torch.float32)
        out[h] = torch.clamp(y, -limit, limit).to(storage)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block_size", [1, 16, 24])
@pytest.mark.parametrize("per_head", [False, True], ids=["scale_tensor", "scale_per_head"])
def test_writer_bit_exact_and_touches_nothing_else(
    dtype: torch.dtype, cache_dtype: str, block_size: int, per_head: bool
) -> None:
    g = torch.Generator().manual_seed(hash((str(dtype), cache_dtype, block_size, per_head)) % 2**31)
    nb, h, d = 4, 3, 8
    cache = allocate_kv_cache(TorchRefBackend, num_blocks=nb, block_size=block_size,
                              num_kv_heads=h, head_size=d, cache_dtype=cache_dtype,
                              model_dtype=dtype, device="cpu")
    fill_random_bytes(cache, 1)
    before = raw(cache).clone()
    n = min(nb * block_size, 11)
    slots = torch.randperm(nb * block_size, generator=g)[:n]
    slots[::3] = -1
    key = (torch.randn(n + 2, h, d, generator=g) * 30).to(dtype)  # some overflow fp8 e4m3
    value = torch.randn(n + 2, h, d, generator=g).to(dtype)
    scales = torch.rand(h if per_head else 1, generator=g) + 0.5
    quant = KVQuant(cache_dtype, scales, scales * 2)  # type: ignore[arg-type]
    TorchRefBackend.get_kv_cache_writer(cache_dtype).write(key, value, cache, slots, quant)  # type: ignore[arg-type]
    touched = torch.zeros(nb, 2, block_size, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        touched[b, :, o] = True
        for kv, x, sc in ((0, key[i], quant.k_scale), (1, value[i], quant.v_scale)):
            want = _expected_row(x, cache_dtype, sc, cache.dtype)
            assert torch.equal(cache[b, kv, o].view(torch.uint8), want.view(torch.uint8))
    now = raw(cache).view(nb, 2, block_size, -1)
    was = before.view(nb, 2, block_size, -1)
    byte_mask = (~touched).unsqueeze(-1).expand_as(now)
    assert torch.equal(now[byte_mask], was[byte_mask]), "bytes outside the written slots changed"


def _dense_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               causal: bool, window: int | None, cap: float | None) -> torch.Tensor:
    """float64 attention, one loop per query and head (independent of ops.reference)."""
    tq, hq, _ = q.shape
    tk, hk, dv = v.shape
    out = torch.zeros(tq, hq, dv, dtype=torch.float64)
    for j in range(tq):
        pos = tk - tq + j
        for hh in range(hq):
            kh = hh // (hq // hk)
            logits = []
            for t in range(tk):
                if (causal and t > pos) or (window is not None and pos - t >= window):
                    logits.append(-math.inf)
                    continue
                s = float(q[j, hh].double() @ k[t, kh].double()) * scale
                logits.append(cap * math.tanh(s / cap) if cap else s)
            w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
            out[j, hh] = (w.unsqueeze(1) * v[:, kh].double()).sum(0)
    return out


CASES = {
    "prefill": ([9, 17], [0, 0]),
    "decode": ([1, 1, 1], [15, 33, 4]),
    "mixed": ([12, 1, 3], [0, 20, 16]),
    "chunked_prefill": ([8, 5], [16, 9]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (8, 2)], ids=["mha", "mqa", "gqa4"])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "encoder"])
def test_compute_matches_float64(case: str, heads: tuple[int, int], variant: str) -> None:
    g = torch.Generator().manual_seed(7)
    qlens, clens = CASES[case]
    attn_type = AttentionType.ENCODER if variant == "encoder" else AttentionType.DECODER
    if variant == "encoder":
        clens = [0] * len(qlens)
    bs, d = 8, 16
    nh, nkv = heads
    batch = make_paged_batch(qlens, clens, block_size=bs, generator=g,
                             causal=attn_type is AttentionType.DECODER)
    layer = Attention(num_heads=nh, num_kv_heads=nkv, head_size=d, scale=d ** -0.5,
                      backend=TorchRefBackend, layer_name="l0", attn_type=attn_type,
                      sliding_window=5 if variant == "window" else None,
                      logits_soft_cap=2.0 if variant == "softcap" else None)
    cache = allocate_kv_cache(TorchRefBackend, num_blocks=batch.num_blocks, block_size=bs,
                              num_kv_heads=nkv, head_size=d, model_dtype=torch.float32,
                              device="cpu")
    fill_random_bytes(cache, 3)
    layer.bind_kv_cache(cache, bs)
    total = [c + q for c, q in zip(clens, qlens)]
    ks = [torch.randn(t, nkv, d, generator=g) for t in total]
    vs = [torch.randn(t, nkv, d, generator=g) for t in total]
    qs = [torch.randn(q, nh, d, generator=g) for q in qlens]
    meta = TorchRefBackend.get_builder_cls()(layer.spec, torch.device("cpu")).build(batch.common)
    if sum(clens):
        k_ctx = torch.cat([k[:c] for k, c in zip(ks, clens)])
        v_ctx = torch.cat([v[:c] for v, c in zip(vs, clens)])
        layer.kv_cache_writer.write(k_ctx, v_ctx, cache, batch.context_slots, layer.kv_quant)
    k_new = torch.cat([k[c:] for k, c in zip(ks, clens)])
    v_new = torch.cat([v[c:] for v, c in zip(vs, clens)])
    with set_forward_context(attn_metadata={"l0": meta}, slot_mapping={"l0": batch.new_slots}):
        out = layer(torch.cat(qs), k_new, v_new)
    at = 0
    for q, k, v in zip(qs, ks, vs):
        ref = _dense_ref(q, k, v, scale=d ** -0.5, causal=attn_type is AttentionType.DECODER,
                         window=layer.spec.sliding_window, cap=layer.spec.logits_soft_cap)
        assert rel_err(out[at: at + q.shape[0]], ref) < 1e-5
        at += q.shape[0]
