"""FlexAttention over a paged cache (``torch.nn.attention.flex_attention``).

Two ways to present the pages to ``flex_attention`` (``mode``; ``"auto"`` picks):

* ``"page_table"`` (decode batches, zero copy): the cache itself is the K/V sequence
  (all ``nb * bs`` slots of the layouts whose block and token axes merge: K/V-first,
  block-interleaved, DiffKV; ``auto`` caches in the query's dtype). Each request is
  one batch entry of the query (``[B, Hq, max_q_len, D]``, ``B`` rounded up to a power
  of two: Inductor's decode kernel needs the batch size static, so each power of two
  is compiled once), and its block-table row *is* the
  block mask's list of KV blocks (``BlockMask.from_kv_blocks``, one sparse block per
  page). A ``mask_mod`` maps each slot back to its logical position through a
  physical-to-logical page table (causal, window). The kernel multiplies every row of
  a listed page by its probability, zero or not, so a row nobody wrote (NaN, say) would
  poison the result: a request's last, partly written page is therefore never listed;
  its written rows are gathered and attended in float32 torch, and the two parts are
  merged by their log-sum-exp. Inductor's decode kernel splits each request's pages
  over ``SPLIT_KV`` programs (:func:`decode_splits`); with more than one split every
  page is listed as partial (see :func:`_run_page_table`); a batch of single queries
  without a window then carries a constant ``mask_mod`` on CUDA, where the kernel reads
  only its lists (:func:`lists_only`). A cache whose block and
  token axes do not merge into one slot axis is not read this way (it would be copied
  whole each call): :func:`page_table_supported` says so and ``auto`` gathers.
* ``"gather"`` (prefill, mixed batches, every layout and cache format): each
  request's positions are gathered (and dequantised) into one packed K/V sequence in
  one indexed copy; a ``mask_mod`` over request ids and positions gives causality,
  sliding window and tree masks. The block mask is built directly from the lengths:
  for each 128-query block, the 128-key blocks its requests can see, with the blocks
  every row sees whole marked full (no ``mask_mod`` evaluated there).

Compilation: ``torch.compile(flex_attention, fullgraph=True, dynamic=True)``, compiled
once per process; token and key counts are symbolic (the page_table mode's batch is
static, in powers of two), so steps of new lengths reuse the compiled kernel.
The ``mask_mod``s capture only tensors and per-layer constants (block size, window,
causality). Where Inductor cannot lower a call the op runs ``flex_attention`` eagerly
(unfused: it materialises the scores, so always over gathered K/V) and says why in
:data:`last_run`. On CPU the op runs eagerly unless ``compiled=True``; torch then warns
once per process that the unfused path materialises the score matrix, which is the
path we choose there, so that warning is silenced for this call only, by its message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.paged_args import PagedBatchLike, check_paged_args
from vllm.attention.ops.paged_kv import Dequant, PagedKV, PagedOperand
from vllm.attention.types import KVCacheLayout
from vllm.attention.writers.kernels.device import multiprocessors, nvidia_capability

FlexMode = Literal["auto", "gather", "page_table"]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

Q_BLOCK = 128
"""Queries per block-mask row (both modes)."""
KV_BLOCK = 128
"""Keys per block-mask column in gather mode (page_table mode: one page)."""

_EAGER_WARNING = r"flex_attention called without torch\.compile\(\)"
_ZERO_COPY_LAYOUTS = (
    KVCacheLayout.SPLIT_KV_FIRST,
    KVCacheLayout.SPLIT_BLOCK_INTERLEAVED,
    KVCacheLayout.DIFFKV_PACKED,
)


@dataclass(frozen=True)
class FlexRun:
    """What the last :func:`flex_paged_attention` call ran."""

    mode: Literal["gather", "page_table"]
    compiled: bool
    eager_reason: str | None = None
    """Why a call that asked for the compiled kernel ran eagerly (None: it did not)."""


last_run: FlexRun | None = None
"""The last call's :class:`FlexRun` (per process; read by the backend after a call)."""


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=True: token and key counts change every step; compiling them symbolic
    # from the first call means one compile, not one per shape until Dynamo notices.
    return torch.compile(flex_attention, fullgraph=True, dynamic=True)


_compile_failures: dict[tuple[Any, ...], str] = {}
"""Why Inductor could not lower a call, by :func:`_compile_key`: a later call of the
same key runs eagerly at once instead of compiling (and failing) again every step."""


def _compile_key(mode: str, query: torch.Tensor, kv: PagedKV, *, scale: float, causal: bool,
                 sliding_window: int | None, logits_soft_cap: float | None, tree: bool,
                 kernel_options: dict[str, Any] | None) -> tuple[Any, ...]:
    """What a compiled call's graph depends on besides the sizes it takes symbolically."""
    return (mode, query.dtype, query.shape[1], kv.layout, kv.cache_dtype, kv.num_kv_heads,
            kv.head_size, kv.head_size_v, kv.block_size, str(kv.device), scale, causal,
            sliding_window, logits_soft_cap, tree,
            tuple(sorted((kernel_options or {}).items())))


