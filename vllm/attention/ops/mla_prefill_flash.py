"""MLA prefill (the expanded form) on torch's FlashAttention-2 kernel, in the model dtype.

Per request, the keys and values are expanded from the latent ``chunk_tokens`` at a time
(``k = [kv_c @ W_UK^T, k_pe]``, ``v = kv_c @ W_UV``: two 16-bit matmuls with float32
accumulation) and the queries taken in blocks of ``chunk_tokens``. Where a block's keys
(the context and the new tokens up to its last) are at most ``chunk_tokens``, it
attends to all of them in one call of the varlen kernel, whose causal mask is aligned to
the bottom right (on CUDA). Otherwise it attends to the keys before it (no mask) and to
its own block's keys (causal: the block is square, so top-left and bottom-right
alignment agree), and the partial outputs are merged by their log-sum-exp in float32. Memory stays bounded by the chunk, as on the torch path
(:func:`~vllm.attention.ops.mla_attention.mla_prefill_torch`), whose arithmetic it
replaces on CUDA: float32 score matrices there, the flash kernel's tiles here.

The kernel takes one head size for Q, K and V: Q and K are ``P + R`` wide, V is padded
with zeros to that width (the extra output columns are dropped), as upstream vLLM pads
V for FlashAttention-2 (``_flash_attn_varlen_diff_headdims`` in
``vllm/model_executor/layers/attention/mla_attention.py``).

:func:`mla_prefill_flash_rejects` says where it does not run: a CPU (the torch path runs
there; the function itself also runs on CPU tensors through torch's CPU flash kernel, for
tests), a float32 model, head sizes the kernel lacks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.flash_varlen import (
    MAX_HEAD_SIZE,
    aten_varlen_kernel,
    flash_varlen_unavailable,
)
from vllm.attention.ops.mla_attention import (
    LatentFormat,
    PrefillGroup,
    decode_latent_rows,
    gather_latent,
    merge_attn_states,
)
from vllm.attention.types import HALF_DTYPES



def mla_prefill_flash_rejects(device: torch.device, dtype: torch.dtype, *, qk_head_dim: int,
                              v_head_dim: int) -> list[str]:
    """Why :func:`mla_prefill_flash` is not the prefill path here (empty: it is)."""
    reasons = []
    why = flash_varlen_unavailable(device)
    if why is not None:
        reasons.append(why)
    if dtype not in HALF_DTYPES:
        reasons.append(f"model dtype {dtype}: the flash kernel takes float16 or bfloat16")
    width = max(qk_head_dim, v_head_dim)
    if width > MAX_HEAD_SIZE or width % 8:
        reasons.append(f"head sizes {qk_head_dim} (q, k) and {v_head_dim} (v): the flash "
                       f"kernel takes one size, a multiple of 8 up to {MAX_HEAD_SIZE}")
    return reasons


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Sq, N, D]`` x ``[Sk, N, D]`` (each with a unit stride on ``D``) -> output
    ``[Sq, N, D]`` in ``q``'s dtype and its log-sum-exp ``[Sq, N]`` (float32, natural
    log), on torch's flash kernel (its CPU one on CPU tensors). The kernel works in this
    token-major layout: the head-major views passed to it are not copied."""
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    if q.device.type == "cuda":
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            *args, 0.0, causal, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *args, 0.0, causal, scale=scale)
    out, lse = res[0], res[1]
    return out[0].transpose(0, 1), lse[0, :, : q.shape[0]].transpose(0, 1)


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   scale: float) -> torch.Tensor:
    """``[Sq, N, D]`` queries, the last ``Sq`` of the ``[Sk, N, D]`` keys' positions,
    causal (bottom-right aligned), on the CUDA varlen kernel: ``[Sq, N, D]`` in ``q``'s
    dtype. (Its one-sequence offsets are made on the device: no host synchronisation.)"""
    sq, sk = q.shape[0], k.shape[0]
    dev = q.device
    two = torch.arange(2, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    aten_varlen_kernel(q, k, v, cu_q=two * sq, cu_k=two * sk,
                 seqused_k=torch.full((1,), sk, dtype=torch.int32, device=dev),
                 max_q=sq, max_k=sk, causal=True, scale=scale, window_left=None, out=out)
    return out


def mla_prefill_flash(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      groups: Sequence[PrefillGroup], fmt: LatentFormat, w_uk: torch.Tensor,
                      w_uv: torch.Tensor, *, scale: float, chunk_tokens: int) -> torch.Tensor:
    """Causal attention of the prefill rows with K/V expanded from the latent.

    Args:
        q: ``[Tp, N, P + R]`` float16 / bfloat16, grouped by request.
        kv_cache: ``(nb, bs, entry)``, any MLA cache format (read, never written).
        w_uk: ``[N, P, L]``; ``w_uv``: ``[N, L, V]`` (cast to ``q``'s dtype).
        chunk_tokens: the most keys expanded, and queries attended, at a time.
    Returns:
        ``[Tp, N, V]`` float32.
    """
    if chunk_tokens <= 0:
        raise InvalidArgumentError("chunk_tokens", chunk_tokens, "a positive int")
    if q.dtype not in HALF_DTYPES:
        raise InvalidArgumentError("q.dtype", q.dtype, "float16 or bfloat16")
    tp, n, qk = q.shape
    l_rank = fmt.kv_lora_rank
    p_dim, v_dim = w_uk.shape[1], w_uv.shape[2]
    if qk != p_dim + fmt.rope_dim:
        raise InvalidArgumentError("q.shape", tuple(q.shape), f"[Tp, N, {p_dim + fmt.rope_dim}]")
    width = max(qk, v_dim)
    dt = q.dtype
    # [L, N*P] and [L, N*V]: one matmul expands every head of a chunk
    wk = w_uk.to(device=q.device, dtype=dt).reshape(n * p_dim, l_rank).t()
    wv = w_uv.to(device=q.device, dtype=dt).permute(1, 0, 2).reshape(l_rank, n * v_dim)

    def expand(req: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[S, N, width]`` (zero-padded past ``P + R`` and ``V``) of positions
        ``start..stop-1``, token-major as the kernel reads them."""
        rows = decode_latent_rows(gather_latent(kv_cache, block_table[req], start, stop),
                                  fmt, dtype=dt)
        s = stop - start
        k = rows.new_empty(s, n, width)
        k[:, :, :p_dim] = (rows[:, :l_rank] @ wk).view(s, n, p_dim)
        k[:, :, p_dim:qk] = rows[:, l_rank:].unsqueeze(1)
        k[:, :, qk:] = 0
        v = rows.new_empty(s, n, width)
        v[:, :, :v_dim] = (rows[:, :l_rank] @ wv).view(s, n, v_dim)
        v[:, :, v_dim:] = 0
        return k, v

    out = torch.empty(tp, n, v_dim, dtype=torch.float32, device=q.device)
    for g in groups:
        tq = g.rows.stop - g.rows.start
        if tq == 0:
            continue
        first = g.seq_len - tq  # the position of the group's first query
        qg = q[g.rows]  # [tq, N, P + R]
        if width > qk:
            qg = torch.nn.functional.pad(qg, (0, width - qk))
        for qs in range(0, tq, chunk_tokens):
            qe = min(qs + chunk_tokens, tq)
            qb = qg[qs:qe]
            if q.device.type == "cuda" and first + qe <= chunk_tokens:
                # every key of the block at once: one call, no merge
                k, v = expand(g.req, 0, first + qe)
                o = _attend_causal(qb, k, v, scale=scale)
                out[g.rows.start + qs: g.rows.start + qe] = o[..., :v_dim]
                continue
            # the block's own keys, causal (a square block), then every key before it
            k, v = expand(g.req, first + qs, first + qe)
            acc, acc_lse = _attend(qb, k, v, causal=True, scale=scale)
            for ks in range(0, first + qs, chunk_tokens):
                k, v = expand(g.req, ks, min(ks + chunk_tokens, first + qs))
                o, lse = _attend(qb, k, v, causal=False, scale=scale)
                # (float32 from here: the merge's weights are)
                acc, acc_lse = merge_attn_states(acc, acc_lse, o, lse)
            out[g.rows.start + qs: g.rows.start + qe] = acc[..., :v_dim]
    return out
