"""Portable paged attention: the torch path, tree masks, and path selection.

The nine standard backends run this when their vendor kernel is absent:
:func:`paged_attention` runs the path :func:`choose_path` picks: on CUDA torch's flash
varlen kernel for compute-heavy prefills it takes
(:mod:`vllm.attention.ops.flash_varlen`) and the Triton kernel for the rest, else
:func:`paged_attention_torch`, which gathers each request's K/V through the layout
(:class:`~vllm.attention.ops.paged_kv.PagedKV`) and runs the reference attention in
float32.

Batch convention (as :class:`~vllm.attention.backend.CommonAttentionMetadata`):
request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, which
are the last ``q_len`` of its ``seq_lens[i]`` positions; its positions live in
the blocks ``block_table[i, :]``.

Tree attention (TREE_ATTN speculative decoding): a request's queries are the
nodes of a draft tree, in an order where a parent precedes its children. Each
node sees the whole context (positions ``< seq_len - q_len``) and, among the new
tokens, exactly those its tree mask row allows (itself and its ancestors). The
batch-wide mask is packed as ``tree_mask[num_tokens, max_query_len]`` (bool):
row ``r`` is query token ``r``; column ``j`` is the ``j``-th new token of ``r``'s own
request. Requests without a tree get the causal lower triangle
(:func:`pack_tree_masks`). Sliding window does not apply to tree attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.paged_args import PagedBatchLike, check_paged_args
from vllm.attention.ops.paged_kv import PagedKV
from vllm.attention.ops.reference import attend
from vllm.attention.writers.readback import read_slots

PathName = Literal["auto", "torch", "triton", "flash_varlen"]
RunPath = Literal["torch", "triton", "flash_varlen"]


# -- tree masks ------------------------------------------------------------------------

def tree_ancestor_mask(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n, n]`` bool: row ``i`` marks node ``i`` and its ancestors.

    ``parents[i]`` is the index of node ``i``'s parent, ``-1`` for a root; a parent
    must precede its child (``parents[i] < i``).
    """
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise InvalidArgumentError(f"parents[{i}]", p, f"-1 (a root) or a node index < {i}")
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask.to(device)


