"""Dense MLA decode on tensor cores: heads as the M dimension, split-KV, one combine.

The kernels are in :mod:`vllm.attention.ops.triton_mla_decode_kernels`. A program
takes ``BLOCK_H`` heads of one token and one split of its keys and streams the
latent rows ``BLOCK_N`` at a time through two ``tl.dot`` products (``Q @ K^T`` and
``P @ V``, ``V`` the first ``L`` values of the same rows), so each row is read once
per head tile instead of once per head. Native 16-bit caches and scaled fp8
(E4M3 / E5M2, ``k_scale`` folded into the scores and the output) run here; the
``fp8_ds_mla`` entry and the sparse top-k path keep the per-row kernel of
:mod:`vllm.attention.ops.triton_mla`. ``docs/mla.md`` gives the design and its
limits. Triton is imported on first use only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops.mla_attention import LatentFormat
from vllm.attention.ops.triton_loader import interpreting
from vllm.attention.types import HALF_DTYPES
from vllm.attention.writers.kernels.device import GPU, gpu_of, multiprocessors, next_pow2

MAX_SPLITS = 64
"""The most splits of one token's keys (the combine kernel unrolls over them)."""
_MAX_BOX = 256
"""The widest latent chunk of a two-chunk launch (``latent_chunks=2``); a latent at most
this wide is one chunk."""
_FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters of the decode kernel.

    ``block_h`` heads and ``block_n`` cached rows a tile (powers of two, at least 16:
    ``tl.dot``'s minimum; heads past the layer's are masked);
    ``v_split`` 2 gives each half of the latent's values its own program (both
    compute the scores); ``num_splits`` None: chosen per call from the batch, the
    head tiles, the context and the device (:func:`choose_splits`); ``tma``: load
    whole tiles with the Tensor Memory Accelerator where the device and the cache
    allow it (sm_90+, rows contiguous and 16-byte aligned); ``heads_as_n``: the heads
    as the N of both MMAs (``S^T = K Q^T``, ``O^T += K^T P^T``) instead of their M, for
    layers with few heads (M is at least 64 rows on Hopper); ``latent_chunks``: the
    latent's columns in one dot and one load (1) or two halves (2; ``v_split`` 2
    needs them); ``split_scores``: the warps of the score dots split the keys instead
    of all lying along the heads (``docs/mla.md``: with 64 heads and 8 warps, both
    warpgroups would otherwise compute every score); ``fp8_fp16_dot``: with an fp8
    cache and a bfloat16 model, the dots run in float16 (one instruction widens two
    E4M3 values to float16, three to bfloat16; the query is scaled into float16's range
    exactly, a power of two a head); ``gluon``: on NVIDIA sm_90 with a 16-bit model,
    the Gluon kernel of :mod:`vllm.attention.ops.gluon_mla_decode_kernels` (its own
    tiles: 64 heads, 64 rows, 8 warps, two key buffers), where
    :func:`gluon_unsupported_reasons` is empty; elsewhere the fields above;
    ``lead`` (with ``gluon``; the default): the kernel of
    :mod:`vllm.attention.ops.gluon_mla_lead_kernels` instead, one warpgroup computing
    every score and the other only applying the probabilities, beside a loader warp
    (16-bit caches) or a widening warpgroup (scaled fp8 caches);
    ``fp8_mma`` (with ``lead``, an E4M3 cache, a latent of 512 and a rope of 64): the
    kernel of :mod:`vllm.attention.ops.gluon_mla_fp8_kernels` instead, whose MMAs run on
    fp8 tensor cores, the query and the probabilities rounded to E4M3 (FlashMLA's fp8
    numerics; less exact than the default, which rounds neither: ``docs/mla.md``);
    ``few_heads`` (with ``lead``; the default): layers of at most
    :data:`FEW_HEADS_MAX` heads run the kernel of
    :mod:`vllm.attention.ops.gluon_mla_few_heads_kernels`, the heads as the N of both
    MMAs (the lead kernel's arithmetic, a quarter of its tensor work at 16 heads), where
    :func:`few_heads_unsupported_reasons` is empty and ``fp8_mma`` does not take the
    decode (an explicit request is honoured, though at 16 heads the few-heads kernel is
    now the faster of the two with an fp8 cache, and exact: ``docs/mla.md``);
    ``few_heads_64`` (with ``few_heads``; opt-in): past :data:`FEW_HEADS_MAX` heads, an
    E4M3 cache with a bfloat16 query runs the few-heads kernel too, 64 heads a program
    (the scores with the heads as rows, the values with the heads as N; measured in
    ``docs/mla.md``, not the default).
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int | None = None
    v_split: int = 1
    tma: bool = True
    latent_chunks: int = 2
    split_scores: bool = False
    fp8_fp16_dot: bool = True
    heads_as_n: bool = False
    gluon: bool = False
    lead: bool = True
    fp8_mma: bool = False
    few_heads: bool = True
    few_heads_64: bool = False

    def __post_init__(self) -> None:
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise InvalidArgumentError(name, v, "a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise InvalidArgumentError("num_warps", self.num_warps, "1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise InvalidArgumentError("num_stages", self.num_stages, "a positive int")
        if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
            raise InvalidArgumentError("num_splits", self.num_splits,
                                       f"None or 1..{MAX_SPLITS}")
        if self.v_split not in (1, 2):
            raise InvalidArgumentError("v_split", self.v_split, "1 or 2")
        if self.latent_chunks not in (1, 2) or self.latent_chunks < self.v_split:
            raise InvalidArgumentError("latent_chunks", self.latent_chunks,
                                       "1 or 2, and 2 with v_split=2")


def unsupported_reasons(fmt: LatentFormat, q_dtype: torch.dtype) -> list[str]:
    """Why the tensor-core kernel cannot take this decode (empty: it can)."""
    reasons = []
    if fmt.cache_dtype == "fp8_ds_mla":
        reasons.append("kv_cache_dtype='fp8_ds_mla' (128-value tile scales): the per-row "
                       "kernel runs it")
    if q_dtype not in (*HALF_DTYPES, torch.float32):
        reasons.append(f"query dtype {q_dtype}, the kernel takes float16, bfloat16, float32")
    if fmt.kv_lora_rank > 2 * _MAX_BOX:
        reasons.append(f"kv_lora_rank={fmt.kv_lora_rank}, the kernel takes at most "
                       f"{2 * _MAX_BOX}")
    return reasons


def default_config(q_dtype: torch.dtype, gpu: GPU | None, *, num_heads: int = 128,
                   fp8: bool = False) -> MLADecodeConfig:
    """Tiles that compile without register spills on sm_90 and sm_100
    (``tests/mla/test_triton_compile.py`` checks; ``benchmarks/tune_mla_decode.py``
    sweeps the alternatives on a GPU).

    ``gpu``: the device's (:func:`~vllm.attention.writers.kernels.device.gpu_of`),
    None under the interpreter; ``num_heads``: the layer's query heads; ``fp8``: a
    scaled fp8 cache.
    """
    if gpu is None or gpu.vendor != "nvidia" or q_dtype not in HALF_DTYPES:
        # the interpreter's cost is per element; float32 models (IEEE dots) are a
        # correctness path; an MI300's 64 KiB of shared memory per CU holds no 64-head
        # tile: the smallest tiles tl.dot takes
        return MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    capability = gpu.capability
    if capability[0] == 9:
        # 64 heads (masked below 64): the M of a Hopper warpgroup MMA, which Ampere's
        # MMA would need in registers. 8 warps hold the [64, 512] float32 accumulator in
        # 128 registers a thread; the warpgroups split the keys of the scores (each
        # computes 32 of a tile's 64) instead of both computing all of them, and the
        # latent is one [64, 512] operand (one wait, m64n256 value MMAs)
        # the Gluon kernel (the same tiles, its own schedule: docs/mla.md) where it
        # applies, else these
        return MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2,
                               latent_chunks=1, split_scores=True, gluon=True)
    if capability[0] >= 10:
        # the [64, 512] float32 accumulator and the scores exceed the 512 columns of
        # Blackwell's tensor memory: each half of the values gets its own program
        return MLADecodeConfig(block_h=64, block_n=32, num_warps=4, num_stages=2, v_split=2)
    # Ampere's MMA takes its A operand (the query) from registers: small head tiles
    return MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2)


