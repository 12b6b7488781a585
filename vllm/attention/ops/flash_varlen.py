"""Prefill through torch's own FlashAttention-2 varlen kernel over K/V gathered
from the paged cache.

``aten._flash_attention_forward`` (in every CUDA build of torch, sm80+) takes
packed ``[total, H, D]`` K/V with ``cu_seqlens``; it does GQA natively, causal
masks aligned to the bottom right (query ``i`` of ``q_len`` sees keys up to
``i + k_len - q_len``, our convention), and a left window. It cannot read our
pages, so the step copies each request's blocks into one contiguous buffer
(:func:`gather_blocks`, whole blocks: ``seqused_k`` stops the kernel at each
request's length, so the unwritten tail of a last block is never read). Compute
is over what the cache holds, as on every other path.

It takes a call only where it computes the same function (:func:`flash_varlen_rejects`):
fp16/bf16 queries, an ``auto`` cache in the query's dtype (fp8 caches stay on the
paged Triton kernel, which dequantises in place), K and V of one head size (a
multiple of 8 up to 256), no soft cap (the kernel has none), no draft tree, a
sliding window only on causal attention. :func:`flash_varlen_worth_it` keeps it to
compute-heavy batches, where the gather is small against the attention itself.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.paged_args import PagedBatchLike, check_paged_args
from vllm.attention.ops.paged_kv import Dequant, PagedKV, PagedOperand
from vllm.attention.types import HALF_DTYPES
from vllm.attention.writers.kernels.device import nvidia_capability

_OP = "_flash_attention_forward"
_OP_INPLACE = "_flash_attention_forward_no_dropout_inplace"
"""The out-variant (newer torch): writes ``output`` in place, no copy afterwards."""

MAX_HEAD_SIZE = 256
FLOPS_PER_BYTE = 130.0
"""Attention FLOPs the flash kernel does in the time a byte is copied (H200: 548
TFLOP/s causal bf16 against 4.2 TB/s of copy); sizes the copies against the work."""
MAX_COPY_SHARE = 0.5
"""Take the flash path while its copies (gather, and the output when the kernel cannot
write in place) cost at most this fraction of the attention time: break-even with a
paged kernel running at 1 / (1 + 0.5) = 0.67 x the flash kernel's rate."""


class FlashVarlenKernel(Protocol):
    """The varlen attention the path calls (the aten op, or a test's reference).

    ``q``: ``[Tq, Hq, D]``; ``k``/``v``: ``[Tk, H, D]``; request ``i``'s queries are rows
    ``cu_q[i]:cu_q[i+1]`` and its keys rows ``cu_k[i]:cu_k[i] + seqused_k[i]`` (int32).
    ``window_left``: keys before a query's own position it sees (None: all). Fills ``out``.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 cu_q: torch.Tensor, cu_k: torch.Tensor, seqused_k: torch.Tensor,
                 max_q: int, max_k: int, causal: bool, scale: float,
                 window_left: int | None, out: torch.Tensor) -> None: ...


@functools.cache
def _unavailable(device_type: str, index: int | None) -> str | None:
    if device_type != "cuda":
        return f"device={device_type}, torch's flash kernel runs on cuda"
    if torch.version.hip is not None:
        return "ROCm: torch's flash kernel there has other limits; the paged Triton kernel runs"
    if not hasattr(torch.ops.aten, _OP):
        return f"torch {torch.__version__} has no aten.{_OP}"
    if not torch.backends.cuda.is_flash_attention_available():
        return f"torch {torch.__version__} was built without flash attention"
    dev = torch.device(device_type) if index is None else torch.device(device_type, index)
    cap = nvidia_capability(dev)
    major, minor = cap if cap is not None else (0, 0)  # (not ROCm: checked above)
    if major < 8:
        return f"compute capability {major}.{minor}, torch's flash kernel needs sm80+"
    return None


def flash_varlen_unavailable(device: torch.device) -> str | None:
    """Why the flash varlen path cannot run on ``device`` (None when it can)."""
    return _unavailable(device.type, device.index)


def writes_in_place() -> bool:
    """Whether this torch has the kernel's out-variant (else the result is copied)."""
    return hasattr(torch.ops.aten, _OP_INPLACE)


