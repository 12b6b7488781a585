"""Launch the Triton paged attention kernels (prefill, decode, split-K decode).

Importing this module never imports Triton; the kernels
(:mod:`vllm.attention.ops.triton_paged_kernels`) load on first use. Under
``TRITON_INTERPRET=1`` (set before Triton kernels are first imported) the same
kernels run on CPU tensors, which is how they are tested without a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from vllm.attention.env import env_flag
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.paged_args import PagedBatchLike, check_paged_args
from vllm.attention.ops.paged_kv import Dequant, PagedKV
from vllm.attention.types import KVCacheLayout
from vllm.attention.writers.kernels.device import (
    multiprocessors,
    next_pow2,
    nvidia_capability,
)

_KERNELS = "vllm.attention.ops.triton_paged_kernels"
LOG2E = math.log2(math.e)
MIN_SPLIT_TOKENS = 256
"""Split-K gives each split at least this many keys."""
MAX_SPLITS = 32


@functools.cache
def triton_import_error() -> str | None:
    """Why ``import triton`` fails here (None when it works)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # any import-time failure means "no Triton path"
        return f"{type(exc).__name__}: {exc}"
    return None


def _kernels() -> ModuleType:
    from vllm.attention.ops.triton_loader import load_kernel_module

    return load_kernel_module(_KERNELS, interpret=interpreter_active())


def interpreter_active() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET`` set)."""
    return env_flag("TRITON_INTERPRET")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None when they can)."""
    err = triton_import_error()
    if err is not None:
        return f"triton is not importable ({err})"
    if device.type == "cuda":
        return None if not interpreter_active() else "TRITON_INTERPRET=1 runs kernels on CPU only"
    if device.type == "cpu" and interpreter_active():
        return None
    return f"device={device.type}, the Triton kernels need cuda (or cpu with TRITON_INTERPRET=1)"


def triton_rejects(kv: PagedKV) -> str | None:
    """Why the Triton kernel does not take this cache (None when it does).

    fp8 DiffKV (K and V head sizes differ) gave wrong results on an H200
    (2026-11-30; relative error 0.5, no memory error under compute-sanitizer)
    while the interpreter agreed with the reference; no backend declares that
    combination, so it runs the torch path until the cause is found.
    """
    if kv.layout is KVCacheLayout.DIFFKV_PACKED and kv.dequant is not Dequant.NONE:
        return "an unquantised (auto) DiffKV cache on the Triton path; fp8 DiffKV runs on torch"
    return None


@dataclass(frozen=True)
class TritonLaunchConfig:
    """Tile sizes and split count of one launch (:func:`choose_config` picks them)."""

    block_m: int
    """Query rows per program (query tokens x query heads of one kv head), a power of 2."""
    block_n: int
    """Keys per loop step, a power of 2 >= 16."""
    num_splits: int
    """Chunks of the key range (1: no split-K)."""
    num_warps: int = 4
    num_stages: int = 2
    split_masks: bool = False
    """Run the key tiles every row sees without masks, masking only the edge tiles
    (the causal diagonal, the window's start, the last partial tile). Prefill only:
    decode launches keep the one masked loop they were tuned with. Needs ``scale > 0``
    (ignored otherwise)."""
    reverse_tiles: bool = False
    """Launch query tiles last-first, so the longest (causal) tiles start first."""


@functools.cache  # called on every decode launch, with few distinct arguments
def split_heuristic(*, programs: int, num_sms: int, max_splits: int) -> int:
    """Fewest splits whose last wave of programs is nearly full.

    With ``n`` splits there are ``programs * n`` programs, i.e. ``w = programs * n /
    num_sms`` waves whose efficiency is ``w / ceil(w)``; take the smallest ``n`` within
    85% of the best efficiency (more splits cost a reduce and more partial traffic).
    """
    if max_splits <= 1:
        return 1
    effs = []
    for n in range(1, max_splits + 1):
        waves = programs * n / num_sms
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    return next(n for n, e in enumerate(effs, start=1) if e >= 0.85 * best)