@functools.cache
def _device_facts(device: torch.device) -> tuple[int, GPU | None]:
    """(multiprocessor count, GPU) of a CUDA or ROCm device, (1, None) elsewhere."""
    gpu = gpu_of(device)
    return (1, None) if gpu is None else (multiprocessors(device), gpu)


def _nvidia(gpu: GPU | None) -> tuple[int, int] | None:
    """The compute capability of an NVIDIA GPU, else None (none under the interpreter)."""
    return None if gpu is None else gpu.nvidia_capability


def _programs_per_sm(block_h: int, block_n: int, cfg: MLADecodeConfig) -> int:
    """Programs an SM holds at once, estimated: a 64-head tile's query (72 KiB) and its
    key stages take most of an H100's 227 KiB of shared memory unless the stages hold
    32 rows or fewer (compiled: 110-112 KiB, so two fit), and 8 warps of a 64-head tile
    take most of its registers; with the heads as N, the tiles of 64 rows do (two
    stages: 168 KiB compiled)."""
    if cfg.heads_as_n:
        return 2 if (block_h + cfg.num_stages * block_n) * 1152 <= 110 * 1024 else 1
    if block_h < 64:
        return 2
    return 2 if cfg.num_warps <= 4 and block_n * cfg.num_stages <= 32 else 1


