"""Triton MLA attention over the latent cache: dense decode and sparse top-k.

Dense decode runs the tensor-core kernel of :mod:`vllm.attention.ops.triton_mla_decode`
wherever it applies (native 16-bit and float32 caches, scaled fp8). The per-row
kernel here serves the sparse top-k path and the ``fp8_ds_mla`` entry (one kernel,
``IS_SPARSE``): each program takes one query token, a block of 16 heads and one
split of that token's keys, runs an online softmax over the latent rows and writes
a partial output and its log-sum-exp; a second kernel merges the splits. Cache
formats are dequantised in the kernel: native float, scaled fp8 (read as bytes and
bit-cast), and the 656-byte ``fp8_ds_mla`` entry (E4M3 latent times its 128-wide
tile scale, 16-bit rope). Triton is imported on first use only.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.layouts import FP8_DS_MLA_TILE
from vllm.attention.ops.mla_attention import LatentFormat
from vllm.attention.ops.triton_loader import interpreting
from vllm.attention.writers.kernels.device import hardware_fp8, next_pow2

_NATIVE, _FP8, _FP8_DS = 0, 1, 2
_BLOCK_N = 16


_interpreting = interpreting
"""(A module attribute of its own, so that tests can stand it in for a GPU run.)"""


def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The split and combine kernels, compiled or for the CPU interpreter."""
    from vllm.attention.ops.triton_loader import load_kernel_module

    k = load_kernel_module("vllm.attention.ops.triton_mla_kernels", interpret=interpret)
    return k.mla_split_kernel, k.mla_combine_kernel


def _cache_views(kv_cache: torch.Tensor, fmt: LatentFormat) -> tuple[int, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor]:
    """(format code, primary view, float32 scale view, 16-bit rope view)."""
    if kv_cache.stride(2) != 1:
        raise InvalidArgumentError("kv_cache.stride", tuple(kv_cache.stride()),
                                   "a unit stride on the last axis")
    if fmt.cache_dtype == "fp8_ds_mla":
        return _FP8_DS, kv_cache, kv_cache.view(torch.float32), kv_cache.view(fmt.rope_dtype)
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raw = kv_cache.view(torch.uint8)
        return _FP8, raw, raw, raw
    return _NATIVE, kv_cache, kv_cache, kv_cache


