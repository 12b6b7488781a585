"""Torch MLA compute over the latent cache: the CPU path and the last CUDA fallback.

Shapes (``docs/mla.md``): ``N`` query heads, ``L`` kv_lora_rank, ``R`` rope dim,
``P`` qk_nope_head_dim, ``V`` v_head_dim. The cache holds one ``[L + R]`` row per
token (``(nb, bs, L + R)``, or the 656-byte ``fp8_ds_mla`` entry). Everything is
computed in float32 and nothing here writes the cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.layouts import (
    FP8_DS_MLA_ENTRY_BYTES,
    FP8_DS_MLA_LATENT,
    FP8_DS_MLA_ROPE,
    FP8_DS_MLA_TILE,
)
from vllm.attention.types import KVCacheDType, is_fp8_scaled

FP8_DS_MLA_SCALE_OFFSET = FP8_DS_MLA_LATENT
FP8_DS_MLA_ROPE_OFFSET = FP8_DS_MLA_LATENT + 4 * (FP8_DS_MLA_LATENT // FP8_DS_MLA_TILE)


@dataclass(frozen=True)
class LatentFormat:
    """How one cache row encodes ``[kv_c_normed (L), k_pe (R)]``.

    ``k_scale``: float32 ``[1]``, the per-tensor scale of the ``fp8*`` formats.
    ``rope_dtype``: the 16-bit dtype of the rope bytes of ``fp8_ds_mla`` (the model dtype).
    """

    cache_dtype: KVCacheDType
    kv_lora_rank: int
    rope_dim: int
    k_scale: torch.Tensor
    rope_dtype: torch.dtype

    @property
    def entry_size(self) -> int:
        """Elements (bytes for ``fp8_ds_mla``) of one cache row."""
        if self.cache_dtype == "fp8_ds_mla":
            return FP8_DS_MLA_ENTRY_BYTES
        return self.kv_lora_rank + self.rope_dim


def decode_latent_rows(rows: torch.Tensor, fmt: LatentFormat,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows ``[..., entry]`` as ``dtype`` ``[..., L + R]`` (dequantised)."""
    if fmt.cache_dtype == "fp8_ds_mla":
        lead = rows.shape[:-1]
        flat = rows.reshape(-1, FP8_DS_MLA_ENTRY_BYTES)
        latent = flat[:, :FP8_DS_MLA_LATENT].contiguous().view(torch.float8_e4m3fn)
        scales = flat[:, FP8_DS_MLA_SCALE_OFFSET:FP8_DS_MLA_ROPE_OFFSET].contiguous()
        scales = scales.view(torch.float32).repeat_interleave(FP8_DS_MLA_TILE, dim=1)
        rope = flat[:, FP8_DS_MLA_ROPE_OFFSET:].contiguous().view(fmt.rope_dtype)
        out = torch.cat([latent.to(dtype) * scales.to(dtype), rope.to(dtype)], dim=1)
        return out.view(*lead, FP8_DS_MLA_LATENT + FP8_DS_MLA_ROPE)
    if is_fp8_scaled(fmt.cache_dtype):
        return rows.to(dtype) * fmt.k_scale.to(device=rows.device, dtype=dtype)[0]
    return rows.to(dtype)


def gather_latent(kv_cache: torch.Tensor, block_ids: torch.Tensor, start: int,
                  stop: int) -> torch.Tensor:
    """Raw cache rows of positions ``start..stop-1`` of one request.

    Args:
        kv_cache: ``(nb, bs, entry)``.
        block_ids: ``[max_blocks]`` int32, the request's block-table row.
    Returns:
        ``[stop - start, entry]`` in the cache's dtype.
    """
    bs = kv_cache.shape[1]
    pos = torch.arange(start, stop, device=kv_cache.device)
    blocks = block_ids.to(kv_cache.device).long()[pos // bs]
    return kv_cache[blocks, pos % bs]


def _softmax_with_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax and log-sum-exp of ``[..., S]`` float32 scores; all-masked rows give
    zero weights and ``lse = -inf``."""
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return probs, lse


def merge_attn_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial outputs over disjoint key sets.

    ``o_*``: ``[..., D]`` float32; ``lse_*``: ``[...]`` (``-inf`` = saw no key).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return o_a * w_a + o_b * w_b, lse


def latent_attention(q_lat: torch.Tensor, keys: torch.Tensor, *, kv_lora_rank: int,
                     scale: float,
                     visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of queries over latent rows (MQA: one key head).

    Args:
        q_lat: ``[Tq, N, L + R]`` (``q_nope @ W_UK`` then ``q_pe``), float32 or float64.
        keys: ``[S, L + R]`` latent rows in ``q_lat``'s dtype; values are ``keys[:, :L]``.
        visible: ``[Tq, S]`` bool, or None for all visible.
    Returns:
        ``o_lat`` ``[Tq, N, L]`` and ``lse`` ``[Tq, N]``.
    """
    tq, n, d = q_lat.shape
    scores = (q_lat.reshape(tq * n, d) @ keys.t()).view(tq, n, -1) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible.unsqueeze(1), -math.inf)
    probs, lse = _softmax_with_lse(scores)
    o = probs.view(tq * n, -1) @ keys[:, :kv_lora_rank]
    return o.view(tq, n, kv_lora_rank), lse


