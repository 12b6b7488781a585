"""The tensor-core MLA decode on a GPU (skipped without CUDA): DeepSeek-V3's shape
(latent 512 + rope 64, page 64) at 16 and 128 heads, bf16 and fp8 caches, against a
float64 reference; requests of different lengths (one key, a page multiple, not),
NaN in every slot no request owns, one split and many, each launch variant; and the
layer (write, then compute) replayed from a CUDA graph with padded query rows."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.mla.helpers import (
    FP8_CACHE_DTYPES,
    filled_latent_cache,
    latent_decode_reference,
    make_spec,
)
from vllm.attention.registry import get_backend

pytestmark = pytest.mark.gpu

L, R, PAGE = 512, 64, 64
SEQ_LENS = [4096, 1, 4095, 65, 64, 3001, 129, 2048]
TOL = get_backend("TRITON_MLA").tolerances[torch.bfloat16]


def _inputs(heads: int, cache_dtype: str, seed: int = 0) -> dict[str, Any]:
    from vllm.attention.ops.mla_attention import LatentFormat

    g = torch.Generator().manual_seed(seed)
    k_scale = 0.37
    storage = FP8_CACHE_DTYPES.get(cache_dtype, torch.bfloat16)
    cache, bt, tokens = filled_latent_cache(
        SEQ_LENS, PAGE, L + R, storage, g, spare=3,
        k_scale=k_scale if cache_dtype in FP8_CACHE_DTYPES else None)
    fmt = LatentFormat(cache_dtype, L, R, torch.tensor([k_scale], device="cuda"),  # type: ignore[arg-type]
                       torch.bfloat16)
    q = torch.randn(len(tokens), heads, L + R, generator=g).bfloat16().cuda()
    return dict(fmt=fmt, cache=cache, bt=bt, tokens=tokens, q=q,
                req=torch.tensor([r for r, _ in tokens], dtype=torch.int32, device="cuda"),
                pos=torch.tensor([p for _, p in tokens], dtype=torch.int32, device="cuda"),
                k_scale=k_scale if cache_dtype in FP8_CACHE_DTYPES else None)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("splits", [None, 1, 13, 64], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [16, 128])
def test_deepseek_shape_against_float64(heads: int, cache_dtype: str,
                                        splits: int | None) -> None:
    from vllm.attention.ops.triton_mla_decode import mla_decode_mma

    x = _inputs(heads, cache_dtype)
    before = x["cache"].view(torch.uint8).clone()
    scale = 192 ** -0.5
    out = mla_decode_mma(x["q"], x["cache"], x["bt"], x["req"], x["pos"], x["fmt"],
                         scale=scale, max_seq_len=max(SEQ_LENS), num_splits=splits,
                         out_dtype=torch.bfloat16)
    ref = latent_decode_reference(x["q"], x["cache"], x["bt"], x["tokens"], L, scale,
                                  x["k_scale"])
    assert torch.equal(x["cache"].view(torch.uint8), before)
    assert torch.isfinite(out).all()
    assert _err(out, ref) < TOL


VARIANTS = {  # name: MLADecodeConfig arguments
    "bh64-bn64-w8-s2-1chunk-split": dict(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                         latent_chunks=1, split_scores=True),
    "bh64-bn64-w8-s2-split": dict(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                  split_scores=True),
    "bh64-bn64-w8-s2-1chunk": dict(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                   latent_chunks=1),
    "bh64-bn64-w8-s2-1chunk-split-nofp16": dict(block_h=64, block_n=64, num_warps=8,
                                                num_stages=2, latent_chunks=1,
                                                split_scores=True, fp8_fp16_dot=False),
    "bh64-bn64-w8-s2": dict(block_h=64, block_n=64, num_warps=8, num_stages=2),
    "bh64-bn32-w8-s2": dict(block_h=64, block_n=32, num_warps=8, num_stages=2),
    "bh64-bn64-w8-s2-notma": dict(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                  tma=False),
    "bh64-bn64-w4-s2-vsplit": dict(block_h=64, block_n=64, num_warps=4, num_stages=2,
                                   v_split=2),
    "bh64-bn128-w8-s1": dict(block_h=64, block_n=128, num_warps=8, num_stages=1),
    "bh64-bn16-w4-s2-vsplit": dict(block_h=64, block_n=16, num_warps=4, num_stages=2,
                                   v_split=2),
    "bh16-bn16-w4-s2": dict(block_h=16, block_n=16, num_warps=4, num_stages=2),
}


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_launch_variants(name: str, cache_dtype: str) -> None:
    from vllm.attention.ops.triton_mla_decode import MLADecodeConfig, mla_decode_mma

    x = _inputs(128, cache_dtype, seed=1)
    cfg = MLADecodeConfig(**VARIANTS[name])
    out = mla_decode_mma(x["q"], x["cache"], x["bt"], x["req"], x["pos"], x["fmt"], scale=0.07,
                         max_seq_len=max(SEQ_LENS), config=cfg, num_splits=5)
    ref = latent_decode_reference(x["q"], x["cache"], x["bt"], x["tokens"], L, 0.07,
                                  x["k_scale"])
    assert _err(out, ref) < TOL


@pytest.mark.parametrize("magnitude", [1e-4, 1e6])
def test_fp8_float16_dots_take_any_query_magnitude(magnitude: float) -> None:
    """fp8 cache, bfloat16 model: the dots run in float16 with the query scaled a head
    by a power of two, so queries past float16's 65504 (or deep in its subnormals) give
    the result a float64 reference gives."""
    from vllm.attention.ops.triton_mla_decode import mla_decode_mma

    x = _inputs(128, "fp8", seed=4)
    q = (x["q"].double() * magnitude).bfloat16()
    scale = 192 ** -0.5 / magnitude
    out = mla_decode_mma(q, x["cache"], x["bt"], x["req"], x["pos"], x["fmt"], scale=scale,
                         max_seq_len=max(SEQ_LENS), out_dtype=torch.bfloat16)
    ref = latent_decode_reference(q, x["cache"], x["bt"], x["tokens"], L, scale,
                                  x["k_scale"])
    assert torch.isfinite(out).all()
    assert _err(out, ref) < TOL


# a column in each part a widening warpgroup converts apart (the latent's four chunks of
# 128, the rope)
@pytest.mark.parametrize("col", [7, 200, 300, 450, 540])
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [16, 128])
def test_hardware_fp8_nan_reaches_the_output(heads: int, cache_dtype: str, col: int) -> None:
    from vllm.attention.ops.triton_mla_decode import mla_decode_mma

    x = _inputs(heads, cache_dtype, seed=2)
    r, p = x["tokens"][0]
    page_of = x["bt"][r, p // PAGE].long()
    # 0x7F: NaN in E4M3 and in E5M2, in one of token 0's keys
    x["cache"].view(torch.uint8)[page_of, p % PAGE, col] = 0x7F
    out = mla_decode_mma(x["q"], x["cache"], x["bt"], x["req"], x["pos"], x["fmt"], scale=0.1,
                         max_seq_len=max(SEQ_LENS))
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1:]).all()


@pytest.mark.parametrize("cache_dtype, fp8_mma", [("auto", False), ("fp8", False), ("fp8", True),
                                                  ("fp8", None)],
                         ids=["auto", "fp8", "fp8-mma", "fp8-default"])
@pytest.mark.parametrize("n", [128, 16], ids=lambda n: f"{n}heads")
@pytest.mark.parametrize("name", ["TRITON_MLA", "FLASHMLA"])
def test_layer_decode_in_a_cuda_graph(name: str, n: int, cache_dtype: str,
                                      fp8_mma: bool | None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Write then compute through MLAAttention, eager and replayed from a CUDA graph;
    the decode runs the tensor-core kernel (at 16 heads the few-heads one; ``fp8_mma``:
    the fp8-MMA one; None: the backend's choice, the fp8-MMA kernel for FLASHMLA at 128
    heads, bit for bit what asking for it gives), rows past the step's tokens are left
    alone, and the result is within tolerance of the float32 torch path."""
    from vllm.attention import allocate_kv_cache
    from vllm.attention.batch import make_paged_batch
    from vllm.attention.layer import MLAAttention
    from vllm.forward_context import set_forward_context

    backend = get_backend(name)
    g = torch.Generator().manual_seed(3)
    p, v = 128, 128
    spec = make_spec(n=n, P=p, V=v, dtype=torch.bfloat16, cache_dtype=cache_dtype)
    spec = type(spec).create(num_heads=n, kv_lora_rank=L, qk_nope_head_dim=p,
                             qk_rope_head_dim=R, v_head_dim=v, kv_cache_dtype=spec.kv_cache_dtype,
                             projection=type(spec.projection)(
                                 w_uk=spec.projection.w_uk.cuda(),
                                 w_uv=spec.projection.w_uv.cuda()))
    ctx = [4000, 0, 63, 1500]
    batch = make_paged_batch([1] * len(ctx), ctx, block_size=PAGE, device="cuda", generator=g)
    layer = MLAAttention(spec=spec, backend=backend, layer_name="mla",
                         k_scale=0.5 if cache_dtype == "fp8" else None, checked=False)
    cache = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=PAGE,
                              num_kv_heads=1, head_size=L + R, cache_dtype=cache_dtype,
                              model_dtype=torch.bfloat16, device="cuda")
    layer.bind_kv_cache(cache, PAGE)
    if fp8_mma is None:
        monkeypatch.delenv("VLLM_MLA_FP8_MMA", raising=False)
        layer.impl.fp8_mma = None  # type: ignore[attr-defined]
        uses8 = layer.impl.uses_fp8_mma()  # type: ignore[attr-defined]
        assert uses8 is (name == "FLASHMLA" and n == 128)
    else:
        layer.impl.fp8_mma = fp8_mma  # type: ignore[attr-defined]
        uses8 = fp8_mma
    if uses8:
        from vllm.attention.ops import triton_mla_decode as tmd

        gpu = tmd.gpu_of(cache.device)
        cfg = dataclasses.replace(tmd.default_config(torch.bfloat16, gpu), fp8_mma=True)
        if not tmd.takes_fp8_mma(cfg, torch.bfloat16, cache, L, R, gpu, scale=spec.scale):
            pytest.skip("the fp8-MMA kernel runs on NVIDIA sm_90 only")
    bf = dict(dtype=torch.bfloat16, device="cuda")
    n_ctx = int(batch.context_slots.numel())
    layer.kv_cache_writer.write(torch.randn(n_ctx, L, **bf), torch.randn(n_ctx, R, **bf), cache,
                                batch.context_slots, layer.kv_quant)
    meta = backend.get_builder_cls()(spec, torch.device("cuda")).build(batch.common)
    t, pad = len(ctx), 3
    q = torch.randn(t + pad, n, p + R, **bf)
    kv_c, k_pe = torch.randn(t + pad, L, **bf), torch.randn(t + pad, R, **bf)
    out = torch.full((t + pad, n * v), 7.0, **bf)
    with set_forward_context(attn_metadata={"mla": meta}, slot_mapping={"mla": batch.new_slots}):
        layer(q, kv_c, k_pe, out)
        eager = out.clone()
        assert "triton" in str(layer.impl.last_path)  # type: ignore[attr-defined]
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(q, kv_c, k_pe, out)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            layer(q, kv_c, k_pe, out)
        out.fill_(7.0)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        layer.impl.force_path = "torch"  # type: ignore[attr-defined]
        layer(q, kv_c, k_pe, out)
        ref = out.clone()
    # the decode rows are one slice here (read and written in place); gathered and
    # scattered, the same numbers
    assert meta.decode_rows == slice(0, t)
    with set_forward_context(attn_metadata={"mla": dataclasses.replace(meta, decode_rows=None)},
                             slot_mapping={"mla": batch.new_slots}):
        layer.impl.force_path = None  # type: ignore[attr-defined]
        out.fill_(7.0)
        layer(q, kv_c, k_pe, out)
        scattered = out.clone()
    assert torch.equal(scattered, eager)
    assert torch.all(eager[t:] == 7.0) and torch.all(replayed[t:] == 7.0)
    assert _err(replayed[:t].float(), eager[:t].double()) < 1e-3
    if fp8_mma is None and uses8:  # the backend's choice is the kernel asked for by name
        layer.impl.fp8_mma = True  # type: ignore[attr-defined]
        with set_forward_context(attn_metadata={"mla": meta},
                                 slot_mapping={"mla": batch.new_slots}):
            out.fill_(7.0)
            layer(q, kv_c, k_pe, out)
        assert torch.equal(out, eager)
    if uses8:
        from vllm.attention.ops.triton_mla_decode import FP8_MMA_TOLERANCE

        assert _err(eager[:t].float(), ref[:t].double()) < FP8_MMA_TOLERANCE
    else:
        assert _err(eager[:t].float(), ref[:t].double()) < TOL