def _failure_reason(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _is_compile_failure(exc: BaseException) -> bool:
    """An Inductor / Dynamo backend failure (not an error in the call itself)."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"InductorError", "BackendCompilerFailed", "LoweringException",
                         "Unsupported", "TorchRuntimeError", "FailOnRecompileLimitHit"})


def _call_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: Any,
               score_mod: ScoreMod | None, scale: float, compiled: bool, lse: bool,
               kernel_options: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``flex_attention`` on ``[B, H, L, D]`` tensors with GQA: ``[B, Hq, Lq, Dv]`` out and,
    with ``lse``, the natural-log log-sum-exp ``[B, Hq, Lq]`` (``-inf`` for a row that
    sees no key). Raises what the compiled call raises."""
    from torch.nn.attention import flex_attention as fa

    # (getattr: mypy types the overloaded flex_attention as a bare "function")
    fn: Callable[..., Any] = _compiled_flex() if compiled else getattr(fa, "flex_attention")
    kwargs: dict[str, Any] = dict(score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=q.shape[1] != k.shape[1])
    aux = getattr(fa, "AuxRequest", None)
    if lse:
        if aux is not None:
            kwargs["return_aux"] = aux(lse=True)
        else:
            kwargs["return_lse"] = True
    if compiled and kernel_options:
        kwargs["kernel_options"] = kernel_options
    with warnings.catch_warnings(), _compile_limits(compiled):
        # eager flex (our CPU path) warns that it is unfused: the path we chose,
        # silenced for this call only
        warnings.filterwarnings("ignore", message=_EAGER_WARNING, category=UserWarning)
        result = fn(q, k, v, **kwargs)
    if not lse:
        return _tensor(result), None
    out, extra = result
    lse_t = extra.lse if hasattr(extra, "lse") else extra
    return _tensor(out), _tensor(lse_t)


def _mark_sizes_dynamic(block_mask: Any) -> None:
    """Compile the block mask's sizes (and those of the tensors its ``mask_mod``
    captures) symbolic from the first call: ``dynamic=True`` reaches the arguments, not
    the tensors inside them, which would otherwise cost a recompile on the second step."""
    tensors = [block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
               block_mask.full_kv_indices]
    for cell in getattr(block_mask.mask_mod, "__closure__", None) or ():
        contents = cell.cell_contents
        if isinstance(contents, torch.Tensor):
            tensors.append(contents)
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for dim in range(t.dim()):
                if t.shape[dim] >= 2:
                    torch._dynamo.maybe_mark_dynamic(t, dim)


RECOMPILE_LIMIT = 32
"""Compiled variants of ``flex_attention`` a process may hold (one per combination of
layer options and per size specialisation; a model needs a handful)."""


def _compile_limits(compiled: bool) -> contextlib.AbstractContextManager[Any]:
    """A compiled call either runs Inductor's kernels or raises, so the op falls back to
    the gathered eager path and says why. Dynamo would otherwise run ``flex_attention``
    eagerly without a word past its recompile limit, on a backend error under a
    process-wide ``suppress_errors``, or under an eager ``torch.compiler`` stance: over
    the whole cache in page_table mode, where a single-query decode's ``mask_mod`` is a
    constant that only Inductor's kernels (which read only the listed pages) may take.
    ``compiled=False`` is how a caller asks for eager flex."""
    if not compiled:
        return contextlib.nullcontext()
    return _dynamo_settings(recompile_limit=RECOMPILE_LIMIT)


@contextlib.contextmanager
def _dynamo_settings(*, recompile_limit: int) -> Iterator[None]:
    """Inside the block only: Dynamo's recompile limit at least ``recompile_limit``,
    failing at the limit, errors not suppressed, the default ``torch.compiler`` stance
    (the settings this torch has; the others are skipped). The settings are set and
    restored by hand: ``dynamo_config.patch`` costs about 45 us a call in its
    bookkeeping, paid by every layer of every step (attention runs eagerly between the
    runner's graph replays)."""
    import torch._dynamo.config as dynamo_config

    saved: dict[str, Any] = {}
    limit = getattr(dynamo_config, "recompile_limit", None)
    if limit is not None and limit < recompile_limit:
        saved["recompile_limit"] = limit
        dynamo_config.recompile_limit = recompile_limit
    for name, wanted in (("fail_on_recompile_limit_hit", True), ("suppress_errors", False)):
        value = getattr(dynamo_config, name, None)
        if value is not None and value != wanted:
            saved[name] = value
            setattr(dynamo_config, name, wanted)
    try:
        with _default_stance():
            yield
    finally:
        for name, value in saved.items():
            setattr(dynamo_config, name, value)


def _default_stance() -> contextlib.AbstractContextManager[Any]:
    """The default ``torch.compiler`` stance inside the block, set only when another
    one is in force (the common case costs nothing, and ``set_stance`` may not be
    called inside a compiled region)."""
    from torch._dynamo import eval_frame

    current = getattr(eval_frame, "_stance", None)
    set_stance = getattr(torch.compiler, "set_stance", None)
    if current is None or set_stance is None:
        return contextlib.nullcontext()
    if (getattr(current, "stance", "default") == "default"
            and not getattr(current, "skip_guard_eval_unsafe", False)
            and getattr(current, "backend", None) is None):
        return contextlib.nullcontext()
    manager: contextlib.AbstractContextManager[Any] = set_stance("default")
    return manager


def dynamo_skips() -> str | None:
    """Why a compiled call would run eagerly here without a word (None: it compiles):
    with ``TORCHDYNAMO_DISABLE=1`` ``torch.compile`` returns the function itself, and
    eager flex would score every slot of the cache in page_table mode (where a
    single-query decode's ``mask_mod`` is a constant only Inductor's kernels may take).
    The op gathers instead, eagerly, and says why. :func:`_compile_limits` covers the
    other silent ways to eager (the recompile limit, suppressed errors, an eager
    stance); with ``torch._dynamo.config.disable`` or under a dispatch mode, flex
    itself raises (torch 2.13 traces it with Dynamo even eagerly)."""
    import os

    if os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        return "TORCHDYNAMO_DISABLE=1 (torch.compile returns the function uncompiled)"
    return None


def _tensor(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"flex_attention returned {type(x).__name__}, expected a Tensor")
    return x


def _slots(op: PagedOperand) -> torch.Tensor | None:
    """``op`` as ``[1, H, nb * bs, D]``, a view of the cache (None where its block and
    token axes do not merge into one slot axis: a cache not in its layout's physical
    order, which ``flatten`` would copy whole on every call)."""
    x = op.data
    if not _slot_axis_merges(x):
        return None
    return x.flatten(0, 1).transpose(0, 1).unsqueeze(0)


def _slot_axis_merges(x: torch.Tensor) -> bool:
    """Whether ``[nb, bs, H, D]`` ``x``'s block and token axes merge into one slot axis
    without a copy (what :func:`_slots` needs, asked without building the view)."""
    return x.dim() == 4 and (x.shape[0] <= 1 or x.stride(0) == x.shape[1] * x.stride(1))


def page_table_supported(kv: PagedKV, query_dtype: torch.dtype) -> str | None:
    """Why ``mode="page_table"`` cannot run on ``kv`` (None when it can)."""
    if kv.layout not in _ZERO_COPY_LAYOUTS:
        allowed = ", ".join(x.value for x in _ZERO_COPY_LAYOUTS)
        return f"layout={kv.layout.value}, page_table mode needs one of {allowed}"
    if kv.dequant is not Dequant.NONE:
        return f"kv_cache_dtype={kv.cache_dtype!r}, page_table mode needs 'auto'"
    if kv.key.data.dtype != query_dtype:
        return f"cache dtype {kv.key.data.dtype} differs from the query's {query_dtype}"
    for name, op in (("key", kv.key), ("value", kv.value)):
        if not _slot_axis_merges(op.data):
            return (f"the cache's {name} blocks (shape {tuple(op.data.shape)}, strides "
                    f"{op.data.stride()}) do not merge into one slot axis: a cache not in "
                    f"{kv.layout.value}'s physical order (allocate_kv_cache makes it) "
                    "would be copied whole on every call")
    return None


def choose_mode(kv: PagedKV, batch: PagedBatchLike, query_dtype: torch.dtype, *,
                compiled: bool, tree: bool, mode: FlexMode = "auto") -> Literal["gather", "page_table"]:
    """``auto``: ``page_table`` for compiled decode batches (every request one query)
    the cache allows, else ``gather``. A named mode is checked and returned."""
    if mode == "gather":
        return "gather"
    reason = page_table_supported(kv, query_dtype)
    if tree:
        reason = reason or "a draft-tree mask"
    if mode == "page_table":
        if reason is not None:
            raise InvalidArgumentError("mode", mode, f"'gather' or 'auto' here: {reason}")
        return "page_table"
    return "page_table" if reason is None and compiled and batch.max_query_len <= 1 else "gather"


def compiled_note(device: torch.device) -> str:
    """What runs ``flex_attention`` on ``device``, for ``compute_path_notes``."""
    if device.type != "cuda":
        return (f"flex_attention: device={device.type} runs it eagerly (unfused: it "
                "materialises the scores), over gathered K/V")
    return ("flex_attention: torch.compile(flex_attention, dynamic=True), decode batches "
            "zero-copy through the page table, prefill and mixed batches over gathered "
            "K/V; a call Inductor cannot lower runs eagerly (unfused), and the impl's "
            "last_fallbacks says why")


def _soft_cap_mod(logits_soft_cap: float | None) -> ScoreMod | None:
    if logits_soft_cap is None:
        return None
    cap = logits_soft_cap

    def soft_cap(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return soft_cap


# -- gather mode -------------------------------------------------------------------------

def _gather_mask(q_req: torch.Tensor, q_pos: torch.Tensor, key_start: torch.Tensor,
                 seq_lens: torch.Tensor, q_ctx: torch.Tensor, tree: torch.Tensor | None, *,
                 causal: bool, window: int | None) -> MaskMod:
    """Exact visibility over the packed keys: same request, causal / window / tree."""
    width = 0 if tree is None else tree.shape[1]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        r = q_req[q_idx]
        start = key_start[r]
        pos = kv_idx - start
        visible = (kv_idx >= start) & (pos < seq_lens[r])
        qp = q_pos[q_idx]
        if tree is not None:
            j = (pos - q_ctx[r]).clamp(0, width - 1)
            visible = visible & ((pos < q_ctx[r]) | tree[q_idx, j])
        elif causal:
            visible = visible & (pos <= qp)
        if window is not None:
            visible = visible & (qp - pos < window)
        return visible

    return mask_mod


def _rows_of(op: PagedOperand, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Stored rows ``[N, H, D]`` at (block, offset) pairs (int64 ``[N]``), one indexed copy."""
    view = op.block_view()  # [nb, bs/ts, ts, H, D/ds, ds]
    ts = op.token_split
    rows = view[blk, off // ts, off % ts]
    return rows.reshape(blk.shape[0], op.num_heads, op.head_size)


def _dequantised(kv: PagedKV, op: PagedOperand, scale: torch.Tensor, blk: torch.Tensor,
                 off: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows = _rows_of(op, blk, off)
    if kv.dequant is Dequant.NONE:
        return rows.to(dtype)
    if kv.dequant is Dequant.SCALED:
        return (rows.to(torch.float32) * scale.view(1, -1, 1)).to(dtype)
    if op.scales is None:
        raise InvalidArgumentError("kv", kv.cache_dtype, "per-token-head scales with the cache")
    return (rows.to(torch.float32) * op.scales[blk, off].unsqueeze(-1)).to(dtype)


def gather_tokens(kv: PagedKV, batch: PagedBatchLike, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every request's positions packed: K ``[S, H, D]``, V ``[S, H, Dv]`` dequantised to
    ``dtype`` (``S = sum(seq_lens)``), and each request's first row ``[num_reqs + 1]``
    (int64). Only owned positions are read. No host sync (``S`` from the host lengths)."""
    dev = kv.device
    lens = batch.seq_lens.to(torch.int64)
    start = torch.zeros(batch.num_reqs + 1, dtype=torch.int64, device=dev)
    start[1:] = torch.cumsum(lens, 0)
    total = int(batch.seq_lens_cpu.to(torch.int64).sum())
    req = torch.repeat_interleave(torch.arange(batch.num_reqs, device=dev), lens,
                                  output_size=total)
    pos = torch.arange(total, device=dev) - start[req]
    bs = kv.block_size
    blk = batch.block_table[req, pos // bs].to(torch.int64)
    off = pos % bs
    k = _dequantised(kv, kv.key, kv.k_scale, blk, off, dtype)
    v = _dequantised(kv, kv.value, kv.v_scale, blk, off, dtype)
    return k, v, start


def _gather_block_lists(q_lens: torch.Tensor, seq_lens: torch.Tensor, *, causal: bool,
                        window: int | None, tree: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host-side block lists of the packed layout, one row per ``Q_BLOCK`` queries:
    ``(kv_num_blocks [nq], kv_indices [nq, w], full_num [nq], full_indices [nq, w])``
    (int32, one width ``w``, see :func:`_list_width`): the ``KV_BLOCK`` key blocks some
    row of the query block sees, split into full (every row sees every key: blocks of a
    query block of one request) and partial (the others, masked). A query block that
    spans requests lists, for each of its requests, the keys that request's rows of the
    block can see (so no listed block is invisible to all its rows).
    ``q_lens``/``seq_lens``: int64 host ``[R]``."""
    ctx = seq_lens - q_lens
    key_start = torch.cumsum(seq_lens, 0) - seq_lens
    q_start = torch.cumsum(q_lens, 0) - q_lens
    tokens = int(q_lens.sum())
    q_req = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)
    q_pos = torch.arange(tokens) - torch.repeat_interleave(q_start - ctx, q_lens)
    first = torch.arange(0, tokens, Q_BLOCK)
    last = torch.clamp(first + Q_BLOCK, max=tokens) - 1
    nq = first.shape[0]
    nk = max(1, -(-int(seq_lens.sum()) // KV_BLOCK))
    r0, r1 = q_req[first], q_req[last]
    # every (query block, request with queries in it): that request's visible key range
    per_block = r1 - r0 + 1
    pair_qb = torch.repeat_interleave(torch.arange(nq), per_block)
    pair_r = r0[pair_qb] + torch.arange(pair_qb.shape[0]) - torch.repeat_interleave(
        torch.cumsum(per_block, 0) - per_block, per_block)
    p_min = q_pos[torch.maximum(first[pair_qb], q_start[pair_r])]
    p_max = q_pos[torch.minimum(last[pair_qb], q_start[pair_r] + q_lens[pair_r] - 1)]
    a = key_start[pair_r]
    if window is not None:
        a = a + torch.clamp(p_min - window + 1, min=0)
    b = key_start[pair_r] + (p_max + 1 if causal and not tree else seq_lens[pair_r])
    b = torch.maximum(b, a)
    # listed[qb, kb]: some pair's range reaches key block kb (a difference array)
    edges = torch.zeros(nq, nk + 1, dtype=torch.int64)
    live = b > a
    ones = torch.ones(int(live.sum()), dtype=torch.int64)
    edges.index_put_((pair_qb[live], a[live] // KV_BLOCK), ones, accumulate=True)
    edges.index_put_((pair_qb[live], -(-b[live] // KV_BLOCK)), -ones, accumulate=True)
    listed = torch.cumsum(edges, 1)[:, :nk] > 0
    # full: a query block of one request, keys every one of its rows sees
    p0, p1 = q_pos[first], q_pos[last]
    full_lo = key_start[r0] + (torch.clamp(p1 - window + 1, min=0) if window is not None else 0)
    full_hi = key_start[r0] + (p0 + 1 if causal else seq_lens[r0])
    f_lo, f_hi = -(-full_lo // KV_BLOCK), full_hi // KV_BLOCK
    f_hi = torch.where((r0 == r1) & torch.tensor(not tree), f_hi, f_lo)
    kb = torch.arange(nk)
    full = (kb[None, :] >= f_lo[:, None]) & (kb[None, :] < f_hi[:, None]) & listed
    partial = listed & ~full
    n_part, n_full = partial.sum(1), full.sum(1)
    width = _list_width(n_part, n_full)
    parts, fulls = _first_true(partial, width), _first_true(full, width)
    if nq < 2:  # a second, empty query block: no size of 1 (see _at_least_2)
        n_part, n_full = _at_least_2(n_part), _at_least_2(n_full)
        parts, fulls = _at_least_2(parts), _at_least_2(fulls)
    i32 = torch.int32
    return n_part.to(i32), parts.to(i32), n_full.to(i32), fulls.to(i32)


def _first_true(flags: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]``: each row's column indices where ``flags`` ``[rows, n]`` is
    True, ascending, then zeros."""
    n = flags.shape[1]
    col = torch.arange(n)
    order = torch.sort(torch.where(flags, col, n + col), dim=1).values
    order = torch.where(order < n, order, 0)
    if order.shape[1] < width:
        order = torch.cat([order, order.new_zeros(order.shape[0], width - order.shape[1])], 1)
    return order[:, :width]


def _list_width(n_part: torch.Tensor, n_full: torch.Tensor) -> int:
    """One width for the partial and the full block lists (``>= 2``, see
    :func:`_at_least_2`). Inductor's kernels read both lists at one offset, computed
    from the partial lists' strides (its decode kernel in every version, its forward
    kernel before torch 2.13), as :func:`~torch.nn.attention.flex_attention.create_block_mask`
    builds them: full lists of another width are read at the wrong place (garbage, or
    a page nobody owns), which is what the H200 showed before the widths were one."""
    widest = max([int(t.max()) for t in (n_part, n_full) if t.numel()], default=0)
    return max(2, widest)


def _at_least_2(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows appended up to 2. Dynamo compiles a size of 1 as a constant
    (its 0/1 specialisation), so every size that varies from step to step is kept >= 2:
    one compiled kernel then serves every step."""
    if t.shape[0] >= 2:
        return t
    pad = torch.zeros((2 - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def _gather_block_mask(batch: PagedBatchLike, key_start: torch.Tensor, num_tokens: int,
                       num_keys: int, *, causal: bool, window: int | None,
                       tree_mask: torch.Tensor | None) -> Any:
    """The packed layout's ``BlockMask`` (``num_keys``: rows of the gathered K/V)."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = key_start.device
    starts = batch.query_start_loc_cpu.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    seq_lens = batch.seq_lens_cpu.to(torch.int64)
    ctx = seq_lens - q_lens
    q_req = torch.repeat_interleave(torch.arange(batch.num_reqs), q_lens)
    q_pos = torch.arange(num_tokens) - torch.repeat_interleave(starts[:-1] - ctx, q_lens)
    tree = None if tree_mask is None else (tree_mask[:num_tokens] != 0)
    if num_tokens < 2:  # a padding query that sees nothing (position -1)
        q_req, q_pos = _at_least_2(q_req), torch.cat([q_pos, torch.tensor([-1])])
        tree = None if tree is None else _at_least_2(tree)
    lens_dev = _at_least_2(batch.seq_lens.to(torch.int64))
    mask_mod = _gather_mask(q_req.to(dev), q_pos.to(dev), key_start, lens_dev,
                            _at_least_2(ctx).to(dev), tree, causal=causal, window=window)
    n_part, parts, n_full, fulls = (t.to(dev) for t in _gather_block_lists(
        q_lens, seq_lens, causal=causal, window=window, tree=tree is not None))
    block_mask = BlockMask.from_kv_blocks(
        n_part[None, None], parts[None, None], n_full[None, None], fulls[None, None],
        BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod,
        seq_lengths=(max(num_tokens, 2), num_keys), compute_q_blocks=False)
    _mark_sizes_dynamic(block_mask)
    return block_mask


def _run_gather(query: torch.Tensor, kv: PagedKV, batch: PagedBatchLike, num_tokens: int, *,
                scale: float, causal: bool, sliding_window: int | None,
                score_mod: ScoreMod | None, tree_mask: torch.Tensor | None, compiled: bool,
                kernel_options: dict[str, Any] | None) -> torch.Tensor:
    """``[1, Hq, >= T, Dv]`` over packed K/V (rows past ``T``: padding)."""
    k, v, key_start = gather_tokens(kv, batch, query.dtype)
    k, v = _at_least_2(k), _at_least_2(v)
    block_mask = _per_batch(
        batch, ("gather", causal, sliding_window, None if tree_mask is None else id(tree_mask)),
        lambda: _gather_block_mask(batch, key_start, num_tokens, k.shape[0], causal=causal,
                                   window=sliding_window, tree_mask=tree_mask))
    q_rows = _at_least_2(query[:num_tokens])
    q4 = q_rows.transpose(0, 1).unsqueeze(0)
    out, _ = _call_flex(q4, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                        block_mask=block_mask, score_mod=score_mod, scale=scale,
                        compiled=compiled, lse=False, kernel_options=kernel_options)
    return out


# -- page_table mode -----------------------------------------------------------------------

def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two: the compiled kernel sees few batch sizes."""
    return 1 << max(0, (n - 1).bit_length())


def _page_mask(p2l: torch.Tensor, q_ctx: torch.Tensor, whole: torch.Tensor, *, block_size: int,
               causal: bool, window: int | None) -> MaskMod:
    """Exact visibility of physical slot ``kv_idx`` for batch entry ``b``'s query ``q_idx``:
    a page of the request (``p2l``), before its partly written last page (``whole``
    positions), causal / window. (Padding queries of an entry with fewer queries than
    ``q_len`` see what a query there would see; their rows are dropped.)"""
    bs = block_size

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        page = p2l[b, kv_idx // bs]
        pos = page * bs + kv_idx % bs
        qp = q_ctx[b] + q_idx
        visible = (page >= 0) & (pos < whole[b])
        if causal:
            visible = visible & (pos <= qp)
        if window is not None:
            visible = visible & (qp - pos < window)
        return visible

    return mask_mod


@dataclass(frozen=True)
class _PageTables:
    """A batch's block mask inputs in page_table mode (shared by a step's layers)."""

    rows: int
    """Batch entries (a power of two >= num_reqs, and >= 2)."""
    q_len: int
    p2l: torch.Tensor
    """``[rows, nb]`` int32: logical page of each physical block in each request, or -1."""
    q_ctx: torch.Tensor
    whole: torch.Tensor
    """``[rows]`` int64: positions in the request's whole (fully written) pages."""
    n_part: torch.Tensor
    parts: torch.Tensor
    n_full: torch.Tensor | None
    """None: one list (every visible page in ``parts``, ``mask_mod`` on each)."""
    fulls: torch.Tensor | None
    tail_block: torch.Tensor
    """``[rows]`` int64: physical block of the partly written last page (0 when none)."""
    tail_len: torch.Tensor
    """``[rows]`` int64: written rows of that page (0: no tail)."""
    has_tail: bool
    block_mask: Any = None
    """The ``BlockMask`` over the cache's slots (set by :func:`_page_block_mask`)."""
    exact_mask: MaskMod | None = None
    """What each query sees, exactly (set with ``block_mask``, whose own ``mask_mod`` is
    a constant for a single-query decode where :func:`lists_only`)."""


def _entries(batch: PagedBatchLike) -> tuple[int, int]:
    """page_table mode's query shape: batch entries (a power of two >= the requests, and
    >= 2: see :func:`_at_least_2`) and queries an entry (the longest request's, >= 1)."""
    starts = batch.query_start_loc_cpu.to(torch.int64)
    q_len = max(1, int((starts[1:] - starts[:-1]).max()) if batch.num_reqs else 1)
    return max(2, _bucket(batch.num_reqs)), q_len


def _page_tables(batch: PagedBatchLike, num_blocks: int, block_size: int, *, causal: bool,
                 window: int | None, one_list: bool = False) -> _PageTables:
    """``one_list``: list every visible page as partial (no full lists); see
    :func:`_run_page_table` for why a split decode needs that."""
    bs = block_size
    dev = batch.block_table.device
    starts = batch.query_start_loc_cpu.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    seq = batch.seq_lens_cpu.to(torch.int64)
    r = batch.num_reqs
    rows, lq = _entries(batch)
    pad = rows - r
    seq = torch.cat([seq, torch.zeros(pad, dtype=torch.int64)])
    q_lens = torch.cat([q_lens, torch.zeros(pad, dtype=torch.int64)])
    ctx = seq - q_lens
    whole_pages = seq // bs
    # per (entry, query block): logical pages seen, split into partial and full
    nq = -(-lq // Q_BLOCK)
    qb = torch.arange(nq)
    p0 = ctx[:, None] + qb[None, :] * Q_BLOCK                                   # [rows, nq]
    p1 = ctx[:, None] + torch.minimum(q_lens[:, None], (qb[None, :] + 1) * Q_BLOCK) - 1
    live = p1 >= p0
    lo = torch.zeros_like(p0)
    if window is not None:
        lo = torch.clamp(p0 - window + 1, min=0) // bs
    hi = (p1 // bs + 1) if causal else whole_pages[:, None].expand_as(p0)
    hi = torch.minimum(hi, whole_pages[:, None])
    hi = torch.where(live, torch.maximum(hi, lo), lo)
    f_lo = lo if window is None else -(-torch.clamp(p1 - window + 1, min=0) // bs)
    f_hi = (p0 + 1) // bs if causal else hi
    f_lo = torch.clamp(torch.maximum(f_lo, lo), max=hi)
    f_hi = torch.clamp(torch.minimum(f_hi, hi), min=f_lo)
    if one_list:
        f_lo = f_hi = hi
    n_low = f_lo - lo
    n_part = n_low + (hi - f_hi)
    n_full = f_hi - f_lo
    j = torch.arange(_list_width(n_part, n_full))
    logical = torch.where(j < n_low[..., None], lo[..., None] + j, f_hi[..., None] + j - n_low[..., None])
    logical = torch.where(j < n_part[..., None], logical, 0)
    logical_full = torch.where(j < n_full[..., None], f_lo[..., None] + j, 0)
    table = batch.block_table
    width = max(1, table.shape[1])
    padded = torch.zeros(rows, width, dtype=table.dtype, device=dev)
    padded[:r] = table[:r]
    b_idx = torch.arange(rows, device=dev)[:, None, None]
    parts = padded[b_idx, logical.clamp(max=width - 1).to(dev)]
    fulls = padded[b_idx, logical_full.clamp(max=width - 1).to(dev)]
    # physical -> logical page, over the whole pages only (the tail is attended apart)
    used = torch.arange(width, device=dev)[None, :] < whole_pages.to(dev)[:, None]
    target = torch.where(used, padded.to(torch.int64), num_blocks)
    p2l = torch.full((rows, num_blocks + 1), -1, dtype=torch.int32, device=dev)
    p2l.scatter_(1, target, torch.arange(width, dtype=torch.int32, device=dev).expand(rows, width))
    tail_len = seq - whole_pages * bs
    tail_page = torch.where(tail_len > 0, whole_pages, 0).clamp(max=width - 1)
    tail_block = padded[torch.arange(rows, device=dev), tail_page.to(dev)].to(torch.int64)
    i32 = torch.int32
    return _PageTables(
        rows=rows, q_len=lq, p2l=p2l[:, :num_blocks], q_ctx=ctx.to(dev),
        whole=(whole_pages * bs).to(dev), n_part=n_part.to(i32).to(dev),
        parts=parts.to(i32), n_full=None if one_list else n_full.to(i32).to(dev),
        fulls=None if one_list else fulls.to(i32),
        tail_block=tail_block, tail_len=tail_len.to(dev), has_tail=bool((tail_len > 0).any()),
    )


_STEP_CACHE: dict[str, Any] = {}


def _per_batch(batch: PagedBatchLike, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """``build()``, once per batch object and ``key``: a step's layers share its metadata,
    so its block masks are built by the first layer and reused by the others (the
    previous step's entries are dropped)."""
    ref = _STEP_CACHE.get("batch")
    if ref is None or ref() is not batch:
        _STEP_CACHE.clear()
        try:
            _STEP_CACHE["batch"] = weakref.ref(batch)
        except TypeError:  # an object that cannot be weakly referenced: no reuse
            return build()
    entries: dict[tuple[Any, ...], Any] = _STEP_CACHE.setdefault("entries", {})
    if key not in entries:
        entries[key] = build()
    return entries[key]


def _padded_queries(query: torch.Tensor, batch: PagedBatchLike, rows: int, q_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[rows, Hq, q_len, D]`` and the flat row of each real query in it (None when
    the query is a view: every request has ``q_len`` queries and none is padding)."""
    n = int(batch.query_start_loc_cpu[-1])
    hq, d = query.shape[1], query.shape[2]
    if rows == batch.num_reqs and n == rows * q_len:
        return query[:n].reshape(rows, q_len, hq, d).transpose(1, 2), None
    starts = batch.query_start_loc_cpu.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    req = torch.repeat_interleave(torch.arange(batch.num_reqs), q_lens)
    slot = req * q_len + torch.arange(n) - starts[:-1][req]
    flat = torch.zeros(rows * q_len, hq, d, dtype=query.dtype, device=query.device)
    idx = slot.to(query.device)
    flat.index_copy_(0, idx, query[:n])
    return flat.view(rows, q_len, hq, d).transpose(1, 2), idx


def _tail_merge(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, tail_block: torch.Tensor, tail_len: torch.Tensor,
                whole: torch.Tensor, q_ctx: torch.Tensor, *, scale: float, causal: bool,
                window: int | None, cap: float | None) -> torch.Tensor:
    """The kernel's result ``out`` ``[B, Hq, Lq, Dv]`` (log-sum-exp ``lse`` ``[B, Hq, Lq]``,
    over the whole pages) merged with the attention of ``q`` ``[B, Hq, Lq, D]`` to each
    entry's written rows of its last, partly written page, in float32.

    ``k_cache``/``v_cache``: ``[nb, bs, H, D(v)]``; ``tail_block``, ``tail_len``,
    ``whole``, ``q_ctx``: ``[B]`` int64 (that page's block and written rows, the
    positions before it, the entry's context length)."""
    bs, h = k_cache.shape[1], k_cache.shape[2]
    b, hq, lq, d = q.shape
    g = hq // h
    keys = k_cache.index_select(0, tail_block)     # [B, bs, H, D]
    vals = v_cache.index_select(0, tail_block)
    offs = torch.arange(bs, device=q.device)
    written = offs[None, :] < tail_len[:, None]         # [B, bs]
    keys = torch.where(written[..., None, None], keys, 0).float()
    vals = torch.where(written[..., None, None], vals, 0).float()
    qg = q.float().reshape(b, h, g, lq, d)
    s = torch.einsum("bhgqd,bthd->bhgqt", qg, keys) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    pos = whole[:, None] + offs[None, :]                                  # [B, bs]
    qp = q_ctx[:, None] + torch.arange(lq, device=q.device)[None, :]     # [B, Lq]
    visible = written[:, None, :].expand(b, lq, bs)
    if causal:
        visible = visible & (pos[:, None, :] <= qp[:, :, None])
    if window is not None:
        visible = visible & (qp[:, :, None] - pos[:, None, :] < window)
    s = s.masked_fill(~visible[:, None, None], -math.inf)
    tail_lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(tail_lse), tail_lse, 0.0)[..., None])
    tail = torch.einsum("bhgqt,bthd->bhgqd", p, vals).reshape(b, hq, lq, -1)
    return _merge(out, lse, tail, tail_lse.reshape(b, hq, lq))


@functools.cache
def _compiled_tail_merge() -> Callable[..., torch.Tensor]:
    # ~30 small ops eagerly (a launch each, a few microseconds of device time each);
    # Inductor fuses them into a few kernels. Only the sizes the caller marks dynamic
    # are symbolic, so a head count is never tied to a batch size that equals it.
    fn: Callable[..., torch.Tensor] = torch.compile(_tail_merge, fullgraph=True)
    return fn


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's output and log-sum-exp."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, 0.0)
    wa = torch.exp(lse_a - m)[..., None]
    wb = torch.exp(lse_b - m)[..., None]
    total = wa + wb
    merged = (out_a.float() * wa + out_b * wb) / torch.where(total > 0, total, 1.0)
    return merged


def lists_only(device: torch.device) -> bool:
    """Whether page_table mode's compiled call on ``device`` reads only the listed pages
    (Inductor's CUDA kernels), so a decode may use a constant ``mask_mod``. Elsewhere
    (Dynamo without Inductor, flex's dense reference) the ``mask_mod`` alone decides what
    each query sees and stays exact."""
    return device.type == "cuda"


def _page_block_mask(batch: PagedBatchLike, kv: PagedKV, *, causal: bool,
                     window: int | None, one_list: bool) -> _PageTables:
    from torch.nn.attention.flex_attention import BlockMask

    bs = kv.block_size
    t = _page_tables(batch, kv.num_blocks, bs, causal=causal, window=window,
                     one_list=one_list)
    exact = _page_mask(t.p2l, t.q_ctx, t.whole, block_size=bs, causal=causal, window=window)
    mask_mod = exact
    if t.q_len == 1 and window is None and lists_only(kv.device):
        # One query an entry, no window: every listed page is a whole page before the
        # query (the partly written last one is attended apart), so each of its rows is
        # visible, and the kernel reads nothing else. A constant mask spares it a
        # dependent page-table load each page, which the one list (split decode)
        # would otherwise pay on every page.
        from torch.nn.attention.flex_attention import noop_mask
        mask_mod = noop_mask
    block_mask = BlockMask.from_kv_blocks(
        t.n_part[:, None], t.parts[:, None],
        None if t.n_full is None else t.n_full[:, None],
        None if t.fulls is None else t.fulls[:, None],
        BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
        seq_lengths=(t.q_len, kv.num_blocks * bs), compute_q_blocks=False)
    _mark_sizes_dynamic(block_mask)
    return dataclasses.replace(t, block_mask=block_mask, exact_mask=exact)


def _run_page_table(query: torch.Tensor, kv: PagedKV, batch: PagedBatchLike, *,
                    scale: float, causal: bool, sliding_window: int | None,
                    logits_soft_cap: float | None, kernel_options: dict[str, Any] | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``([rows, Hq, q_len, Dv], flat query rows or None)`` over the cache in place."""
    bs = kv.block_size
    options = dict(kernel_options or {})
    if bs < 128:  # a kernel key tile must divide the mask's (one page)
        options.setdefault("BLOCK_N", bs)
    rows, q_len = _entries(batch)
    group = query.shape[1] // kv.num_kv_heads
    decode = q_len < 128 and group & (group - 1) == 0
    if decode:  # Inductor runs its decode kernel
        for key, value in decode_launch(kv.device).items():
            options.setdefault(key, value)
        options.setdefault("SPLIT_KV", decode_splits(kv.device, rows * kv.num_kv_heads))
    # Inductor's decode kernel divides the partial list among its splits by the
    # request's pages, but the full list by the whole K/V length, here every slot of the
    # cache: a request's full pages would all fall to one split. With more than one
    # split every page is listed as partial (the mask_mod evaluated on each, unless
    # _page_block_mask makes it a constant).
    one_list = decode and int(options["SPLIT_KV"]) > 1
    t: _PageTables = _per_batch(
        batch, ("page_table", kv.num_blocks, bs, causal, sliding_window, one_list),
        lambda: _page_block_mask(batch, kv, causal=causal, window=sliding_window,
                                 one_list=one_list))
    q4, idx = _padded_queries(query, batch, t.rows, t.q_len)
    # Inductor runs its decode kernel (GQA heads of a kv head in one tile, split-KV)
    # only for a batch size known when compiling: one compile per power of two.
    torch._dynamo.mark_static(q4, 0)
    k4, v4 = _slots(kv.key), _slots(kv.value)     # [1, H, nb*bs, D], views
    if k4 is None or v4 is None:  # page_table_supported said why
        why = page_table_supported(kv, query.dtype)
        raise InvalidArgumentError("kv", kv.layout.value, f"a cache page_table mode reads: {why}")
    out, lse = _call_flex(q4, k4, v4, block_mask=t.block_mask,
                          score_mod=_soft_cap_mod(logits_soft_cap), scale=scale,
                          compiled=True, lse=t.has_tail, kernel_options=options)
    if t.has_tail and lse is not None:
        # batch entries and cache blocks symbolic from the first compile (a new view of
        # the queries: their batch is static for flex only), so buckets and caches of
        # other sizes reuse it; head counts and sizes stay static
        args = (out, lse, q4.view(q4.shape), kv.key.data, kv.value.data, t.tail_block,
                t.tail_len, t.whole, t.q_ctx)
        for x in args:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        opts: dict[str, Any] = dict(scale=scale, causal=causal, window=sliding_window,
                                    cap=logits_soft_cap)
        try:
            with _compile_limits(kv.device.type == "cuda"):
                out = _tail_merger(kv.device)(*args, **opts)
        except Exception as exc:
            if not _is_compile_failure(exc):
                raise
            out = _tail_merge(*args, **opts)  # the same function, unfused
    return out, idx


def _tail_merger(device: torch.device) -> Callable[..., torch.Tensor]:
    """:func:`_tail_merge`, compiled on CUDA (eager elsewhere, as flex runs there)."""
    return _compiled_tail_merge() if device.type == "cuda" else _tail_merge


@functools.cache
def decode_launch(device: torch.device) -> dict[str, int]:
    """Stages and warps of Inductor's decode kernel (page_table mode) on ``device``.

    Inductor's own choice for sm_90 / sm_100 / sm_103 is 3 stages, 2 warps (64-key
    tiles), but the branch for sm_110 that follows it resets every other device to 1
    stage (torch 2.13's heuristic), so its decode loop runs unpipelined; here the key
    tile is a page (16 keys at page 16), which makes the pipelining matter more.
    ``benchmarks/tune_prefill.py --flex`` times this against the alternatives. NVIDIA
    only: an AMD GPU whose architecture torch reports as 9.0 (MI200) keeps Inductor's.
    """
    if nvidia_capability(device) in ((9, 0), (10, 0), (10, 3)):
        return {"num_stages": 3, "num_warps": 2}
    return {}


DECODE_PROGRAMS_PER_SM = 8
"""Programs (batch entry x kv head x split) an SM is given in page_table decode: the
decode kernel walks one page per loop step, so it keeps the memory busy only with many
programs in flight. Set from one shape (H200, batch 64 x 4096, 8 kv heads, page 16,
where it gives 3 splits: 548 us against 593 us for one split and 583-746 us for 2, 4,
5, 8, 12 or 16; ``benchmarks/tune_prefill.py --flex`` times the split counts)."""


def decode_splits(device: torch.device, programs: int) -> int:
    """``SPLIT_KV`` of Inductor's decode kernel (page_table mode) for ``programs``
    (batch entries x kv heads): enough splits of each request's pages for
    :data:`DECODE_PROGRAMS_PER_SM` programs an SM, at most 16; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    want = -(-multiprocessors(device) * DECODE_PROGRAMS_PER_SM // max(1, programs))
    return max(1, min(16, want))


# -- entry point --------------------------------------------------------------------------

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
    mode: FlexMode = "auto",
    compiled: bool | None = None,
    kernel_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Paged attention through ``flex_attention``; arguments as
    :func:`~vllm.attention.ops.paged_attention.paged_attention_torch`.

    ``mode``: see the module docstring (:func:`choose_mode`). ``compiled``: None
    compiles on CUDA only. ``kernel_options``: passed to the compiled kernel (tile
    sizes, warps, stages). Returns ``output`` (``[num_tokens, num_heads, head_size_v]``,
    rows past ``query_start_loc[-1]`` untouched); :data:`last_run` says what ran.
    """
    global last_run
    num_tokens = check_paged_args(query, kv, batch, output, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, tree_mask=tree_mask)
    use_compile = kv.device.type == "cuda" if compiled is None else compiled
    skipped = dynamo_skips() if use_compile else None
    if skipped is not None:  # Dynamo would run the "compiled" call eagerly: say so, gather
        if mode == "page_table":
            raise InvalidArgumentError("mode", mode, "'gather' or 'auto' here: page_table "
                                       f"mode needs the compiled kernel, and {skipped}")
        use_compile = False
    chosen = choose_mode(kv, batch, query.dtype, compiled=use_compile,
                         tree=tree_mask is not None, mode=mode)
    if num_tokens == 0:
        last_run = FlexRun(chosen, use_compile)
        return output
    starts = batch.query_start_loc_cpu.to(torch.int64)
    if causal or tree_mask is not None:
        short = (batch.seq_lens_cpu.to(torch.int64) < starts[1:] - starts[:-1]).nonzero()
        if short.numel():
            i = int(short[0])
            raise InvalidArgumentError(f"seq_lens[{i}]", int(batch.seq_lens_cpu[i]),
                                       f">= its query length {int(starts[i + 1] - starts[i])}")
    def key(mode: str) -> tuple[Any, ...]:
        return _compile_key(mode, query, kv, scale=scale, causal=causal,
                            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                            tree=tree_mask is not None, kernel_options=kernel_options)

    reason: str | None = skipped
    if chosen == "page_table":
        if not use_compile:
            raise InvalidArgumentError("compiled", compiled,
                                       "True (or None on CUDA) for mode='page_table': eager "
                                       "flex_attention scores every slot of the cache")
        reason = _compile_failures.get(key("page_table"))
    if chosen == "page_table" and reason is None:
        try:
            out4, idx = _run_page_table(query, kv, batch, scale=scale, causal=causal,
                                        sliding_window=sliding_window,
                                        logits_soft_cap=logits_soft_cap,
                                        kernel_options=kernel_options)
        except Exception as exc:
            if not _is_compile_failure(exc):
                raise
            reason = _compile_failures[key("page_table")] = _failure_reason(exc)
        else:
            rows = out4.transpose(1, 2).reshape(-1, out4.shape[1], out4.shape[3])
            src = rows[:num_tokens] if idx is None else rows.index_select(0, idx)
            output[:num_tokens] = src.to(output.dtype)
            last_run = FlexRun("page_table", True)
            return output
    score_mod = _soft_cap_mod(logits_soft_cap)
    if use_compile and reason is None:
        reason = _compile_failures.get(key("gather"))
    run_compiled = use_compile and reason is None
    args = dict(scale=scale, causal=causal, sliding_window=sliding_window,
                score_mod=score_mod, tree_mask=tree_mask, kernel_options=kernel_options)
    if run_compiled:
        try:
            out = _run_gather(query, kv, batch, num_tokens, compiled=True, **args)  # type: ignore[arg-type]
        except Exception as exc:
            if not _is_compile_failure(exc):
                raise
            # Inductor cannot lower every shape (seen on an H200: GQA 8 and a non-causal
            # batch, "NoValidChoicesError"); eager flex_attention computes the same function.
            reason = _compile_failures[key("gather")] = _failure_reason(exc)
            run_compiled = False
    if not run_compiled:
        out = _run_gather(query, kv, batch, num_tokens, compiled=False, **args)  # type: ignore[arg-type]
    output[:num_tokens] = out[0, :, :num_tokens].transpose(0, 1).to(output.dtype)
    last_run = FlexRun("gather", run_compiled, reason)
    return output


__all__ = [
    "FlexMode",
    "FlexRun",
    "choose_mode",
    "compiled_note",
    "decode_splits",
    "dynamo_skips",
    "flex_paged_attention",
    "gather_tokens",
    "page_table_supported",
]