def default_num_splits(num_keys: int, num_tokens: int) -> int:
    """Enough splits to keep a long context from serialising in one program."""
    if num_tokens >= 64:
        return max(1, min(4, -(-num_keys // 1024)))
    return max(1, min(32, -(-num_keys // 256)))


def _launch(q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            token_req: torch.Tensor, token_pos: torch.Tensor, topk: torch.Tensor | None,
            fmt: LatentFormat, scale: float, num_keys: int,
            num_splits: int | None) -> torch.Tensor:
    interp = _interpreting()
    split_kernel, combine_kernel = _kernels(interp)
    t, n, d = q_lat.shape
    L, R = fmt.kv_lora_rank, fmt.rope_dim
    if d != L + R:
        raise InvalidArgumentError("q_lat.shape", tuple(q_lat.shape), f"[T, N, {L + R}]")
    out = torch.empty(t, n, L, dtype=torch.float32, device=q_lat.device)
    if t == 0:
        return out
    q = q_lat if q_lat.stride(2) == 1 else q_lat.contiguous()
    code, c, c_scale, c_rope = _cache_views(kv_cache, fmt)
    splits = num_splits or default_num_splits(num_keys, t)
    o_part = torch.empty(t, n, splits, L, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(t, n, splits, dtype=torch.float32, device=q.device)
    bt = block_table.to(torch.int32)
    req = token_req.to(torch.int32)
    pos = token_pos.to(torch.int32)
    idx = req if topk is None else topk
    block_h = 16 if n >= 16 else max(1, next_pow2(n))
    block_h = max(block_h, 16) if q.is_cuda else block_h
    # the interpreter mis-multiplies bfloat16 dots; there they run in float32
    half = q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and not interp)
    grid = (t, -(-n // block_h), splits)
    split_kernel[grid](
        q, c, c_scale, c_rope, bt, req, pos, idx, fmt.k_scale.to(q.device), o_part, lse_part,
        q.stride(0), q.stride(1), c.stride(0), c.stride(1), bt.stride(0), idx.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1),
        n, topk.shape[1] if topk is not None else 0, scale, splits,
        KV_LORA=L, ROPE=R, PAGE=kv_cache.shape[1], TILE=FP8_DS_MLA_TILE,
        FORMAT=code, FP8_E5M2=kv_cache.dtype == torch.float8_e5m2,
        HW_FP8=hardware_fp8(q.device), IS_SPARSE=topk is not None,
        HALF_DOT=half, DYNAMIC_LOOP=not interp,
        MAX_ITERS=-(-(-(-num_keys // splits)) // _BLOCK_N) + 1 if interp else 0,
        BLOCK_H=block_h, BLOCK_N=_BLOCK_N, BLOCK_L=next_pow2(L), BLOCK_R=next_pow2(R),
    )
    combine_kernel[(t, n)](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), out.stride(1), splits,
        # one compiled variant for every split count up to 32
        KV_LORA=L, BLOCK_S=max(32, next_pow2(splits)), BLOCK_L=next_pow2(L),
    )
    return out


def mla_decode_triton(q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      token_req: torch.Tensor, token_pos: torch.Tensor, fmt: LatentFormat, *,
                      scale: float, max_seq_len: int, num_splits: int | None = None,
                      out_dtype: torch.dtype = torch.float32,
                      q_pe: torch.Tensor | None = None, fp8_mma: bool = False) -> torch.Tensor:
    """Dense absorbed decode, causal: the tensor-core kernel where it applies, else
    (``fp8_ds_mla``) the per-row kernel.

    Args:
        q_lat: ``[Td, N, L + R]`` (model dtype), or ``[Td, N, L]`` with ``q_pe``
            ``[Td, N, R]`` (strided views taken as they are by the tensor-core kernel).
        kv_cache: ``(nb, bs, L + R)`` or ``(nb, bs, 656)`` uint8.
        block_table: ``[num_reqs, max_blocks]`` int32.
        token_req / token_pos: ``[Td]`` int32; token ``i`` sees positions ``0..token_pos[i]``
            of request ``token_req[i]``.
        max_seq_len: the longest context (sizes the split).
        out_dtype: the result's dtype.
        fp8_mma: with an E4M3 cache, on sm_90, the fp8-MMA kernel (the query and the
            probabilities rounded to E4M3: ``MLADecodeConfig.fp8_mma``).
    Returns:
        ``[Td, N, L]`` in ``out_dtype``.
    """
    from vllm.attention.ops.triton_mla_decode import mla_decode_mma, unsupported_reasons

    if not unsupported_reasons(fmt, q_lat.dtype):
        return mla_decode_mma(q_lat, kv_cache, block_table, token_req, token_pos, fmt,
                              scale=scale, max_seq_len=max_seq_len, num_splits=num_splits,
                              out_dtype=out_dtype, q_pe=q_pe, fp8_mma=fp8_mma)
    if q_pe is not None:
        q_lat = torch.cat([q_lat, q_pe], dim=-1)
    return mla_decode_per_row(q_lat, kv_cache, block_table, token_req, token_pos, fmt,
                              scale=scale, max_seq_len=max_seq_len,
                              num_splits=num_splits).to(out_dtype)


def mla_decode_per_row(q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       token_req: torch.Tensor, token_pos: torch.Tensor, fmt: LatentFormat, *,
                       scale: float, max_seq_len: int,
                       num_splits: int | None = None) -> torch.Tensor:
    """Dense absorbed decode on the per-row kernel (16 heads a program, every cache
    format): the ``fp8_ds_mla`` path of :func:`mla_decode_triton`, and the baseline
    ``benchmarks/bench_mla_decode.py`` reports. Arguments as there; returns
    ``[Td, N, L]`` float32."""
    return _launch(q_lat, kv_cache, block_table, token_req, token_pos, None, fmt, scale,
                   max_seq_len, num_splits)


def mla_sparse_triton(q_lat: torch.Tensor, kv_cache: torch.Tensor, topk: torch.Tensor,
                      token_req: torch.Tensor, token_pos: torch.Tensor,
                      block_table: torch.Tensor, fmt: LatentFormat, *, scale: float,
                      num_splits: int | None = None) -> torch.Tensor:
    """Absorbed attention of each token over its top-k positions only.

    Args:
        topk: ``[T, K]`` int32 positions within the token's request; ``-1`` pads and a
            position past the token's own is ignored (causal).
    Returns:
        ``[T, N, L]`` float32 (zeros for a token with no valid position).
    """
    t = q_lat.shape[0]
    return _launch(q_lat, kv_cache, block_table, token_req[:t], token_pos[:t],
                   topk[:t].to(torch.int32), fmt, scale, int(topk.shape[1]), num_splits)