def flash_varlen_rejects(
    query: torch.Tensor,
    kv: PagedKV,
    *,
    causal: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    tree_mask: torch.Tensor | None,
) -> str | None:
    """Why the flash varlen path does not take this call (None when it does)."""
    if query.dtype not in HALF_DTYPES:
        return f"dtype={query.dtype}, takes float16/bfloat16"
    if kv.dequant is not Dequant.NONE:
        return f"kv_cache_dtype={kv.cache_dtype!r}, takes auto (fp8 runs the paged kernel)"
    if kv.key.data.dtype != query.dtype:
        return f"cache dtype {kv.key.data.dtype}, takes the query's {query.dtype}"
    if kv.head_size != kv.head_size_v:
        return f"head_size={kv.head_size} and head_size_v={kv.head_size_v}, takes one head size"
    if kv.head_size % 8 or kv.head_size > MAX_HEAD_SIZE:
        return f"head_size={kv.head_size}, takes a multiple of 8 up to {MAX_HEAD_SIZE}"
    if logits_soft_cap is not None:
        return f"logits_soft_cap={logits_soft_cap}, takes none"
    if tree_mask is not None:
        return "a draft-tree mask"
    if sliding_window is not None and not causal:
        return f"sliding_window={sliding_window} on non-causal attention, takes causal only"
    return None


def flash_varlen_worth_it(batch: PagedBatchLike, kv: PagedKV, num_heads: int,
                          element_size: int, *, causal: bool,
                          sliding_window: int | None) -> str | None:
    """Why the batch is not worth the flash path (None when it is): the paged Triton
    kernel's launch for it measured faster (:func:`triton_measured_faster`), or its
    copies are too large a share of the work.

    Work: ``2 * q_len * visible_keys * (D + Dv) * Hq`` FLOPs a request. Copies: the
    gather writes and the kernel re-reads each block, plus, without the out-variant,
    the result copied into ``output``. Reads only the host copies of the lengths.
    """
    if batch.num_reqs == 0:
        return "an empty batch"
    # An exact bound first, from ints (decode batches stop here, before any tensor
    # arithmetic: this runs on every call of the portable path). A request's FLOPs per
    # copied byte are at most q_len * num_heads / (num_kv_heads * element_size): its
    # visible keys never exceed seq_len, and its copied blocks hold at least seq_len rows.
    need = FLOPS_PER_BYTE / MAX_COPY_SHARE
    bound = batch.max_query_len * num_heads / (kv.num_kv_heads * element_size)
    if bound < need:
        return (f"at most {bound:.0f} FLOPs per copied byte (max_query_len="
                f"{batch.max_query_len}), takes >= {need:.0f} (a compute-heavy prefill)")
    faster = triton_measured_faster(batch, kv, num_heads, element_size)
    if faster is not None:
        return faster
    starts = batch.query_start_loc_cpu.to(torch.int64)
    q = (starts[1:] - starts[:-1]).double()
    k = batch.seq_lens_cpu.to(torch.double)
    visible = (k - (q - 1) / 2).clamp(min=0) if causal else k
    if sliding_window is not None:
        visible = visible.clamp(max=float(sliding_window))
    d = kv.head_size + kv.head_size_v
    flops = float((2 * q * visible).sum()) * d * num_heads
    bs = kv.block_size
    blocks = float(torch.ceil(k / bs).sum())
    copied = 2 * blocks * bs * kv.num_kv_heads * d * element_size
    if not writes_in_place():
        copied += 2 * float(q.sum()) * num_heads * kv.head_size_v * element_size
    if copied * FLOPS_PER_BYTE > MAX_COPY_SHARE * flops:
        return (f"{flops / max(copied, 1.0):.0f} FLOPs per copied byte, takes >= "
                f"{need:.0f} (a compute-heavy prefill)")
    return None


