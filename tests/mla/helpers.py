"""Small builders for the MLA tests (imported explicitly, not a conftest)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.backend import allocate_kv_cache
from vllm.attention.backends.mla.common import MLALayerSpec, MLAProjection
from vllm.attention.batch import PagedBatch, make_paged_batch
from vllm.attention.layer import MLAAttention
from vllm.attention.registry import get_backend

MLA_NAMES = (
    "FLASH_ATTN_MLA", "FLASHINFER_MLA", "FLASHMLA_SPARSE", "FLASHMLA", "ROCM_AITER_MLA",
    "ROCM_AITER_MLA_SPARSE", "CUTLASS_MLA", "TRITON_MLA",
)


@dataclass
class MLASetup:
    layer: MLAAttention
    spec: MLALayerSpec
    batch: PagedBatch
    cache: torch.Tensor
    q: torch.Tensor
    kv_c_new: torch.Tensor
    k_pe_new: torch.Tensor
    meta: Any


def make_spec(*, n: int = 2, L: int = 512, R: int = 64, P: int = 32, V: int = 32,
              dtype: torch.dtype = torch.float32, cache_dtype: str = "auto",
              seed: int = 0) -> MLALayerSpec:
    g = torch.Generator().manual_seed(seed)
    proj = MLAProjection(w_uk=(torch.randn(n, P, L, generator=g) * L ** -0.5).to(dtype),
                         w_uv=(torch.randn(n, L, V, generator=g) * L ** -0.5).to(dtype))
    return MLALayerSpec.create(num_heads=n, kv_lora_rank=L, qk_nope_head_dim=P,
                               qk_rope_head_dim=R, v_head_dim=V, projection=proj,
                               kv_cache_dtype=cache_dtype)  # type: ignore[arg-type]


def setup(backend_name: str, query_lens: list[int], context_lens: list[int], *,
          block_size: int, spec: MLALayerSpec, dtype: torch.dtype = torch.float32,
          seed: int = 0, k_scale: float | None = None) -> MLASetup:
    """A layer over a random-bytes cache whose context rows are already written."""
    backend = get_backend(backend_name)
    g = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(query_lens, context_lens, block_size=block_size, generator=g)
    layer = MLAAttention(spec=spec, backend=backend, layer_name="mla", k_scale=k_scale,
                         checked=True)
    cache = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=block_size,
                              num_kv_heads=1, head_size=spec.head_size,
                              cache_dtype=spec.kv_cache_dtype, model_dtype=dtype, device="cpu")
    raw = cache.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    layer.bind_kv_cache(cache, block_size)
    L, R = spec.kv_lora_rank, spec.qk_rope_head_dim
    n_ctx, n_new = int(batch.context_slots.numel()), int(batch.new_slots.numel())
    if n_ctx:
        layer.kv_cache_writer.write(torch.randn(n_ctx, L, generator=g).to(dtype),
                                    torch.randn(n_ctx, R, generator=g).to(dtype), cache,
                                    batch.context_slots, layer.kv_quant)
    q = torch.randn(n_new, spec.num_heads, spec.qk_head_dim, generator=g).to(dtype)
    meta = backend.get_builder_cls()(spec, torch.device("cpu")).build(batch.common)
    return MLASetup(layer, spec, batch, cache, q, torch.randn(n_new, L, generator=g).to(dtype),
                    torch.randn(n_new, R, generator=g).to(dtype), meta)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""The fp8 latent cache formats and their storage dtypes."""


def shuffled_block_table(seq_lens: list[int], page: int, g: torch.Generator, *,
                         spare: int = 1) -> tuple[torch.Tensor, int]:
    """A block table for requests of ``seq_lens`` tokens over ``nb`` shuffled blocks of
    ``page`` rows (``spare`` more than the requests need), and ``nb``: each request's
    pages take the next blocks of a random permutation; unused entries hold ``nb - 1``."""
    counts = [-(-s // page) for s in seq_lens]
    nb = sum(counts) + spare
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    bt = torch.full((len(seq_lens), max(counts)), nb - 1, dtype=torch.int32)
    at = 0
    for r, c in enumerate(counts):
        bt[r, :c] = perm[at: at + c]
        at += c
    return bt, nb


def filled_latent_cache(seq_lens: list[int], page: int, width: int, storage: torch.dtype,
                        g: torch.Generator, *, k_scale: float | None = None, spare: int = 1,
                        device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor,
                                                       list[tuple[int, int]]]:
    """A latent cache ``(nb, page, width)`` in ``storage`` over a shuffled block table
    (:func:`shuffled_block_table`) holding random rows for requests of ``seq_lens``
    tokens (divided by ``k_scale`` for an fp8 cache, so the stored values span its
    range), every other byte 0xFF (NaN in bf16, fp16, E4M3 and E5M2). Returns the cache,
    the block table (on ``device``) and one decode token ``(request, last position)`` a
    request."""
    bt, nb = shuffled_block_table(seq_lens, page, g, spare=spare)
    cache = torch.empty(nb, page, width, dtype=storage, device=device)
    cache.view(torch.uint8).fill_(0xFF)
    for r, n in enumerate(seq_lens):
        pos = torch.arange(n)
        rows = torch.randn(n, width, generator=g)
        if k_scale is not None:
            rows = rows / k_scale
        cache[bt[r, pos // page].long().to(device), (pos % page).to(device)] = \
            rows.to(storage).to(device)
    return cache, bt.to(device), [(r, n - 1) for r, n in enumerate(seq_lens)]


def latent_decode_reference(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                            tokens: list[tuple[int, int]], kv_lora_rank: int, scale: float,
                            k_scale: float | None) -> torch.Tensor:
    """float64 absorbed decode: ``softmax(scale q k^T) k[:, :L]`` for each token
    ``(request, position)`` over that request's positions ``0 .. position``.

    Args:
        q: ``[T, N, L + R]``; cache: ``(nb, bs, L + R)`` (fp8 dequantised by ``k_scale``).
    Returns:
        ``[T, N, L]`` float64, on ``q``'s device.
    """
    page = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float64,
                      device=q.device)
    table = block_table.long().to(cache.device)
    for i, (r, p) in enumerate(tokens):
        pos = torch.arange(p + 1, device=cache.device)
        keys = cache[table[r, pos // page], pos % page].double()
        if k_scale is not None:
            keys = keys * k_scale
        probs = torch.softmax(q[i].double() @ keys.t() * scale, dim=-1)
        out[i] = probs @ keys[:, :kv_lora_rank]
    return out


def e4m3_query(q: torch.Tensor) -> torch.Tensor:
    """The query as the fp8-MMA decode kernel multiplies it, in float64: each
    ``(token, head)`` row scaled by the power of two ``2**-e`` that puts its largest
    magnitude in ``[2**7, 2**8)``, rounded to E4M3 (to nearest, ties to even), and scaled
    back by ``2**e``."""
    amax = q.double().abs().amax(dim=-1, keepdim=True)
    _, x = torch.frexp(amax)  # amax = m * 2**x, m in [0.5, 1): floor(log2(amax)) = x - 1
    e = (x - 1 - 7).clamp(-100, 100).double()
    return (q.double() * torch.exp2(-e)).to(torch.float8_e4m3fn).double() * torch.exp2(e)
