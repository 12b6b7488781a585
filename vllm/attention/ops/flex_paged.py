"""FlexAttention over a paged cache (``torch.nn.attention.flex_attention``).

Two ways to present the pages to ``flex_attention`` (``mode``):

* ``"gather"`` (default): each request's positions are gathered (and
  dequantised) into one packed K/V sequence; a ``mask_mod`` over request ids and
  positions gives causality, sliding window and tree masks. Only positions a
  request owns are read, so unwritten slots never matter. Works for every layout
  and cache format.
* ``"page_table"``: the cache itself is the K/V sequence (all ``nb * bs`` slots,
  zero copy) and the ``mask_mod`` maps each physical slot to its logical position
  through an inverse page table. Only for layouts whose block and token axes merge
  into one strided axis (K/V-first, block-interleaved, DiffKV) with ``auto``
  caches in the query's dtype. Masked keys still pass through ``p @ v`` with
  ``p = 0``, so slots no request owns must hold finite values (vLLM zero-fills its
  caches; ``allocate_kv_cache`` does not).

Compilation: on CUDA the call goes through ``torch.compile(flex_attention)``. On CPU
it runs eagerly; torch 2.13 then warns once per process (a ``UserWarning``,
"flex_attention called without torch.compile() ...") that the unfused path
materialises the score matrix. That path is the one we choose on CPU (it is the
portable fallback, exact and small-shape), so the warning is silenced here, for
this call only and by its message; ``compiled=True`` runs inductor on CPU too.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.paged_args import PagedBatchLike, check_paged_args
from vllm.attention.ops.paged_attention import read_request
from vllm.attention.ops.paged_kv import Dequant, PagedKV
from vllm.attention.types import KVCacheLayout

FlexMode = Literal["gather", "page_table"]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_EAGER_WARNING = r"flex_attention called without torch\.compile\(\)"
_ZERO_COPY_LAYOUTS = (
    KVCacheLayout.SPLIT_KV_FIRST,
    KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
    KVCacheLayout.DIFFKV_PACKED,
)


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=None: serving changes the shapes every step; after the first recompile
    # Dynamo marks the changing sizes dynamic instead of recompiling per shape (with
    # dynamic=False a served model hit the recompile limit within 8 steps).
    return torch.compile(flex_attention)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: Any,
          score_mod: ScoreMod | None, scale: float, compiled: bool) -> torch.Tensor:
    """``flex_attention`` on ``[1, H, L, D]`` tensors with GQA; ``[1, Hq, Lq, Dv]`` out."""
    from torch.nn.attention.flex_attention import flex_attention

    fn: Callable[..., Any] = flex_attention
    if compiled:
        try:
            with warnings.catch_warnings():
                # past Dynamo's recompile limit the compiled function runs flex eagerly,
                # which warns: the same unfused fallback as below, silenced alike
                warnings.filterwarnings("ignore", message=_EAGER_WARNING, category=UserWarning)
                out = _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                       scale=scale, enable_gqa=q.shape[1] != k.shape[1])
            return _checked(out)
        except Exception as exc:
            if not _is_compile_failure(exc):
                raise
            # Inductor cannot lower every shape (seen on an H200: GQA 8 and a
            # non-causal batch, "NoValidChoicesError"); the eager flex_attention
            # computes the same function, unfused.
            compiled = False
    with warnings.catch_warnings():
        if not compiled:
            warnings.filterwarnings("ignore", message=_EAGER_WARNING, category=UserWarning)
        out = fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                 enable_gqa=q.shape[1] != k.shape[1])
    return _checked(out)


def _checked(out: object) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"flex_attention returned {type(out).__name__}, expected a Tensor")
    return out


def _is_compile_failure(exc: BaseException) -> bool:
    """An Inductor / Dynamo backend failure (not an error in the call itself)."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"InductorError", "BackendCompilerFailed", "LoweringException"})


def page_table_supported(kv: PagedKV, query_dtype: torch.dtype) -> str | None:
    """Why ``mode="page_table"`` cannot run on ``kv`` (None when it can)."""
    if kv.layout not in _ZERO_COPY_LAYOUTS:
        allowed = ", ".join(x.value for x in _ZERO_COPY_LAYOUTS)
        return f"layout={kv.layout.value}, page_table mode needs one of {allowed}"
    if kv.dequant is not Dequant.NONE:
        return f"kv_cache_dtype={kv.cache_dtype!r}, page_table mode needs 'auto'"
    if kv.key.data.dtype != query_dtype:
        return f"cache dtype {kv.key.data.dtype} differs from the query's {query_dtype}"
    return None