TRITON_MEASURED_ON = ((9, 0),)
"""Compute capabilities where the paged Triton kernel's long-prefill launch was timed
against this path (H200, 2026-12-01)."""


def triton_measured_faster(batch: PagedBatchLike, kv: PagedKV, num_heads: int,
                           element_size: int) -> str | None:
    """Why the paged Triton kernel runs this batch instead (None: it was not measured
    faster): on a device of :data:`TRITON_MEASURED_ON`, a batch for which
    ``choose_config`` picks a long-prefill launch (``LONG_PREFILL``: 128-row tiles,
    16-bit, D <= 128; ``WIDE_PREFILL``: 256-row tiles, unquantised caches). There, on an
    H200 x torch's dense flash kernel, the Triton kernel ran 0.929 (8 x 2048 new tokens)
    and 0.937 (8 x (2048 cached + 2048 new)) with 128-row tiles, 1.034 and 1.126 with
    256-row tiles; this path, copies included, 0.813 and 0.920 (docs/paged_attention.md)."""
    if element_size != 2:
        return None
    if nvidia_capability(kv.device) not in TRITON_MEASURED_ON:  # cached per device
        return None
    from vllm.attention.ops.triton_paged_attention import choose_config, is_long_prefill_launch

    cfg = choose_config(kv, num_heads=num_heads, num_reqs=batch.num_reqs,
                        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
                        query_dtype=torch.bfloat16)
    if not is_long_prefill_launch(cfg):
        return None
    return (f"the paged Triton kernel's long-prefill launch ({cfg.block_m}-row tiles) "
            "measured faster on this device: 0.93-1.13 x the flash kernel against "
            "0.81-0.95 with the copies")


