"""One matrix product a head: MLA's query absorption and output projection.

``head_matmul(a, w)`` computes ``C[t, n, :] = A[t, n, :] @ W[n]`` for ``a`` ``[T, N, K]``
and ``w`` ``[N, K, C]``: ``q_nope @ W_UK`` (``K = P``, ``C = L``) before an absorbed
decode and ``o_lat @ W_UV`` (``K = L``, ``C = V``) after it.

At decode batch sizes both are reads of the weight (``N K C`` elements, 16 MiB at
DeepSeek-V3's 128 heads) with little arithmetic, and in a layer the weight comes cold
from memory (the decode before has streamed the cache through L2). The Triton kernel
of :mod:`vllm.attention.ops.triton_head_matmul_kernels` runs one program per head and
column tile. On the H200, at 128 heads and up to 64 rows, it takes 0-8 % less time
than ``torch.bmm`` (cuBLAS) with the weights cold, and about 2 us off a 170 us decode
layer; at 64 heads and fewer, or from 128 rows, cuBLAS is as fast or faster
(``benchmarks/bench_head_matmul.py``; ``docs/mla.md`` has the figures). So it is the
default on NVIDIA sm_90+ GPUs, 16-bit operands, from :data:`TRITON_MIN_HEADS` heads up
to :data:`TRITON_MAX_TOKENS` rows, and ``torch.bmm`` everywhere else.
Both accumulate in float32 and round once to the operands' dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.triton_loader import interpreting
from vllm.attention.types import HALF_DTYPES
from vllm.attention.writers.kernels.device import next_pow2, nvidia_capability

HeadMatmulPath = Literal["triton", "bmm"]

TRITON_MAX_TOKENS = 64
"""Rows (decode tokens) up to which :func:`head_matmul_path` picks the Triton kernel (at
80-128 rows and 128 heads cuBLAS was faster on an H200, docs/mla.md)."""

TRITON_MIN_HEADS = 128
"""Heads from which :func:`head_matmul_path` picks the Triton kernel (at 64 heads the
projection was slower than cuBLAS with every tile tried, the absorption no faster)."""



@dataclasses.dataclass(frozen=True)
class HeadMatmulConfig:
    """Launch parameters of the Triton kernel."""

    block_t: int
    block_c: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def default_config(t: int, k: int, c: int) -> HeadMatmulConfig:
    """Tiles for ``t`` rows, ``k`` inner and ``c`` output columns a head: a small ``K``
    (the absorption, ``K = 128``) in two slices over wide column tiles; a long ``K``
    (the projection, ``K = 512``) pipelined over narrower ones (at 128 heads and 64
    rows, no tile of ``benchmarks/bench_head_matmul.py --sweep`` beat these by more
    than its noise)."""
    block_t = min(64, max(16, next_pow2(t)))
    block_c = max(16, next_pow2(c))
    if k <= 128:
        return HeadMatmulConfig(block_t, min(128, block_c), 64, 4, 2)
    return HeadMatmulConfig(block_t, min(64, block_c), 64, 4, 3)


def unsupported_reasons(a: torch.Tensor, w: torch.Tensor) -> list[str]:
    """Why the Triton kernel does not take ``a @ w`` (empty: it does)."""
    reasons = []
    if a.device.type != "cuda":
        reasons.append(f"device {a.device}: the kernel runs on CUDA GPUs")
    else:
        cap = nvidia_capability(a.device)
        if cap is None or cap < (9, 0):
            reasons.append(f"GPU capability {cap} (or not NVIDIA): the kernel is measured "
                           "against cuBLAS on NVIDIA sm_90+ only")
    if a.dtype not in HALF_DTYPES or w.dtype != a.dtype:
        reasons.append(f"dtypes {a.dtype} x {w.dtype}: the kernel takes float16 or "
                       "bfloat16, the same for both")
    if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
        reasons.append("autograd: the kernel has no backward")
    return reasons


def _check(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    if a.dim() != 3:
        raise InvalidArgumentError("a.shape", tuple(a.shape), "[T, N, K]")
    t, n, k = a.shape
    if w.dim() != 3 or w.shape[0] != n or w.shape[1] != k:
        raise InvalidArgumentError("w.shape", tuple(w.shape), f"[N={n}, K={k}, C]")
    if w.device != a.device:
        raise InvalidArgumentError("w.device", w.device, f"a's device {a.device}")
    if out is not None:
        want = (t, n, w.shape[2])
        if tuple(out.shape) != want:
            raise InvalidArgumentError("out.shape", tuple(out.shape), f"{list(want)}")
        if out.dtype != a.dtype or out.device != a.device:
            raise InvalidArgumentError("out", (out.dtype, out.device),
                                       f"a's dtype and device ({a.dtype}, {a.device})")


def head_matmul_path(a: torch.Tensor, w: torch.Tensor) -> HeadMatmulPath:
    """The path :func:`head_matmul` takes for these operands: the Triton kernel where it
    runs and was measured faster than cuBLAS (at most :data:`TRITON_MAX_TOKENS` rows, at
    least :data:`TRITON_MIN_HEADS` heads), else ``torch.bmm``."""
    if unsupported_reasons(a, w):
        return "bmm"
    faster = a.shape[0] <= TRITON_MAX_TOKENS and a.shape[1] >= TRITON_MIN_HEADS
    return "triton" if faster else "bmm"


def head_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                path: HeadMatmulPath | None = None,
                config: HeadMatmulConfig | None = None) -> torch.Tensor:
    """``[T, N, K] @ [N, K, C] -> [T, N, C]`` per head, in ``a.dtype``.

    Args:
        a: ``[T, N, K]``, any strides.
        w: ``[N, K, C]`` in ``a``'s dtype, on its device.
        out: ``[T, N, C]`` (any strides, ``a``'s dtype): written in place and returned.
        path: force ``"triton"`` (an error where :func:`unsupported_reasons` says it
            cannot run, except under ``TRITON_INTERPRET=1`` on CPU tensors) or
            ``"bmm"``; default :func:`head_matmul_path`.
        config: the Triton kernel's tiles (default :func:`default_config`).
    """
    _check(a, w, out)
    if path not in (None, "triton", "bmm"):
        raise InvalidArgumentError("path", path, "'triton', 'bmm' or None")
    interp = interpreting() and a.device.type == "cpu"
    if path is None:
        path = head_matmul_path(a, w)
    elif path == "triton" and not interp:
        reasons = unsupported_reasons(a, w)
        if reasons:
            raise InvalidArgumentError("path", path, "a path that runs here: "
                                       + "; ".join(reasons))
    if path == "bmm":
        return _bmm(a, w, out)
    t, n, k = a.shape
    c = w.shape[2]
    if out is None:
        out = torch.empty(t, n, c, dtype=a.dtype, device=a.device)
    if t == 0 or n == 0 or c == 0:
        return out
    if interp and a.dtype == torch.bfloat16:
        # Triton's CPU interpreter gets bfloat16 dots wrong (as in triton_mla): there the
        # kernel runs on float32 copies (the same products: float32 accumulation, one
        # rounding into ``out``)
        return out.copy_(head_matmul(a.float(), w.float(), path="triton", config=config))
    cfg = config or default_config(t, k, c)
    _kernel(interp)[(n, -(-c // cfg.block_c), -(-t // cfg.block_t))](
        a, w, out, t,
        a.stride(0), a.stride(1), a.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        K=k, C=c, BLOCK_T=cfg.block_t, BLOCK_C=cfg.block_c, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, EVEN_C=c % cfg.block_c == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _kernel(interpret: bool) -> Any:
    from vllm.attention.ops.triton_loader import load_kernel_module

    return load_kernel_module("vllm.attention.ops.triton_head_matmul_kernels",
                              interpret=interpret).head_matmul_kernel


def _bmm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.bmm(a.transpose(0, 1), w).transpose(0, 1)
    if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
        # out= takes no part in autograd
        return out.copy_(torch.bmm(a.transpose(0, 1), w).transpose(0, 1))
    torch.bmm(a.transpose(0, 1), w, out=out.transpose(0, 1))
    return out
