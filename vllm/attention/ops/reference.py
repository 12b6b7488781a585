"""Torch reference attention: short and obviously right, not fast.

``attend`` is the dense oracle (any dtype, float64 in the conformance kit);
``paged_attention`` runs it per request over K/V gathered from a paged cache.
"""

from __future__ import annotations

import math

import torch


def visibility_mask(
    num_queries: int,
    num_keys: int,
    *,
    causal: bool,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """``[num_queries, num_keys]`` bool: query ``j`` sits at position
    ``num_keys - num_queries + j`` and sees key ``t`` iff ``t <= pos`` (causal) and
    ``pos - t < sliding_window``."""
    pos = torch.arange(num_queries, device=device).unsqueeze(1) + (num_keys - num_queries)
    t = torch.arange(num_keys, device=device).unsqueeze(0)
    mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    if causal:
        mask &= t <= pos
    if sliding_window is not None:
        mask &= (pos - t) < sliding_window
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one request in ``q.dtype`` arithmetic.

    Args:
        q: ``[Tq, Hq, D]``; the queries are the last ``Tq`` positions of the keys.
        k: ``[Tk, H, D]``; ``Hq`` is a multiple of ``H`` (GQA/MQA).
        v: ``[Tk, H, Dv]``.
    Returns:
        ``[Tq, Hq, Dv]``; a query that sees no key gets zeros.
    """
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1)
    v = v.to(q.dtype).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    mask = visibility_mask(q.shape[0], k.shape[0], causal=causal,
                           sliding_window=sliding_window, device=q.device)
    s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


def gather_pages(view: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Rows ``0..length-1`` of a request from ``view`` ``[nb, bs, ...]`` via its block ids."""
    bs = view.shape[1]
    nblk = -(-length // bs)
    return view[block_ids[:nblk].long()].flatten(0, 1)[:length]