def _rows(op: PagedOperand, ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks ``ids`` of ``op`` as rows ``[len(ids) * bs, H, D]`` (storage dtype)."""
    n = ids.shape[0]
    picked = op.block_view().index_select(0, ids)  # [n, bs/ts, ts, H, D/ds, ds]: one copy
    return picked.reshape(n * op.block_size, op.num_heads, op.head_size)


def gather_blocks(kv: PagedKV, batch: PagedBatchLike
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every request's blocks, packed: K ``[n * bs, H, D]``, V ``[n * bs, H, Dv]`` in the
    cache's dtype (``n = sum(ceil(seq_lens / bs))``), and ``cu_k`` int32 ``[num_reqs + 1]``,
    request ``i``'s first row. No host sync: sizes come from the ``*_cpu`` lengths."""
    bs = kv.block_size
    dev = kv.device
    lens = batch.seq_lens.to(torch.int64)
    nblk = (lens + bs - 1) // bs
    first = torch.zeros(batch.num_reqs + 1, dtype=torch.int64, device=dev)
    first[1:] = torch.cumsum(nblk, 0)
    total = int(((batch.seq_lens_cpu.to(torch.int64) + bs - 1) // bs).sum())
    req = torch.repeat_interleave(torch.arange(batch.num_reqs, device=dev), nblk,
                                  output_size=total)
    j = torch.arange(total, device=dev) - first[req]
    ids = batch.block_table[req, j].to(torch.int64)
    return _rows(kv.key, ids), _rows(kv.value, ids), (first * bs).to(torch.int32)


def aten_varlen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       cu_q: torch.Tensor, cu_k: torch.Tensor, seqused_k: torch.Tensor,
                       max_q: int, max_k: int, causal: bool, scale: float,
                       window_left: int | None, out: torch.Tensor) -> None:
    """:class:`FlashVarlenKernel` through ``aten._flash_attention_forward`` (its
    out-variant where this torch has it)."""
    kwargs: dict[str, Any] = {"scale": scale, "seqused_k": seqused_k}
    if window_left is not None:
        kwargs["window_size_left"] = window_left
        kwargs["window_size_right"] = 0
    ops: Any = torch.ops.aten
    if writes_in_place():
        ops._flash_attention_forward_no_dropout_inplace(
            out, q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, **kwargs)
        return
    result = ops._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                          False, **kwargs)
    out.copy_(result[0])


def paged_attention_flash_varlen(
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
    kernel: FlashVarlenKernel | None = None,
) -> torch.Tensor:
    """Paged attention by the flash varlen kernel; arguments as
    :func:`~vllm.attention.ops.paged_attention.paged_attention_torch`.

    ``kernel``: the varlen attention to call (default: torch's flash kernel, CUDA only).
    Raises :class:`~vllm.attention.errors.InvalidArgumentError` for a call it does not
    take (:func:`flash_varlen_rejects`) or a device it cannot run on.
    """
    num_tokens = check_paged_args(query, kv, batch, output, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, tree_mask=tree_mask)
    run: FlashVarlenKernel
    if kernel is None:
        reason = flash_varlen_unavailable(kv.device)
        if reason is not None:
            raise InvalidArgumentError("kv_cache.device", str(kv.device),
                                       f"a device torch's flash kernel runs on: {reason}")
        run = aten_varlen_kernel
    else:
        run = kernel
    why = flash_varlen_rejects(query, kv, causal=causal, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, tree_mask=tree_mask)
    if why is not None:
        raise InvalidArgumentError("call", "this call", f"one the flash varlen path takes: {why}")
    if num_tokens == 0:
        return output
    if causal:
        starts = batch.query_start_loc_cpu
        short = (batch.seq_lens_cpu < starts[1:] - starts[:-1]).nonzero()
        if short.numel():
            i = int(short[0])
            raise InvalidArgumentError(f"seq_lens[{i}]", int(batch.seq_lens_cpu[i]),
                                       f">= its query length {int(starts[i + 1] - starts[i])}")
    k, v, cu_k = gather_blocks(kv, batch)
    q = query[:num_tokens]
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = output[:num_tokens]
    direct = out.dtype == q.dtype and out.stride(-1) == 1 and out.stride(1) == out.shape[2]
    dst = out if direct else torch.empty(out.shape, dtype=q.dtype, device=out.device)
    run(q, k, v, cu_q=batch.query_start_loc.to(torch.int32).contiguous(), cu_k=cu_k,
        seqused_k=batch.seq_lens.to(torch.int32).contiguous(), max_q=batch.max_query_len,
        max_k=max(batch.max_seq_len, 1), causal=causal, scale=scale,
        window_left=None if sliding_window is None else sliding_window - 1, out=dst)
    if not direct:
        out.copy_(dst)
    return output


def reference_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, seqused_k: torch.Tensor, max_q: int, max_k: int,
                     causal: bool, scale: float, window_left: int | None,
                     out: torch.Tensor) -> None:
    """:class:`FlashVarlenKernel` in float64 torch, one request at a time: what the flash
    kernel is documented to compute, so the glue around it can be checked without CUDA."""
    from vllm.attention.ops.reference import attend

    window = None if window_left is None else window_left + 1
    for i in range(cu_q.shape[0] - 1):
        qs, qe = int(cu_q[i]), int(cu_q[i + 1])
        ks = int(cu_k[i])
        ke = ks + int(seqused_k[i])
        if qe > qs:
            res = attend(q[qs:qe].double(), k[ks:ke].double(), v[ks:ke].double(), scale=scale,
                         causal=causal, sliding_window=window)
            out[qs:qe] = res.to(out.dtype)


__all__ = [
    "FlashVarlenKernel",
    "flash_varlen_rejects",
    "flash_varlen_unavailable",
    "flash_varlen_worth_it",
    "gather_blocks",
    "paged_attention_flash_varlen",
    "reference_kernel",
    "writes_in_place",
]