def pack_tree_masks(
    masks: Sequence[torch.Tensor | None],
    query_lens: Sequence[int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Pack per-request ``[q_len, q_len]`` masks into ``[num_tokens, max_query_len]`` bool.

    ``masks[i] is None`` gives request ``i`` the causal lower triangle (a prefill or a
    plain decode in the same batch). Nonzero entries mean "visible".
    """
    if len(masks) != len(query_lens):
        raise InvalidArgumentError("masks", len(masks), f"{len(query_lens)} entries (one per request)")
    width = max(list(query_lens) + [1])
    rows: list[torch.Tensor] = []
    for i, (m, q) in enumerate(zip(masks, query_lens)):
        block = torch.zeros(q, width, dtype=torch.bool)
        if m is None:
            block[:, :q] = torch.ones(q, q, dtype=torch.bool).tril()
        else:
            if tuple(m.shape) != (q, q):
                raise InvalidArgumentError(f"masks[{i}].shape", tuple(m.shape), f"({q}, {q})")
            block[:, :q] = m.to("cpu") != 0
        rows.append(block)
    packed = torch.cat(rows) if rows else torch.zeros(0, width, dtype=torch.bool)
    return packed.to(device)


def tree_visibility(tree_rows: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[Tq, Tk]`` bool from one request's ``[Tq, >= Tq]`` tree rows: the context
    (the first ``Tk - Tq`` keys) is visible to all, the new tokens as the rows say."""
    tq = tree_rows.shape[0]
    ctx = torch.ones(tq, num_keys - tq, dtype=torch.bool, device=tree_rows.device)
    return torch.cat([ctx, tree_rows[:, :tq] != 0], dim=1)


def attend_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one request under an explicit mask, in ``q.dtype`` arithmetic.

    ``q``: ``[Tq, Hq, D]``; ``k``: ``[Tk, H, D]``; ``v``: ``[Tk, H, Dv]``;
    ``visible``: ``[Tq, Tk]`` bool. Returns ``[Tq, Hq, Dv]``; a query that sees no
    key gets zeros. The tree-attention reference (with :func:`tree_visibility`).
    """
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1)
    v = v.to(q.dtype).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    s = s.masked_fill(~visible.to(q.device), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


# -- the torch path -----------------------------------------------------------------------

def read_request(kv: PagedKV, block_ids: torch.Tensor, length: int,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's dequantised K ``[length, H, D]`` and V ``[length, H, Dv]`` in
    ``dtype``, read through the writers' readback (an address decoder independent of
    the Triton kernels' strides). ``block_ids``: the request's block-table row."""
    pos = torch.arange(length, device=block_ids.device)
    slots = block_ids[pos // kv.block_size].long() * kv.block_size + pos % kv.block_size
    k, v = read_slots(kv.layout, kv.cache, slots, quant=kv.quant, num_kv_heads=kv.num_kv_heads,
                      head_size=kv.head_size, head_size_v=kv.head_size_v, dequantize=True,
                      checked=False)
    return k.to(dtype), v.to(dtype)


def paged_attention_torch(
    query: torch.Tensor,
    kv: PagedKV,
    batch: PagedBatchLike,
    *,
    scale: float,
    output: torch.Tensor,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    tree_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Paged attention, one request at a time, in ``compute_dtype`` (float32).

    Args:
        query: ``[num_tokens, num_heads, head_size]`` fp32/fp16/bf16.
        kv: the layer's cache (:meth:`PagedKV.from_cache`), read only.
        batch: request layout (module docstring); only its ``*_cpu`` tensors are
            read on the host.
        output: ``[num_tokens, num_heads, head_size_v]``; rows ``< query_start_loc[-1]``
            are written, padding rows after them are left as they are.
        causal: queries are the last positions of their request's keys (decoder);
            False for encoder and cross-attention, where ``seq_lens`` may be shorter
            than the query length.
        tree_mask: ``[num_tokens, max_query_len]`` bool (module docstring), or None.
    Returns:
        ``output``.
    """
    check_paged_args(query, kv, batch, output, sliding_window=sliding_window,
                     logits_soft_cap=logits_soft_cap, tree_mask=tree_mask)
    starts = batch.query_start_loc_cpu.tolist()
    lens = batch.seq_lens_cpu.tolist()
    for i in range(batch.num_reqs):
        qs, qe, length = int(starts[i]), int(starts[i + 1]), int(lens[i])
        if qe == qs:
            continue
        if length < qe - qs and (causal or tree_mask is not None):
            raise InvalidArgumentError(f"seq_lens[{i}]", length, f">= its query length {qe - qs}")
        k, v = read_request(kv, batch.block_table[i], length, compute_dtype)
        q = query[qs:qe].to(compute_dtype)
        if tree_mask is not None:
            visible = tree_visibility(tree_mask[qs:qe], length)
            out = attend_masked(q, k, v, visible, scale=scale, logits_soft_cap=logits_soft_cap)
        else:
            out = attend(q, k, v, scale=scale, causal=causal, sliding_window=sliding_window,
                         logits_soft_cap=logits_soft_cap)
        output[qs:qe] = out.to(output.dtype)
    return output


# -- path selection ---------------------------------------------------------------------

def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None when they can)."""
    from vllm.attention.ops import triton_paged_attention

    return triton_paged_attention.triton_unavailable_reason(device)


def choose_path(
    query: torch.Tensor,
    kv: PagedKV,
    batch: PagedBatchLike,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    tree_mask: torch.Tensor | None = None,
    path: PathName = "auto",
    paged: Literal["triton", "torch"] | None = None,
) -> RunPath:
    """The path :func:`paged_attention` runs for this call.

    ``auto``: the paged kernel ``paged`` names (None: :func:`resolve_path`'s, Triton
    on CUDA when it imports, else torch); with Triton, torch's flash varlen kernel
    takes the compute-heavy prefills it computes exactly
    (:mod:`vllm.attention.ops.flash_varlen`), and the torch path the caches Triton
    refuses. A named ``path`` is returned as is (``triton`` checked by
    :func:`resolve_path`).
    """
    if path != "auto":
        return resolve_path(kv.device, path) if path == "triton" else path
    base = resolve_path(kv.device) if paged is None else paged
    if base == "torch":
        return "torch"
    from vllm.attention.ops import flash_varlen as fv

    if fv.flash_varlen_unavailable(kv.device) is None and fv.flash_varlen_rejects(
            query, kv, causal=causal, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, tree_mask=tree_mask) is None and \
            fv.flash_varlen_worth_it(batch, kv, query.shape[1], query.element_size(),
                                     causal=causal, sliding_window=sliding_window) is None:
        return "flash_varlen"
    from vllm.attention.ops.triton_paged_attention import triton_rejects

    return "torch" if triton_rejects(kv) is not None else "triton"


def paged_attention(
    query: torch.Tensor,
    kv: PagedKV,
    batch: PagedBatchLike,
    *,
    scale: float,
    output: torch.Tensor,
    causal: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    tree_mask: torch.Tensor | None = None,
    path: PathName = "auto",
) -> torch.Tensor:
    """The portable compute: the path :func:`choose_path` picks.

    Same arguments as :func:`paged_attention_torch`; ``path`` forces one (``"triton"``
    and ``"flash_varlen"`` raise :class:`~vllm.attention.errors.InvalidArgumentError`
    where they cannot run).
    """
    chosen = choose_path(query, kv, batch, causal=causal, sliding_window=sliding_window,
                         logits_soft_cap=logits_soft_cap, tree_mask=tree_mask, path=path)
    if chosen == "flash_varlen":
        from vllm.attention.ops.flash_varlen import paged_attention_flash_varlen

        return paged_attention_flash_varlen(
            query, kv, batch, scale=scale, output=output, causal=causal,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, tree_mask=tree_mask,
        )
    if chosen == "triton":
        from vllm.attention.ops.triton_paged_attention import paged_attention_triton

        return paged_attention_triton(
            query, kv, batch, scale=scale, output=output, causal=causal,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, tree_mask=tree_mask,
        )
    return paged_attention_torch(
        query, kv, batch, scale=scale, output=output, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, tree_mask=tree_mask,
    )


def resolve_path(device: torch.device, path: PathName = "auto") -> Literal["torch", "triton"]:
    """The paged-kernel path on ``device`` (for registry / CLI reports): ``auto`` is
    Triton on CUDA when it imports, torch everywhere else (the CPU interpreter runs only
    when ``path="triton"`` asks for it). Per call, :func:`choose_path` may also pick the
    flash varlen kernel for a prefill."""
    if path == "torch":
        return "torch"
    reason = triton_unavailable_reason(device)
    if path == "triton":
        if reason is not None:
            raise InvalidArgumentError("path", path, f"'auto' or 'torch' here: {reason}")
        return "triton"
    return "triton" if reason is None and device.type == "cuda" else "torch"
