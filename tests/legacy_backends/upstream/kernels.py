"""Torch stand-ins for the CUDA / vendor kernels the backends beside this module call.

Those backends, written against upstream's interface, import these names where upstream
imports vLLM's flash-attention wrappers (``vllm.attention.utils.fa_utils``,
``vllm.v1.attention.backends.fa_utils``), ``vllm._custom_ops``, vLLM's
``merge_attn_states`` / ``cp_lse_ag_out_rs``, torch's varlen flash kernel and
torchtitan's helpers. Each has the signature of what it replaces and its semantics,
computed plainly in float32 per request; nothing here calls this package's writers or
attention ops, so what such a backend writes and computes is its own.

``get_flash_attn_version()`` is 2: the FA2 code paths of those backends run (no AOT
scheduler metadata, no fp8 cache, no sinks, which upstream enables on FA3 only), and FA2's
semantics are what :func:`flash_attn_varlen_func` implements.

Upstream defines ``use_cascade_attention`` and ``cascade_attention`` in its FlashAttention
backend module; the FlashAttention backends here share one copy of each from this module.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import numpy as np
import torch

# -- flash-attention (vllm_flash_attn through fa_utils) ----------------------------------


def get_flash_attn_version(requires_alibi: bool = False,
                           head_size: int | None = None) -> int | None:
    """2: the FA2 paths run (FA3-only scheduling, fp8 and sinks stay off)."""
    return 2


def is_flash_attn_varlen_func_available() -> bool:
    return True


def flash_attn_supports_fp8() -> bool:
    """Upstream: FA3 on compute capability 9.x only."""
    return get_flash_attn_version() == 3


def flash_attn_supports_sinks() -> bool:
    """Upstream: FA3 only."""
    return get_flash_attn_version() == 3


def get_scheduler_metadata(batch_size: int, max_seqlen_q: int, max_seqlen_k: int,
                           num_heads_q: int, num_heads_kv: int, headdim: int,
                           cache_seqlens: torch.Tensor, qkv_dtype: torch.dtype = torch.bfloat16,
                           headdim_v: int | None = None,
                           cu_seqlens_q: torch.Tensor | None = None,
                           cu_seqlens_k_new: torch.Tensor | None = None,
                           cache_leftpad: torch.Tensor | None = None,
                           page_size: int | None = None, max_seqlen_k_new: int = 0,
                           causal: bool = False, window_size: Any = (-1, -1),
                           has_softcap: bool = False, num_splits: int = 0,
                           pack_gqa: bool | None = None, sm_margin: int = 0) -> torch.Tensor:
    raise NotImplementedError("get_scheduler_metadata is FA3's; get_flash_attn_version() is 2")


def _dequant(x: torch.Tensor, descale: torch.Tensor | None, b: int) -> torch.Tensor:
    """float32 of ``x`` ``[T, H, D]``; an fp8 ``x`` times its ``descale[b]`` (one per head)."""
    if x.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.float()
    scale = torch.ones(1) if descale is None else descale[b].float()
    return x.float() * scale.reshape(-1, 1).to(x.device)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           max_seqlen_q: int, cu_seqlens_q: torch.Tensor, max_seqlen_k: int,
                           cu_seqlens_k: torch.Tensor | None = None,
                           seqused_k: torch.Tensor | None = None, q_v: Any = None,
                           dropout_p: float = 0.0, softmax_scale: float | None = None,
                           causal: bool = False, window_size: Any = None,
                           softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: torch.Tensor | None = None,
                           return_softmax_lse: bool = False, out: torch.Tensor | None = None,
                           scheduler_metadata: torch.Tensor | None = None,
                           q_descale: torch.Tensor | None = None,
                           k_descale: torch.Tensor | None = None,
                           v_descale: torch.Tensor | None = None, num_splits: int = 0,
                           fa_version: int = 2, s_aux: torch.Tensor | None = None,
                           cp_world_size: int = 1, cp_rank: int = 0,
                           cp_tot_seqused_k: torch.Tensor | None = None) -> Any:
    """FlashAttention over ``q`` ``[total_q, Hq, D]`` and either a paged cache
    ``k``/``v`` ``[nb, bs, Hk, D]`` read through ``block_table`` ``[B, max_blocks]`` and
    ``seqused_k`` ``[B]``, or packed ``k``/``v`` ``[total_k, Hk, D]`` split by
    ``cu_seqlens_k`` ``[B + 1]``. Causal masks align bottom-right; query ``i`` of ``Lq``
    sees keys ``[i + Lk - Lq - left, i + Lk - Lq + right]`` of ``window_size``.
    Returns ``out`` (and the log-sum-exp ``[Hq, total_q]`` float32)."""
    if cu_seqlens_k is None and seqused_k is None:
        raise ValueError("cu_seqlens_k or seqused_k must be provided")
    if block_table is not None and seqused_k is None:
        raise ValueError("seqused_k must be provided if block_table is provided")
    if alibi_slopes is not None or s_aux is not None or q_v is not None or dropout_p:
        raise NotImplementedError("alibi, sinks, q_v and dropout have no stand-in here")
    if cp_world_size != 1:
        raise NotImplementedError("context parallelism has no stand-in here")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    num_heads = q.shape[1]
    if out is None:
        out = torch.empty(q.shape[0], num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((num_heads, q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    starts = cu_seqlens_q.tolist()
    for b in range(len(starts) - 1):
        qs, qe = starts[b], starts[b + 1]
        if seqused_k is not None:
            lk, ks = int(seqused_k[b]), 0
        else:
            assert cu_seqlens_k is not None
            ks, lk = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        if block_table is not None:
            ids = block_table[b, : -(-lk // k.shape[1])].long()
            kb, vb = k[ids].flatten(0, 1)[:lk], v[ids].flatten(0, 1)[:lk]
        else:
            kb, vb = k[ks: ks + lk], v[ks: ks + lk]
        qb = _dequant(q[qs:qe], q_descale, b)
        group = num_heads // kb.shape[1]
        kb = _dequant(kb, k_descale, b).repeat_interleave(group, dim=1)
        vb = _dequant(vb, v_descale, b).repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(qe - qs, device=q.device).unsqueeze(1) + (lk - (qe - qs))
        t = torch.arange(lk, device=q.device).unsqueeze(0)
        visible = torch.ones(qe - qs, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            visible &= t <= pos + right
        if left >= 0:
            visible &= t >= pos - left
        s = s.masked_fill(~visible, -math.inf)
        lse[:, qs:qe] = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key gets zeros
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, vb).to(out.dtype)
    return (out, lse) if return_softmax_lse else out


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor,
                      prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                      suffix_lse: torch.Tensor, output_lse: torch.Tensor | None = None) -> None:
    """Combine two partial attentions ``[T, H, D]`` by their log-sum-exps ``[H, T]``
    (an ``inf`` log-sum-exp counts as ``-inf``: a part that saw no key)."""
    p = prefix_lse.float().masked_fill(prefix_lse == math.inf, -math.inf)
    s = suffix_lse.float().masked_fill(suffix_lse == math.inf, -math.inf)
    top = torch.maximum(p, s).masked_fill(torch.maximum(p, s) == -math.inf, 0.0)
    wp, ws = torch.exp(p - top), torch.exp(s - top)
    total = wp + ws
    wp_t = (wp / total).T.unsqueeze(-1).nan_to_num(0.0)
    ws_t = (ws / total).T.unsqueeze(-1).nan_to_num(0.0)
    output.copy_((prefix_output.float() * wp_t + suffix_output.float() * ws_t).to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.log(total) + top)


def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False,
                     is_lse_base_on_e: bool = True) -> Any:
    """Across a context-parallel group of one there is nothing to correct."""
    if cp_group.world_size != 1:
        raise NotImplementedError("context parallelism has no stand-in here")
    return (cp_attn_out, cp_attn_lse) if return_lse else cp_attn_out


# -- cascade attention (upstream: vllm/v1/attention/backends/flash_attn.py) ---------------

_NO_WINDOW = (-1, -1)  # flash-attn's window_size for attention without a sliding window
_CASCADE_MIN_PREFIX_TILES = 4  # of 128 keys: a shorter shared prefix is not worth a pass
_CASCADE_MIN_REQUESTS = 4


def expand_descales(num_seqs: int, num_kv_heads: int, q_descale: torch.Tensor | None,
                    k_descale: torch.Tensor | None,
                    v_descale: torch.Tensor | None) -> dict[str, Any]:
    """Per-tensor scales broadcast to flash-attn's ``[num_seqs, num_kv_heads]`` without
    copying, as its ``q_descale`` / ``k_descale`` / ``v_descale`` keywords (None stays)."""
    shape = (num_seqs, num_kv_heads)
    return {name: None if s is None else s.expand(shape)
            for name, s in (("q_descale", q_descale), ("k_descale", k_descale),
                            ("v_descale", v_descale))}


def use_cascade_attention(
    common_prefix_len: int,
    query_lens: np.ndarray,
    num_query_heads: int,
    num_kv_heads: int,
    use_alibi: bool,
    use_sliding_window: bool,
    use_local_attention: bool,
    num_sms: int,
    dcp_world_size: int = 1,
) -> bool:
    """Whether to attend to a prefix shared by the whole batch in a pass of its own.

    Only on one context-parallel rank, without ALiBi, a window or local attention (the
    two passes take none of them), and only for a prefix of several 128-key tiles shared
    by several requests; upstream also weighs the pass against split-KV decoding, which
    is not modelled here. (v0.10's signature ends at ``num_sms``.)
    """
    if dcp_world_size > 1 or use_alibi or use_sliding_window or use_local_attention:
        return False
    return (-(-common_prefix_len // 128) >= _CASCADE_MIN_PREFIX_TILES
            and len(query_lens) >= _CASCADE_MIN_REQUESTS)


def cascade_attention(
    output: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    max_query_len: int,
    cu_prefix_query_lens: torch.Tensor,
    prefix_kv_lens: torch.Tensor,
    suffix_kv_lens: torch.Tensor,
    max_kv_len: int,
    softmax_scale: float,
    alibi_slopes: torch.Tensor | None,
    sliding_window: tuple[int, int],
    logits_soft_cap: float,
    block_table: torch.Tensor,
    common_prefix_len: int,
    fa_version: int,
    prefix_scheduler_metadata: torch.Tensor | None = None,
    suffix_scheduler_metadata: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    max_num_splits: int = 0,
) -> torch.Tensor:
    """Attention as two passes merged by their log-sum-exps: the whole batch as one
    query run over the shared prefix (the first request's leading blocks, no mask), then
    each request over the rest of its keys (causal). Sinks (``s_aux``) enter the prefix
    pass only, so they count once in the merge. ``common_prefix_len`` is a whole number
    of blocks; both passes split their keys ``max_num_splits`` ways (0: the kernel
    chooses)."""
    if alibi_slopes is not None or tuple(sliding_window) != _NO_WINDOW:
        raise NotImplementedError("cascade attention takes neither ALiBi nor a window")
    block_size = key_cache.shape[1]
    shared_blocks, partial = divmod(common_prefix_len, block_size)
    if partial or not shared_blocks:
        raise ValueError(f"common_prefix_len={common_prefix_len} is not whole blocks of "
                         f"{block_size}")
    heads = key_cache.shape[2]
    scales = (q_descale, k_descale, v_descale)
    shared: dict[str, Any] = dict(
        softmax_scale=softmax_scale, window_size=list(sliding_window), softcap=logits_soft_cap,
        return_softmax_lse=True, fa_version=fa_version, num_splits=max_num_splits)
    prefix_out, prefix_lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, cu_seqlens_q=cu_prefix_query_lens,
        seqused_k=prefix_kv_lens, max_seqlen_q=query.shape[0],
        max_seqlen_k=common_prefix_len, causal=False, block_table=block_table[:1],
        scheduler_metadata=prefix_scheduler_metadata, s_aux=s_aux, **shared,
        **expand_descales(cu_prefix_query_lens.shape[0] - 1, heads, *scales))
    suffix_out, suffix_lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, cu_seqlens_q=cu_query_lens,
        seqused_k=suffix_kv_lens, max_seqlen_q=max_query_len,
        max_seqlen_k=max_kv_len - common_prefix_len, causal=True,
        block_table=block_table[:, shared_blocks:],
        scheduler_metadata=suffix_scheduler_metadata, **shared,
        **expand_descales(cu_query_lens.shape[0] - 1, heads, *scales))
    merge_attn_states(output, prefix_out, prefix_lse, suffix_out, suffix_lse)
    return output

# -- vllm._custom_ops ---------------------------------------------------------------------

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2}


def _to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating conversion of ``float32(x) / scale`` (per tensor, or per head of
    ``x`` ``[T, H, D]``), round to nearest even, NaN kept."""
    scale = scale.float().reshape(-1).to(x.device)
    if scale.numel() > 1:
        scale = scale.reshape(-1, 1)
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_cache_dtype: str, k_scale: torch.Tensor,
                            v_scale: torch.Tensor) -> None:
    """Token ``i < len(slot_mapping)`` goes to ``[slot // bs, slot % bs]`` of the
    ``[nb, bs, H, D]`` caches (any strides); a negative slot is skipped; fp8 caches
    (``uint8`` or fp8 tensors) get ``fp8(x / scale)``, saturating."""
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = key_cache.shape[1]
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = src[:n][keep]
        if kv_cache_dtype in _FP8:
            cache = cache.view(_FP8[kv_cache_dtype])
            rows = _to_fp8(rows, scale, cache.dtype)
        cache[slots // bs, slots % bs] = rows.to(cache.dtype)


def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None,
                     num_token_padding: int | None = None,
                     scale_ub: torch.Tensor | None = None,
                     use_per_token_if_dynamic: bool = False,
                     output: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Static (``scale`` given) or dynamic per-tensor E4M3 quantisation of ``[T, N]``."""
    if num_token_padding is not None or use_per_token_if_dynamic or scale_ub is not None:
        raise NotImplementedError("padding, per-token and bounded scales have no stand-in here")
    top = torch.finfo(torch.float8_e4m3fn).max
    if scale is None:
        scale = (input.abs().max().float() / top).clamp(min=torch.finfo(torch.float32).tiny)
    q = (input.float() / scale.float()).clamp(-top, top).to(torch.float8_e4m3fn)
    if output is not None:
        output.copy_(q)
        q = output
    return q, scale.reshape(1)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy block ``block_mapping[i, 0]`` of ``src`` to block ``block_mapping[i, 1]`` of ``dst``."""
    for s, d in block_mapping.tolist():
        dst[d].copy_(src[s])


# -- torch.nn.attention.varlen (its flash kernel has no CPU implementation) ---------------


class AuxRequest(NamedTuple):
    lse: bool = False


def varlen_attn_out(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor | None,
                    max_q: int, max_k: int, *, return_aux: AuxRequest | None = None,
                    scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                    enable_gqa: bool = False, seqused_k: torch.Tensor | None = None,
                    block_table: torch.Tensor | None = None, num_splits: int | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch 2.13's ``varlen_attn_out``, with its argument checks, over this module's
    :func:`flash_attn_varlen_func` (causal iff ``window_size == (-1, 0)``)."""
    num_heads_q = query.size(1)
    num_heads_k = key.size(2) if block_table is not None else key.size(1)
    if not enable_gqa and num_heads_q != num_heads_k:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads "
            f"but got Hq={num_heads_q} and Hkv={num_heads_k}. "
            f"Try setting enable_gqa=True for GQA.")
    if enable_gqa and num_heads_q % num_heads_k != 0:
        raise ValueError(
            f"Expect number of query heads to be a multiple of kv heads for GQA "
            f"but got Hq={num_heads_q} and Hkv={num_heads_k}.")
    is_causal = tuple(window_size) == (-1, 0)
    _, lse = flash_attn_varlen_func(
        query, key, value, max_q, cu_seq_q, max_k,
        cu_seqlens_k=cu_seq_k if seqused_k is None else None, seqused_k=seqused_k,
        softmax_scale=scale, causal=is_causal, window_size=window_size,
        block_table=block_table, return_softmax_lse=True, out=out)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


# -- torchtitan's helpers -----------------------------------------------------------------


def has_cuda_capability(major: int, minor: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (major, minor)


_warned: set[str] = set()


def warn_once(logger: logging.Logger, msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def is_in_batch_invariant_mode() -> bool:
    return False