@dataclass(frozen=True)
class DecodeGroup:
    """The absorbed-path tokens of one request: rows ``rows`` of the decode batch,
    which are the last positions of its ``seq_len`` keys."""

    req: int
    seq_len: int
    rows: slice


def mla_decode_torch(q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     groups: Sequence[DecodeGroup], fmt: LatentFormat, *,
                     scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense absorbed attention over each request's cached latents, causal.

    Args:
        q_lat: ``[Td, N, L + R]`` (any float dtype), grouped by request.
        block_table: ``[num_reqs, max_blocks]`` int32.
        dtype: the arithmetic (float64 gives the reference the kernels are held to).
    Returns:
        ``[Td, N, L]`` in ``dtype``.
    """
    td, n, _ = q_lat.shape
    out = torch.zeros(td, n, fmt.kv_lora_rank, dtype=dtype, device=q_lat.device)
    for g in groups:
        tq = g.rows.stop - g.rows.start
        if tq == 0:
            continue
        keys = decode_latent_rows(gather_latent(kv_cache, block_table[g.req], 0, g.seq_len), fmt,
                                  dtype)
        pos = torch.arange(g.seq_len - tq, g.seq_len, device=keys.device).unsqueeze(1)
        visible = torch.arange(g.seq_len, device=keys.device).unsqueeze(0) <= pos
        o, _ = latent_attention(q_lat[g.rows].to(dtype), keys,
                                kv_lora_rank=fmt.kv_lora_rank, scale=scale, visible=visible)
        out[g.rows] = o
    return out


def sparse_positions_to_slots(topk: torch.Tensor, token_req: torch.Tensor,
                              token_pos: torch.Tensor, block_table: torch.Tensor,
                              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of per-query top-k positions.

    Args:
        topk: ``[T, K]`` int32 positions within each query's request (-1 = none).
        token_req / token_pos: ``[T]`` int32, each query's request and position.
    Returns:
        ``slots`` ``[T, K]`` int64 (0 where invalid) and ``valid`` ``[T, K]`` bool:
        a position is attended iff ``0 <= p <= token_pos`` (causal).
    """
    pos = topk.long()
    valid = (pos >= 0) & (pos <= token_pos.long().unsqueeze(1))
    safe = torch.where(valid, pos, torch.zeros_like(pos))
    rows = block_table.long()[token_req.long()]
    blocks = torch.gather(rows, 1, safe // block_size)
    slots = torch.where(valid, blocks * block_size + safe % block_size, torch.zeros_like(safe))
    return slots, valid


def mla_sparse_torch(q_lat: torch.Tensor, kv_cache: torch.Tensor, topk: torch.Tensor,
                     token_req: torch.Tensor, token_pos: torch.Tensor,
                     block_table: torch.Tensor, fmt: LatentFormat, *, scale: float,
                     token_chunk: int = 64) -> torch.Tensor:
    """Absorbed attention of each query over only its top-k cached positions.

    Args:
        q_lat: ``[T, N, L + R]``; ``topk``: ``[T, K]`` int32 (see
            :func:`sparse_positions_to_slots`).
    Returns:
        ``[T, N, L]`` float32; a query with no valid index gets zeros.
    """
    t, n, _ = q_lat.shape
    nb, bs, entry = kv_cache.shape
    flat = kv_cache.reshape(nb * bs, entry)
    out = torch.zeros(t, n, fmt.kv_lora_rank, dtype=torch.float32, device=q_lat.device)
    for s in range(0, t, token_chunk):
        e = min(s + token_chunk, t)
        slots, valid = sparse_positions_to_slots(topk[s:e], token_req[s:e], token_pos[s:e],
                                                 block_table, bs)
        # invalid entries read slot 0, whatever it holds (NaN too): zero them so a
        # masked-out key cannot reach the output through 0 * NaN
        keys = decode_latent_rows(flat[slots], fmt).masked_fill(~valid.unsqueeze(-1), 0.0)
        scores = torch.einsum("tnd,tkd->tnk", q_lat[s:e].to(torch.float32), keys) * scale
        scores = scores.masked_fill(~valid.unsqueeze(1), -math.inf)
        probs, _ = _softmax_with_lse(scores)
        out[s:e] = torch.einsum("tnk,tkl->tnl", probs, keys[..., : fmt.kv_lora_rank])
    return out


@dataclass(frozen=True)
class PrefillGroup:
    """The expanded-path tokens of one request: rows ``rows`` of the prefill batch."""

    req: int
    seq_len: int
    rows: slice


def mla_prefill_torch(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      groups: Sequence[PrefillGroup], fmt: LatentFormat, w_uk: torch.Tensor,
                      w_uv: torch.Tensor, *, scale: float, chunk_tokens: int) -> torch.Tensor:
    """Causal attention with K/V expanded from the latent, chunked over the context.

    Keys of a request are expanded ``chunk_tokens`` at a time
    (``k_nope = kv_c @ W_UK^T``, ``v = kv_c @ W_UV``, ``k = [k_nope, k_pe]``) and
    the partial results merged by log-sum-exp, so memory stays bounded by the chunk.

    Args:
        q: ``[Tp, N, P + R]``, grouped by request.
        w_uk: ``[N, P, L]``; ``w_uv``: ``[N, L, V]``.
    Returns:
        ``[Tp, N, V]`` float32.
    """
    if chunk_tokens <= 0:
        raise InvalidArgumentError("chunk_tokens", chunk_tokens, "a positive int")
    tp, n, _ = q.shape
    l_rank = fmt.kv_lora_rank
    p_dim, v_dim = w_uk.shape[1], w_uv.shape[2]
    # [L, N*P] and [L, N*V]: one matmul expands every head of a chunk
    wk = w_uk.to(device=q.device, dtype=torch.float32).reshape(n * p_dim, l_rank).t()
    wv = w_uv.to(device=q.device, dtype=torch.float32).permute(1, 0, 2).reshape(l_rank, n * v_dim)
    out = torch.zeros(tp, n, v_dim, dtype=torch.float32, device=q.device)
    for g in groups:
        tq = g.rows.stop - g.rows.start
        if tq == 0:
            continue
        qf = q[g.rows].to(torch.float32).transpose(0, 1)  # [N, tq, P + R]
        pos = torch.arange(g.seq_len - tq, g.seq_len, device=q.device).unsqueeze(1)
        for qs in range(0, tq, chunk_tokens):
            qe = min(qs + chunk_tokens, tq)
            # keys past the last query of this chunk are masked for all its rows
            last_key = g.seq_len - tq + qe
            acc: torch.Tensor | None = None
            acc_lse: torch.Tensor | None = None
            for ks in range(0, last_key, chunk_tokens):
                ke = min(ks + chunk_tokens, last_key)
                rows = decode_latent_rows(gather_latent(kv_cache, block_table[g.req], ks, ke), fmt)
                kv_c, k_pe = rows[:, :l_rank], rows[:, l_rank:]
                s_len = ke - ks
                k_nope = (kv_c @ wk).view(s_len, n, p_dim).transpose(0, 1)  # [N, S, P]
                k = torch.cat([k_nope, k_pe.unsqueeze(0).expand(n, -1, -1)], dim=-1)
                v = (kv_c @ wv).view(s_len, n, v_dim).transpose(0, 1)  # [N, S, V]
                scores = torch.bmm(qf[:, qs:qe], k.transpose(1, 2)) * scale  # [N, q, S]
                key_pos = torch.arange(ks, ke, device=q.device).unsqueeze(0)
                scores = scores.masked_fill(~(key_pos <= pos[qs:qe]).unsqueeze(0), -math.inf)
                probs, lse = _softmax_with_lse(scores)
                o = torch.bmm(probs, v)  # [N, q, V]
                if acc is None or acc_lse is None:
                    acc, acc_lse = o, lse
                else:
                    acc, acc_lse = merge_attn_states(acc, acc_lse, o, lse)
            if acc is not None:
                out[g.rows.start + qs: g.rows.start + qe] = acc.transpose(0, 1)
    return out