def _score_mod(logits_soft_cap: float | None) -> ScoreMod | None:
    if logits_soft_cap is None:
        return None
    cap = logits_soft_cap

    def soft_cap(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return soft_cap


def flex_paged_attention(
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
    mode: FlexMode = "gather",
    compiled: bool | None = None,
) -> torch.Tensor:
    """Paged attention through ``flex_attention``; arguments as
    :func:`~vllm.attention.ops.paged_attention.paged_attention_torch`.

    ``mode``: see the module docstring. ``compiled``: None compiles on CUDA only.
    Returns ``output`` (``[num_tokens, num_heads, head_size_v]``, rows past
    ``query_start_loc[-1]`` untouched).
    """
    num_tokens = check_paged_args(query, kv, batch, output, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, tree_mask=tree_mask)
    if num_tokens == 0:
        return output
    use_compile = kv.device.type == "cuda" if compiled is None else compiled
    dev = query.device
    starts = batch.query_start_loc_cpu.to(torch.int64)
    seq_lens = batch.seq_lens_cpu.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    ctx_lens = seq_lens - q_lens
    if (causal or tree_mask is not None) and bool((ctx_lens < 0).any()):
        raise InvalidArgumentError("seq_lens", batch.seq_lens_cpu.tolist(),
                                   "each >= its request's query length")
    req_ids = torch.arange(batch.num_reqs)
    q_req = torch.repeat_interleave(req_ids, q_lens).to(dev)
    q_pos = (torch.arange(num_tokens) - torch.repeat_interleave(starts[:-1] - ctx_lens, q_lens)).to(dev)
    q_ctx = ctx_lens.to(dev)[q_req]

    if mode == "gather":
        k, v, kv_req, kv_pos = _gather(query.dtype, kv, batch, seq_lens)
        key_req, key_pos = kv_req.to(dev), kv_pos.to(dev)

        def locate(kv_idx: torch.Tensor, q_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return key_req[kv_idx] == q_req[q_idx], key_pos[kv_idx]
    else:
        reason = page_table_supported(kv, query.dtype)
        if reason is not None:
            raise InvalidArgumentError("mode", mode, f"'gather' here: {reason}")
        # [nb, bs, H, D] -> [nb*bs, H, D]: a view for these layouts (block stride = bs * token stride)
        k = kv.key.data.flatten(0, 1)
        v = kv.value.data.flatten(0, 1)
        bs = kv.block_size
        p2l = _physical_to_logical(batch, kv.num_blocks, bs, seq_lens).to(dev)
        lens_dev = seq_lens.to(dev)

        def locate(kv_idx: torch.Tensor, q_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            r = q_req[q_idx]
            logical = p2l[r, kv_idx // bs]
            pos = logical * bs + kv_idx % bs
            return (logical >= 0) & (pos < lens_dev[r]), pos

    tree = None if tree_mask is None else (tree_mask[:num_tokens] != 0)
    width = 0 if tree is None else tree.shape[1]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        same, pos = locate(kv_idx, q_idx)
        qp = q_pos[q_idx]
        visible = same
        if tree is not None:
            j = (pos - q_ctx[q_idx]).clamp(0, width - 1)
            visible = visible & ((pos < q_ctx[q_idx]) | tree[q_idx, j])
        elif causal:
            visible = visible & (pos <= qp)
        if sliding_window is not None:
            visible = visible & (qp - pos < sliding_window)
        return visible

    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(mask_mod, None, None, num_tokens, k.shape[0], device=dev,
                                   BLOCK_SIZE=128 if mode == "gather" else (128, kv.block_size))
    q4 = query[:num_tokens].transpose(0, 1).unsqueeze(0)
    k4 = k.transpose(0, 1).unsqueeze(0)
    v4 = v.transpose(0, 1).unsqueeze(0)
    out = _flex(q4, k4, v4, block_mask=block_mask, score_mod=_score_mod(logits_soft_cap),
                scale=scale, compiled=use_compile)
    output[:num_tokens] = out[0].transpose(0, 1).to(output.dtype)
    return output


def _gather(dtype: torch.dtype, kv: PagedKV, batch: PagedBatchLike, seq_lens: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every request's K ``[S, H, D]`` and V ``[S, H, Dv]`` (``S = sum(seq_lens)``),
    dequantised to ``dtype``, with each key's request id and position (int64 ``[S]``)."""
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for i, length in enumerate(seq_lens.tolist()):
        k_i, v_i = read_request(kv, batch.block_table[i], int(length), dtype)
        ks.append(k_i)
        vs.append(v_i)
    k = torch.cat(ks)
    v = torch.cat(vs)
    kv_req = torch.repeat_interleave(torch.arange(len(ks)), seq_lens)
    kv_pos = torch.arange(int(seq_lens.sum())) - torch.repeat_interleave(
        torch.cumsum(seq_lens, 0) - seq_lens, seq_lens)
    return k, v, kv_req, kv_pos


def _physical_to_logical(batch: PagedBatchLike, num_blocks: int, block_size: int,
                         seq_lens: torch.Tensor) -> torch.Tensor:
    """``[num_reqs, num_blocks]`` int64: logical block index of each physical block in
    each request, -1 where the request does not use it (prefix-shared blocks appear
    in several rows)."""
    table = batch.block_table.to("cpu", torch.int64)
    out = torch.full((batch.num_reqs, num_blocks), -1, dtype=torch.int64)
    for i, length in enumerate(seq_lens.tolist()):
        used = table[i, : -(-int(length) // block_size)]
        out[i, used] = torch.arange(used.shape[0])
    return out


def compiled_note(device: torch.device) -> str:
    """What runs flex_attention on ``device``, for ``compute_path_notes``."""
    if device.type != "cuda":
        return f"flex_attention: device={device.type} runs it eagerly (unfused)"
    return "flex_attention: torch.compile(flex_attention); calls inductor cannot lower run it eagerly"