def choose_splits(*, num_tokens: int, programs_per_split: int, num_heads: int,
                  kv_lora_rank: int, max_seq_len: int, row_bytes: int, block_n: int,
                  slots: int) -> int:
    """The split count with the lowest modelled time: waves of ``slots`` concurrent
    programs (a partly filled last wave costs a whole one) plus the float32 partial
    outputs every split beyond the first writes and the combine reads back, in units
    of one split-free pass over the keys."""
    if num_tokens == 0 or max_seq_len <= 0:
        return 1
    base = num_tokens * programs_per_split
    # a split keeps at least two key tiles, or its fixed cost (the query tile, the
    # partial output) outweighs its keys
    most = max(1, min(MAX_SPLITS, max_seq_len // (2 * block_n)))
    keys = max_seq_len * row_bytes * programs_per_split  # bytes one token's programs read
    partial = num_heads * kv_lora_rank * 8 / keys  # one split's extra, same units
    best, best_cost = 1, math.inf
    for s in range(1, most + 1):
        waves = -(-base * s // slots)
        cost = waves / s * slots / base + (partial * s if s > 1 else 0.0)
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def _dot_fp32(q_dtype: torch.dtype, interp: bool) -> bool:
    # numpy has no bfloat16: the interpreter's bfloat16 dots are wrong, its float16
    # ones right
    return q_dtype not in HALF_DTYPES or (interp and q_dtype == torch.bfloat16)


_interpreting = interpreting
"""(A module attribute of its own, so that tests can stand it in for a GPU run.)"""


def _hw_fp8(gpu: GPU | None) -> bool:
    """Whether the kernel widens E4M3 with the hardware conversion (NVIDIA sm_89+);
    elsewhere (ROCm, older GPUs, the interpreter, whose own conversion reads NaN as
    480) in integer code."""
    capability = _nvidia(gpu)
    return capability is not None and capability >= (8, 9)


def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The decode and combine kernels, compiled or for the CPU interpreter."""
    from vllm.attention.ops.triton_loader import load_kernel_module

    k = load_kernel_module("vllm.attention.ops.triton_mla_decode_kernels", interpret=interpret)
    return k.mla_decode_mma_kernel, k.mla_decode_combine_kernel


def _tma_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache seen as ``[nb * bs, L + R]`` rows for TMA descriptors, or None where
    its layout does not allow them (rows not 16-byte aligned, pages not contiguous)."""
    nb, bs, width = cache.shape
    row = cache.stride(1)
    if (cache.stride(0) != bs * row or (row * cache.element_size()) % 16
            or cache.data_ptr() % 16 or nb * bs >= 2**31):
        return None
    return cache.as_strided((nb * bs, width), (row, 1))


def _descriptors(cache: torch.Tensor, block_n: int, lc: int,
                 block_r: int) -> tuple[Any, Any] | None:
    """TMA descriptors of a latent chunk and of the rope part, over the cache seen as
    ``[nb * bs, L + R]``, or None where the layout does not allow them."""
    rows = _tma_rows(cache)
    size = cache.element_size()
    if rows is None or lc * size < 16 or block_r * size < 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    shape, strides = list(rows.shape), list(rows.stride())
    return (TensorDescriptor(rows, shape, strides, [block_n, lc]),
            TensorDescriptor(rows, shape, strides, [block_n, block_r]))


GLUON_TILE = 64
"""The Gluon kernel's heads and rows a tile."""
_GLUON_SMEM = 232448
"""Shared memory a block may use on sm_90 (227 KiB)."""
_LEAD_MAXNREG = 168
"""Registers a thread at the lead kernel's launch, before its partitions set their own:
its 9 warps (16-bit caches; 12 with fp8) launch as 12 (whole warpgroups), and an SM has
64 K registers."""
_FEW_64_MAXNREG = 128
"""The same for the few-heads kernel at 64 heads a program: its 13 warps (scores, two
values' warpgroups, the loader) launch as 16."""


@functools.cache
def _gluon_available() -> str | None:
    """Why this Triton cannot build the Gluon kernel (None when it can)."""
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
        import triton.experimental.gluon.nvidia.hopper  # noqa: F401
    except ImportError as exc:
        return f"this Triton has no Gluon for Hopper ({exc})"
    return None


def gluon_unsupported_reasons(q_dtype: torch.dtype, kv_cache: torch.Tensor, kv_lora_rank: int,
                              rope_dim: int, gpu: GPU | None) -> list[str]:
    """Why the Gluon kernel cannot take this decode (empty: it can). ``gpu``: the
    device's (None under the interpreter or on CPU)."""
    reasons = []
    if _interpreting():
        reasons.append("the Triton interpreter runs no Gluon kernel")
    if _nvidia(gpu) != (9, 0):
        reasons.append(f"device {gpu}: the Gluon kernel is written for NVIDIA sm_90 "
                       "(warpgroup MMAs, TMA) and measured there")
    if q_dtype not in HALF_DTYPES or kv_cache.dtype not in (q_dtype, *_FP8_CODES):
        reasons.append(f"query {q_dtype} and cache {kv_cache.dtype}: the Gluon kernel takes "
                       "a float16 or bfloat16 query and a cache in its dtype or in "
                       "float8_e4m3fn / float8_e5m2")
    L, R = kv_lora_rank, rope_dim
    if L & (L - 1) or not 64 <= L <= 512:
        reasons.append(f"kv_lora_rank={L}: the Gluon kernel takes a power of two in 64..512")
    if R & (R - 1) or not 8 <= R <= 256:
        reasons.append(f"rope_dim={R}: the Gluon kernel takes a power of two in 8..256")
    # the query and two key tiles of L + R 16-bit values a row (fp8: two tiles of bytes
    # and one widened), P
    smem = 3 * GLUON_TILE * (L + R) * 2 + GLUON_TILE * GLUON_TILE * 2 + 1024
    if smem > _GLUON_SMEM:
        reasons.append(f"kv_lora_rank + rope_dim = {L + R}: the Gluon kernel's tiles would "
                       f"need {smem} bytes of shared memory, sm_90 has {_GLUON_SMEM}")
    page = int(kv_cache.shape[1]) if kv_cache.dim() == 3 else 0
    if page % GLUON_TILE:
        reasons.append(f"page size {page}: the Gluon kernel's tiles are {GLUON_TILE} rows "
                       "of one page")
    if kv_cache.dim() == 3 and _tma_rows(kv_cache) is None:
        reasons.append(f"cache strides {tuple(kv_cache.stride())}: TMA needs contiguous "
                       "pages of 16-byte aligned rows")
    missing = _gluon_available()
    if missing is not None:
        reasons.append(missing)
    return reasons


def takes_gluon(cfg: MLADecodeConfig, q_dtype: torch.dtype, kv_cache: torch.Tensor,
                kv_lora_rank: int, rope_dim: int, gpu: GPU | None, *, scale: float) -> bool:
    """Whether :func:`mla_decode_mma` runs this decode on the Gluon kernel: ``cfg``
    asks for it, it can take it (:func:`gluon_unsupported_reasons`), and the softmax
    scale is positive (the kernel scales the row maximum, not each score)."""
    return (cfg.gluon and scale > 0
            and not gluon_unsupported_reasons(q_dtype, kv_cache, kv_lora_rank, rope_dim, gpu))


def _gluon_descriptors(cache: torch.Tensor, L: int, R: int,
                       lat_width: int | None = None) -> tuple[Any, Any]:
    """Gluon TMA descriptors of the latent ``[GLUON_TILE, lat_width]`` (default ``L``)
    and rope ``[GLUON_TILE, R]`` blocks of the cache seen as ``[nb * bs, L + R]``
    (16-bit, or fp8 as bytes or E4M3; :func:`gluon_unsupported_reasons` checked that it
    can be)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows = _tma_rows(cache)
    assert rows is not None  # checked by gluon_unsupported_reasons
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
             torch.uint8: gl.uint8, torch.float8_e4m3fn: gl.float8e4nv}[cache.dtype]
    shape, strides = list(rows.shape), list(rows.stride())

    def desc(width: int) -> Any:
        block = [GLUON_TILE, width]
        return TensorDescriptor(rows, shape, strides, block,
                                gl.NVMMASharedLayout.get_default_for(block, dtype))

    return desc(lat_width or L), desc(R)


def _gluon_kernel() -> Any:
    from vllm.attention.ops.gluon_mla_decode_kernels import mla_decode_gluon_kernel

    return mla_decode_gluon_kernel


def _lead_kernel() -> Any:
    from vllm.attention.ops.gluon_mla_lead_kernels import mla_decode_lead_kernel

    return mla_decode_lead_kernel


def takes_lead(cfg: MLADecodeConfig, q_dtype: torch.dtype, kv_cache: torch.Tensor,
               kv_lora_rank: int, rope_dim: int, gpu: GPU | None, *, scale: float) -> bool:
    """Whether :func:`mla_decode_mma` runs this decode on the lead-warpgroup Gluon
    kernel: it takes the Gluon kernel (:func:`takes_gluon`) and ``cfg.lead`` asks for it
    (caches in the model's dtype, copied by a loader warp, and scaled fp8 ones, widened
    to float16 by a warpgroup of their own)."""
    return (cfg.lead
            and takes_gluon(cfg, q_dtype, kv_cache, kv_lora_rank, rope_dim, gpu, scale=scale))


FP8_MMA_TOLERANCE = 0.06
"""Relative error (norm of the difference over the reference's) of the fp8-MMA kernel
against float64 on random inputs (``docs/mla.md``: rounding the query to E4M3 costs
about 0.035 there, the probabilities about 0.015)."""
FP8_MMA_P_TOLERANCE = 0.025
"""The same against float64 on the query as the kernel rounds it: what the
probabilities' rounding to E4M3 leaves."""


FEW_HEADS_MAX = 32
"""The most heads the few-heads kernel takes with the heads as the N of both MMAs (16
or 32 a program). Past it, with an E4M3 cache and a bfloat16 query, it takes 64 heads a
program: the scores with the heads as rows (fp8 MMAs of the query's two E4M3 parts),
the values with the heads as N (two values' warpgroups, a latent half each)."""


def few_heads_block(num_heads: int) -> int:
    """The heads a program of the few-heads kernel takes: 16, 32, or 64 (an E4M3 cache
    and a bfloat16 query)."""
    return 16 if num_heads <= 16 else 32 if num_heads <= FEW_HEADS_MAX else 64


def _few_heads_kernel() -> Any:
    from vllm.attention.ops.gluon_mla_few_heads_kernels import mla_decode_few_heads_kernel

    return mla_decode_few_heads_kernel


def few_heads_unsupported_reasons(num_heads: int, kv_lora_rank: int, rope_dim: int, *,
                                  fp8: bool = False, e4m3_bf16: bool = False) -> list[str]:
    """Why the few-heads kernel cannot take this decode, given that the lead kernel can
    (empty: it can); ``fp8``: the cache is fp8 (its bytes are read into the MMAs'
    operands, a quarter of the latent, 128 columns, a score MMA); ``e4m3_bf16``: an
    E4M3 cache and a bfloat16 query (the only pair it takes past :data:`FEW_HEADS_MAX`
    heads)."""
    reasons = []
    if num_heads > FEW_HEADS_MAX and not e4m3_bf16:
        reasons.append(f"{num_heads} heads: past {FEW_HEADS_MAX} the few-heads kernel takes "
                       "only an E4M3 cache with a bfloat16 query (its scores as fp8 MMAs of "
                       "the query's two E4M3 parts, which hold a bfloat16 query's 8 "
                       "significant bits); the lead kernel takes the rest")
    if kv_lora_rank % 128:
        reasons.append(f"kv_lora_rank={kv_lora_rank}: the few-heads kernel's value MMAs "
                       "take each half of the latent as their M, a multiple of 64")
    if rope_dim < 16:
        reasons.append(f"rope_dim={rope_dim}: the few-heads kernel's rope MMA takes a K of "
                       "at least 16")
    if fp8 and kv_lora_rank < 256:
        reasons.append(f"kv_lora_rank={kv_lora_rank} with an fp8 cache: the few-heads "
                       "kernel's score MMAs read the latent's bytes 128 columns a half at "
                       "a time, so it takes at least 256")
    return reasons


def _asks_few_heads(cfg: MLADecodeConfig, q_dtype: torch.dtype, kv_cache: torch.Tensor,
                    num_heads: int, kv_lora_rank: int, rope_dim: int) -> bool:
    """Given the lead kernel: ``cfg.few_heads`` asks for the few-heads kernel, it can
    take the decode, and the opt-in fp8-MMA kernel does not (:func:`_asks_fp8_mma`)."""
    e4m3_bf16 = _FP8_CODES.get(kv_cache.dtype) == 1 and q_dtype == torch.bfloat16
    if num_heads > FEW_HEADS_MAX and not cfg.few_heads_64:
        return False
    return (cfg.few_heads and not _asks_fp8_mma(cfg, kv_cache, kv_lora_rank, rope_dim)
            and not few_heads_unsupported_reasons(num_heads, kv_lora_rank, rope_dim,
                                                  fp8=kv_cache.dtype in _FP8_CODES,
                                                  e4m3_bf16=e4m3_bf16))


def takes_few_heads(cfg: MLADecodeConfig, q_dtype: torch.dtype, kv_cache: torch.Tensor,
                    kv_lora_rank: int, rope_dim: int, gpu: GPU | None, *, scale: float,
                    num_heads: int) -> bool:
    """Whether :func:`mla_decode_mma` runs this decode on the few-heads Gluon kernel:
    ``cfg.few_heads`` asks for it, the lead kernel would take it (:func:`takes_lead`),
    :func:`few_heads_unsupported_reasons` is empty, and the opt-in fp8-MMA kernel does
    not take it (:func:`takes_fp8_mma`)."""
    return (_asks_few_heads(cfg, q_dtype, kv_cache, num_heads, kv_lora_rank, rope_dim)
            and takes_lead(cfg, q_dtype, kv_cache, kv_lora_rank, rope_dim, gpu, scale=scale))


def _fp8_mma_kernel() -> Any:
    from vllm.attention.ops.gluon_mla_fp8_kernels import mla_decode_fp8_mma_kernel

    return mla_decode_fp8_mma_kernel


def fp8_mma_unsupported_reasons(kv_cache: torch.Tensor, kv_lora_rank: int,
                                rope_dim: int) -> list[str]:
    """Why the fp8-MMA kernel cannot take this decode, given that the lead kernel can
    (empty: it can)."""
    reasons = []
    if kv_cache.dtype != torch.float8_e4m3fn:
        reasons.append(f"cache {kv_cache.dtype}: the fp8-MMA kernel reads float8_e4m3fn "
                       "(the query and probabilities are rounded to E4M3 to match it)")
    if (kv_lora_rank, rope_dim) != (512, 64):
        reasons.append(f"kv_lora_rank={kv_lora_rank}, rope_dim={rope_dim}: the fp8-MMA "
                       "kernel's staging is written for 512 and 64 (DeepSeek's)")
    return reasons


def _asks_fp8_mma(cfg: MLADecodeConfig, kv_cache: torch.Tensor, kv_lora_rank: int,
                  rope_dim: int) -> bool:
    """Given the lead kernel: ``cfg.fp8_mma`` asks for the fp8-MMA kernel and it can take
    the decode."""
    return cfg.fp8_mma and not fp8_mma_unsupported_reasons(kv_cache, kv_lora_rank, rope_dim)


def takes_fp8_mma(cfg: MLADecodeConfig, q_dtype: torch.dtype, kv_cache: torch.Tensor,
                  kv_lora_rank: int, rope_dim: int, gpu: GPU | None, *, scale: float) -> bool:
    """Whether :func:`mla_decode_mma` runs this decode on the fp8-MMA Gluon kernel:
    ``cfg.fp8_mma`` asks for it, the lead kernel would take it (:func:`takes_lead`), and
    :func:`fp8_mma_unsupported_reasons` is empty (at any head count: asked for, it
    takes precedence over the few-heads kernel)."""
    return (_asks_fp8_mma(cfg, kv_cache, kv_lora_rank, rope_dim)
            and takes_lead(cfg, q_dtype, kv_cache, kv_lora_rank, rope_dim, gpu, scale=scale))


def mla_decode_mma(q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   token_req: torch.Tensor, token_pos: torch.Tensor, fmt: LatentFormat, *,
                   scale: float, max_seq_len: int, config: MLADecodeConfig | None = None,
                   num_splits: int | None = None, out_dtype: torch.dtype = torch.float32,
                   q_pe: torch.Tensor | None = None, fp8_mma: bool | None = None
                   ) -> torch.Tensor:
    """Dense absorbed decode, causal, on tensor cores.

    Args:
        q_lat: ``[Td, N, L + R]`` float16 / bfloat16 (float32: IEEE dots); or, with
            ``q_pe`` ``[Td, N, R]`` given, ``[Td, N, L]`` (any strides but a unit one
            on the last axis: the absorbed query need not be concatenated).
        kv_cache: ``(nb, bs, L + R)`` in the model dtype, or float8_e4m3fn / float8_e5m2
            scaled by ``fmt.k_scale`` (float32 ``[1]`` on the cache's device).
        block_table: ``[num_reqs, max_blocks]`` int32.
        token_req / token_pos: ``[Td]`` int32; token ``i`` sees positions
            ``0 .. token_pos[i]`` of request ``token_req[i]``.
        max_seq_len: the longest context (sizes the split).
        config: tiles and warps (default: :func:`default_config` for the device);
            ``num_splits`` overrides its split count.
        out_dtype: the result's dtype.
        fp8_mma: overrides ``config.fp8_mma`` (None: the config's).
    Returns:
        ``[Td, N, L]`` in ``out_dtype``.
    """
    reasons = unsupported_reasons(fmt, q_lat.dtype)
    if reasons:
        raise InvalidArgumentError("kv_cache_dtype / q_lat.dtype",
                                   (fmt.cache_dtype, str(q_lat.dtype)), "; ".join(reasons))
    t, n, d = q_lat.shape
    L, R = fmt.kv_lora_rank, fmt.rope_dim
    if q_pe is None:
        if d != L + R:
            raise InvalidArgumentError("q_lat.shape", tuple(q_lat.shape), f"[T, N, {L + R}]")
        q_nope, q_pe = q_lat[..., :L], q_lat[..., L:]
    else:
        if d != L:
            raise InvalidArgumentError("q_lat.shape", tuple(q_lat.shape),
                                       f"[T, N, {L}] (the latent part, q_pe given)")
        if tuple(q_pe.shape) != (t, n, R) or q_pe.dtype != q_lat.dtype:
            raise InvalidArgumentError("q_pe", (tuple(q_pe.shape), str(q_pe.dtype)),
                                       f"[{t}, {n}, {R}] in {q_lat.dtype}")
        q_nope = q_lat
    if kv_cache.dim() != 3 or kv_cache.shape[2] != L + R or kv_cache.stride(2) != 1:
        raise InvalidArgumentError(
            "kv_cache", (tuple(kv_cache.shape), tuple(kv_cache.stride())),
            f"(nb, bs, {L + R}) with a unit stride on the last axis")
    out = torch.empty(t, n, L, dtype=out_dtype, device=q_lat.device)
    if t == 0:
        return out
    interp = _interpreting()
    num_sms, gpu = (1, None) if interp else _device_facts(q_lat.device)
    fp8 = _FP8_CODES.get(kv_cache.dtype, 0)
    cfg = config or default_config(q_lat.dtype, gpu, num_heads=n, fp8=bool(fp8))
    if fp8_mma is not None and fp8_mma != cfg.fp8_mma:  # (no copy a call otherwise)
        cfg = dataclasses.replace(cfg, fp8_mma=fp8_mma)
    if cfg.heads_as_n and not interp:
        raise InvalidArgumentError(
            "config.heads_as_n", True,
            "False on a GPU: the heads-as-N launch computed wrong outputs (relative error "
            "0.18) and made an illegal memory access on an H200 (2026-12-01, "
            "benchmarks/results/h200/2026-12-01-3c3e403); it runs under the "
            "interpreter only until that is found (docs/mla.md)")
    use_gluon = takes_gluon(cfg, q_lat.dtype, kv_cache, L, R, gpu, scale=scale)
    # which Gluon kernel (takes_lead, takes_fp8_mma, takes_few_heads, given takes_gluon:
    # checked once a call); the few-heads one takes 16 or 32 heads a program, one
    # program an SM (its shared memory)
    use_lead = use_gluon and cfg.lead
    use_fp8_mma = use_lead and _asks_fp8_mma(cfg, kv_cache, L, R)
    use_few = use_lead and _asks_few_heads(cfg, q_lat.dtype, kv_cache, n, L, R)
    # the few-heads kernel and its combine as programmatic dependent launches, up to 32
    # heads: at 64 a program takes a whole SM (its registers and most of its shared
    # memory), and one launched early would hold an SM from the grid before it
    # (docs/mla.md); the kernel compiles its griddepcontrol calls to match
    pdl = use_few and n <= FEW_HEADS_MAX
    if use_gluon:  # its own tiles
        block_h = few_heads_block(n) if use_few else GLUON_TILE
        cfg = dataclasses.replace(cfg, block_h=block_h, block_n=GLUON_TILE, num_warps=8,
                                  v_split=1, heads_as_n=False)
    block_l = next_pow2(L)
    chunks = 1 if block_l <= _MAX_BOX else cfg.latent_chunks
    lc = block_l // chunks
    block_r = next_pow2(R)
    v_split = cfg.v_split if chunks == 2 else 1
    block_h = cfg.block_h
    page = int(kv_cache.shape[1])
    # a tile inside one page takes one block-table entry (and TMA); pages of 16, 32 or 48
    # rows get tiles of 16 or 32
    block_n = cfg.block_n
    while page % block_n and block_n > 16:
        block_n //= 2
    head_tiles = -(-n // block_h)
    splits = num_splits or cfg.num_splits
    if splits is None:
        slots = num_sms * (1 if use_few else _programs_per_sm(block_h, block_n, cfg))
        splits = choose_splits(num_tokens=t, programs_per_split=head_tiles * v_split,
                               num_heads=n, kv_lora_rank=L, max_seq_len=max_seq_len,
                               row_bytes=(L + R) * kv_cache.element_size(),
                               block_n=block_n, slots=slots)
    if not 1 <= splits <= MAX_SPLITS:
        raise InvalidArgumentError("num_splits", splits, f"1..{MAX_SPLITS}")
    combine_kernel = _kernels(interp)[1]
    q = q_nope if q_nope.stride(2) == 1 else q_nope.contiguous()
    qe = q_pe if q_pe.stride(2) == 1 else q_pe.contiguous()
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache
    bt = block_table.to(torch.int32)
    req = token_req.to(torch.int32)
    pos = token_pos.to(torch.int32)
    single = splits == 1
    if single:
        o_part = lse_part = out  # unused
        part_strides = (0, 0, 0, 0, 0)
    else:
        o_part = torch.empty(t, n, splits, L, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(t, n, splits, dtype=torch.float32, device=q.device)
        part_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2),
                        lse_part.stride(0), lse_part.stride(1))
    if use_gluon:
        # every Gluon kernel takes the same arguments; the lead-warpgroup one (and the
        # fp8-MMA and few-heads ones, with its launch) copies the latent in halves and
        # reads an fp8 cache as its fp8 type (which says E4M3 or E5M2), the split-scores
        # one as bytes
        kernel, launch = ((_lead_kernel(), {"num_warps": 4, "maxnreg": _LEAD_MAXNREG})
                          if use_lead else (_gluon_kernel(), {"num_warps": 8}))
        if use_fp8_mma:  # its copies are of E4M3 bytes
            kernel = _fp8_mma_kernel()
        if use_few:
            kernel = _few_heads_kernel()
            launch = ({**launch, "launch_pdl": True} if pdl
                      else {**launch, "maxnreg": _FEW_64_MAXNREG})  # 13 warps launch as 16
        lat_d, pe_d = _gluon_descriptors(kv_cache if use_fp8_mma else cache, L, R,
                                         lat_width=L // 2 if use_lead else None)
        kernel[(head_tiles, splits, t)](
            q, qe, lat_d, pe_d, kv_cache if use_lead else cache, bt, req, pos,
            fmt.k_scale.to(device=q.device, dtype=torch.float32), out, o_part, lse_part,
            q.stride(0), q.stride(1), qe.stride(0), qe.stride(1),
            cache.stride(0), cache.stride(1), bt.stride(0),
            out.stride(0), out.stride(1), *part_strides,
            n, scale, splits,
            KV_LORA=L, ROPE=R, PAGE=page, FP8=fp8, SINGLE=single, BLOCK_H=block_h,
            BLOCK_N=GLUON_TILE, **launch,
        )
    else:
        _launch_triton(q, qe, cache, bt, req, pos, out, o_part, lse_part, part_strides, fmt,
                       cfg, gpu, interp, fp8=fp8, splits=splits, single=single, page=page,
                       block_n=block_n, block_h=block_h, head_tiles=head_tiles, chunks=chunks,
                       lc=lc, block_r=block_r, v_split=v_split, scale=scale,
                       max_seq_len=max_seq_len)
    if not single:
        # after the few-heads kernel up to 32 heads, a programmatic dependent launch:
        # that kernel lets it launch while it runs, and it waits for that grid's end
        # before reading
        combine_kernel[(n, t)](
            o_part, lse_part, out, *part_strides, out.stride(0), out.stride(1), splits,
            KV_LORA=L, BLOCK_S=next_pow2(splits), BLOCK_L=block_l, num_warps=4,
            **({"PDL": True, "launch_pdl": True} if pdl else {}),
        )
    return out


def _launch_triton(q: torch.Tensor, qe: torch.Tensor, cache: torch.Tensor, bt: torch.Tensor,
                   req: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                   o_part: torch.Tensor, lse_part: torch.Tensor,
                   part_strides: tuple[int, ...], fmt: LatentFormat, cfg: MLADecodeConfig,
                   gpu: GPU | None, interp: bool, *, fp8: int, splits: int, single: bool,
                   page: int, block_n: int, block_h: int, head_tiles: int, chunks: int,
                   lc: int, block_r: int, v_split: int, scale: float,
                   max_seq_len: int) -> None:
    """The Triton decode kernel's launch (:func:`mla_decode_mma` prepared its
    arguments)."""
    t, n = q.shape[0], q.shape[1]
    L, R = fmt.kv_lora_rank, fmt.rope_dim
    decode_kernel = _kernels(interp)[0]
    tile_in_page = page % block_n == 0
    tma_ok = cfg.tma and tile_in_page and (interp or (_nvidia(gpu) or (0, 0)) >= (9, 0))
    descs = _descriptors(cache, block_n, lc, block_r) if tma_ok else None
    lat_desc, pe_desc = descs if descs is not None else (cache, cache)
    max_iters = -(-(-(-max_seq_len // splits)) // block_n) + 1 if interp else 0
    fp16_dot = bool(fp8) and cfg.fp8_fp16_dot and q.dtype == torch.bfloat16
    fp32_dot = _dot_fp32(q.dtype, interp) and not fp16_dot
    # the query scaled into float16, staged by the kernel (fp16_dot)
    q16 = torch.empty(t, n, L + R, dtype=torch.float16, device=q.device) if fp16_dot else q
    decode_kernel[(head_tiles * v_split, splits, t)](
        q, qe, q16, lat_desc, pe_desc, cache, bt, req, pos,
        fmt.k_scale.to(device=q.device, dtype=torch.float32), out, o_part, lse_part,
        q.stride(0), q.stride(1), qe.stride(0), qe.stride(1), q16.stride(0), q16.stride(1),
        cache.stride(0), cache.stride(1),
        bt.stride(0),
        out.stride(0), out.stride(1), *part_strides,
        n, scale, splits,
        KV_LORA=L, ROPE=R, PAGE=page, FP8=fp8, HW_FP8=_hw_fp8(gpu),
        FP32_DOT=fp32_dot, SINGLE=single, USE_TMA=descs is not None,
        TILE_IN_PAGE=tile_in_page, DYNAMIC_LOOP=not interp, MAX_ITERS=max_iters,
        FP16_DOT=fp16_dot,
        BLOCK_H=block_h, BLOCK_N=block_n, LAT_CHUNKS=chunks, V_SPLIT=v_split,
        SPLIT_SCORES=cfg.split_scores, HEADS_N=cfg.heads_as_n, LC=lc, BLOCK_R=block_r,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