def choose_config(
    kv: PagedKV,
    *,
    num_heads: int,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    query_dtype: torch.dtype,
    num_splits: int | None = None,
) -> TritonLaunchConfig:
    """The launch heuristic.

    Decode-shaped batches (every request's queries fit one tile) use ``block_m=16``
    and, for contexts of at least ``2 * MIN_SPLIT_TOKENS``, split the key range by
    :func:`split_heuristic` (few programs -> more splits). Prefill uses ``block_m=64``
    (128 for long prompts with few heads per group: :data:`LONG_PREFILL` for 16-bit
    queries and heads up to 128).
    """
    group = num_heads // kv.num_kv_heads
    small_m = max(16, next_pow2(group))
    rows = max(1, max_query_len) * group
    decode = rows <= small_m
    if decode:
        block_m = small_m
    else:
        block_m = max(next_pow2(group), 128 if rows >= 4096 and group <= 8 else 64)
    wide = max(kv.head_size, kv.head_size_v)
    fp32 = query_dtype == torch.float32
    block_n = 64 if wide <= 128 and not fp32 else 32
    if block_m >= 128:
        block_n = min(block_n, 32 if wide > 128 else 64)
    if num_splits is None:
        num_splits = 1
        if decode and max_seq_len >= 2 * MIN_SPLIT_TOKENS:
            device = kv.device
            sms = multiprocessors(device) if device.type == "cuda" else 132
            num_splits = split_heuristic(
                programs=max(1, num_reqs * kv.num_kv_heads), num_sms=sms,
                max_splits=min(MAX_SPLITS, max_seq_len // MIN_SPLIT_TOKENS),
            )
    if num_splits < 1:
        raise InvalidArgumentError("num_splits", num_splits, ">= 1")
    num_warps = 4 if block_m * block_n <= 64 * 64 else 8
    num_stages = 3
    if block_m >= 128 and wide <= 128 and not fp32:
        block_n, num_warps, num_stages = LONG_PREFILL
        if wide > 64 and kv.dequant is Dequant.NONE and wide_prefill_measured(kv.device):
            block_m, block_n, num_warps, num_stages = WIDE_PREFILL
    return TritonLaunchConfig(block_m=block_m, block_n=block_n, num_splits=num_splits,
                              num_warps=num_warps, num_stages=num_stages, split_masks=not decode,
                              reverse_tiles=not decode)


LONG_PREFILL = (32, 4, 4)
"""``(block_n, num_warps, num_stages)`` of 128-row prefill tiles (16-bit, D <= 128).

``benchmarks/tune_prefill.py`` on an H200 (2026-12-01, 32 query / 8 kv heads, D=128,
bf16, page 16; x torch's flash kernel, higher is better):

=====================  ================  ======================
launch                 fresh 8 x 2048    chunked 8 x (2048+2048)
=====================  ================  ======================
n32, 4 warps, 4 st.    **0.929**         0.937
n32, 4 warps, 3 st.    0.912             0.925
n64, 4 warps, 4 st.    0.892             **0.949**
n64, 4 warps, 3 st.    0.887             0.943
n64, 8 warps, 3 st.    0.824 (before)    0.890 (before)
=====================  ================  ======================

The first has the best worst case (and geometric mean) of the two targets; the raw
rows are in ``benchmarks/results/h200/2026-12-01-04633ad-modified/tune_prefill.txt``.
Other head sizes and fp32 keep the earlier rule (32-key tiles there, 3 stages).
"""


WIDE_PREFILL = (256, 64, 8, 3)
"""``(block_m, block_n, num_warps, num_stages)`` of long prefills on the devices of
:data:`WIDE_PREFILL_ON`, for 16-bit queries over an unquantised (``auto``) cache with
heads of 65-128: 256-row tiles (64 tokens x 4 heads at a group of 4), two warpgroups,
64-key tiles. On an H200 (2026-12-01, the targets' shapes, x torch's flash kernel, device
time with the queue filled): 1.027 fresh and 1.097 chunked at 32 / 8 heads, 1.053 / 1.155
at 64 / 8, against 0.934 / 0.939 and 0.888 / 0.920 for :data:`LONG_PREFILL` in the same
runs (``docs/paged_attention.md``). Its tiles (64 KiB of
queries, 96 KiB of keys and values in flight) exceed the shared memory of sm_86/sm_89;
fp8 caches (widened in registers) and other devices keep :data:`LONG_PREFILL`."""

WIDE_PREFILL_ON = ((9, 0),)
"""Compute capabilities where :data:`WIDE_PREFILL` was measured."""


def wide_prefill_measured(device: torch.device) -> bool:
    """Whether long prefills on ``device`` take :data:`WIDE_PREFILL` (NVIDIA devices of
    :data:`WIDE_PREFILL_ON`, as :func:`~vllm.attention.writers.kernels.device.gpu_of`
    reports them; never under the interpreter or on ROCm)."""
    return not interpreter_active() and nvidia_capability(device) in WIDE_PREFILL_ON


def is_long_prefill_launch(cfg: TritonLaunchConfig) -> bool:
    """Whether ``cfg`` is one of the measured long-prefill launches
    (:data:`LONG_PREFILL`, :data:`WIDE_PREFILL`)."""
    if (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == WIDE_PREFILL:
        return True
    return cfg.block_m >= 128 and (cfg.block_n, cfg.num_warps, cfg.num_stages) == LONG_PREFILL


def paged_attention_triton(
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
    num_splits: int | None = None,
    config: TritonLaunchConfig | None = None,
) -> torch.Tensor:
    """Paged attention with the Triton kernels; arguments as
    :func:`~vllm.attention.ops.paged_attention.paged_attention_torch`.

    ``num_splits`` forces the split-K count (1 disables it); ``config`` overrides the
    whole launch heuristic (:func:`choose_config`). Only the host tensors
    ``query_start_loc_cpu`` and the ints of ``batch`` are read on the host.
    """
    reason = triton_unavailable_reason(kv.device)
    if reason is not None:
        raise InvalidArgumentError("kv_cache.device", str(kv.device), f"a device Triton runs on: {reason}")
    rejected = triton_rejects(kv)
    if rejected is not None:
        raise InvalidArgumentError("kv_cache", f"{kv.layout.value} {kv.dequant.name}", rejected)
    num_tokens = check_paged_args(query, kv, batch, output, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, tree_mask=tree_mask)
    if num_tokens == 0:
        return output
    hq = query.shape[1]
    cfg = config or choose_config(
        kv, num_heads=hq, num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, query_dtype=query.dtype, num_splits=num_splits,
    )
    group = hq // kv.num_kv_heads
    if cfg.block_m < max(16, group) or cfg.block_m & (cfg.block_m - 1):
        raise InvalidArgumentError("config.block_m", cfg.block_m, f"a power of 2 >= max(16, {group})")
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        raise InvalidArgumentError("config.block_n", cfg.block_n, "a power of 2 >= 16")
    if cfg.num_splits < 1:
        raise InvalidArgumentError("config.num_splits", cfg.num_splits, ">= 1")
    block_q = cfg.block_m // group

    q = query if query.stride(2) == 1 else query.contiguous()
    out = output if output.stride(2) == 1 else torch.empty_like(output, memory_format=torch.contiguous_format)

    k, v = kv.key, kv.value
    k_data, v_data = k.data, v.data
    if kv.dequant is Dequant.PER_TOKEN_HEAD and k.scales is not None and v.scales is not None:
        ks, vs = k.scales, v.scales
        ks_strides = tuple(ks.stride())
        vs_strides = tuple(vs.stride())
    else:
        ks, vs = kv.k_scale, kv.v_scale
        ks_strides = (0, 0, 1 if ks.numel() > 1 else 0)
        vs_strides = (0, 0, 1 if vs.numel() > 1 else 0)
    if tree_mask is not None:
        tree = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        tree = tree if tree.stride(1) == 1 else tree.contiguous()
        tree_arg, tree_s = tree, int(tree.stride(0))
    else:
        tree_arg, tree_s = batch.seq_lens, 0  # unused

    if logits_soft_cap is not None:
        qk_scale = 2.0 * scale * LOG2E / logits_soft_cap
        softcap_log2 = logits_soft_cap * LOG2E
    else:
        qk_scale, softcap_log2 = scale * LOG2E, 0.0

    splits = cfg.num_splits
    dv = kv.head_size_v
    if splits > 1:
        acc = torch.empty(num_tokens, hq, splits, dv, dtype=torch.float32, device=q.device)
        ws_m = torch.empty(num_tokens, hq, splits, dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        dst, dst_s_t, dst_s_h = acc, hq * splits * dv, splits * dv
    else:
        ws_m = ws_l = kv.k_scale  # unused
        dst, dst_s_t, dst_s_h = out, int(out.stride(0)), int(out.stride(1))

    kern = _kernels()
    grid = (num_tokens // block_q + batch.num_reqs, kv.num_kv_heads, splits)
    ksb, ksh, ksth, kstl, ksdh, ksdl = k.strides
    vsb, vsh, vsth, vstl, vsdh, vsdl = v.strides
    launch: Any = kern.paged_attention_kernel[grid]
    launch(
        dst, dst_s_t, dst_s_h,
        q, int(q.stride(0)), int(q.stride(1)),
        k_data, ksb, ksh, ksth, kstl, ksdh,
        v_data, vsb, vsh, vsth, vstl, vsdh,
        ks, *ks_strides,
        vs, *vs_strides,
        batch.block_table, int(batch.block_table.stride(0)),
        batch.query_start_loc, batch.seq_lens,
        tree_arg, tree_s,
        ws_m, ws_l, hq * splits,
        qk_scale, softcap_log2, int(sliding_window or 0), batch.num_reqs,
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
        HEAD_K=kv.head_size, HEAD_V=dv,
        HEAD_K_PAD=max(16, next_pow2(kv.head_size)), HEAD_V_PAD=max(16, next_pow2(dv)),
        BLOCK_SIZE=kv.block_size,
        K_TS=k.token_split, K_DS=k.dim_split, K_SDL=ksdl,
        V_TS=v.token_split, V_DS=v.dim_split, V_SDL=vsdl,
        DEQUANT=int(kv.dequant), CAUSAL=causal and tree_mask is None,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logits_soft_cap is not None,
        HAS_TREE=tree_mask is not None, FP32_DOT=q.dtype == torch.float32,
        NUM_SPLITS=splits, INTERPRETER=interpreter_active(),
        SPLIT_MASKS=cfg.split_masks and scale > 0,  # unmasked tiles fold a positive scale
        REVERSE_TILES=cfg.reverse_tiles,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        reduce: Any = kern.reduce_splits_kernel[(num_tokens, hq)]
        reduce(
            out, int(out.stride(0)), int(out.stride(1)), acc, ws_m, ws_l, hq,
            NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits), HEAD_V=dv,
            HEAD_V_PAD=max(16, next_pow2(dv)), num_warps=4,
        )
    if out is not output:
        output[:num_tokens].copy_(out[:num_tokens])
    return output
