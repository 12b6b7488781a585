"""Which hardware paths the compiled writer kernels take on a device.

Every launcher asks here, and every answer starts from :func:`gpu_of`: the hardware
fp8 conversion (``HW_CVT``), its NaN byte (``HW_NAN``), the Markstein quotient
(``FAST_DIV``), the reciprocal without a range check (``FAST_RCP``), the packed bf16
conversions (``PACKED_WIDEN``) and the direct replay of Triton's CUDA launcher
(:mod:`~vllm.attention.writers.kernels.cached`) exist only on NVIDIA GPUs: inline
PTX, ``cvt.rn.satfinite``'s saturation, the CUDA launcher's arguments. ROCm builds of
torch call AMD GPUs ``cuda`` too (an MI300 reports capability 9.4), so the device type
alone cannot tell. Elsewhere (ROCm, the interpreter) the kernels run their plain
Triton code, which stores the same bytes. ``docs/kernels.md`` tables it."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

import torch


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


@dataclass(frozen=True)
class GPU:
    """A GPU as the kernels' hardware paths see it."""

    vendor: Literal["nvidia", "amd"]
    capability: tuple[int, int]
    """What torch reports: NVIDIA's compute capability; on ROCm the architecture's
    major and minor (gfx942, MI300: 9.4), which is no NVIDIA capability."""

    @property
    def nvidia_capability(self) -> tuple[int, int] | None:
        """The compute capability on an NVIDIA GPU, else None."""
        return self.capability if self.vendor == "nvidia" else None


def gpu_of(device: torch.device) -> GPU | None:
    """The GPU of ``device`` (the current one for a bare ``cuda``), or None where the
    kernels run under the interpreter. ROCm builds of torch call AMD GPUs ``cuda``
    too; ``torch.version.hip`` tells them apart."""
    if device.type != "cuda":
        return None
    index: int | None = device.index
    capability = _capability(torch.cuda.current_device() if index is None else index)
    return GPU("nvidia" if torch.version.hip is None else "amd", capability)


def nvidia_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s compute capability on an NVIDIA GPU, else None: the one question
    every NVIDIA-only path starts from (here and in the attention ops' launch choices)."""
    gpu = gpu_of(device)
    return None if gpu is None else gpu.nvidia_capability


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors (NVIDIA) or compute units (AMD) of ``device``, 1 off
    a GPU: what launch heuristics size their grids by (cached per device)."""
    if gpu_of(device) is None:
        return 1
    index: int | None = device.index
    return _multiprocessors(torch.cuda.current_device() if index is None else index)


def nvidia_gpu(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA GPU (:func:`gpu_of`)."""
    return nvidia_capability(device) is not None


def hardware_fp8(device: torch.device) -> bool:
    """Whether the compiled kernels convert to fp8 in hardware here (NVIDIA sm_89+: Ada,
    Hopper, Blackwell); the interpreter, older GPUs and ROCm round in integer code."""
    cap = nvidia_capability(device)
    return cap is not None and cap >= (8, 9)


def fast_division(device: torch.device) -> bool:
    """Whether the fp8 writers (tiled scatter, fused RoPE) divide by a scale of moderate
    size that is not a power of two (``_scale_kind`` 1) with one reciprocal per head and
    a Markstein FMA correction (``FAST_DIV``) instead of an IEEE division per element:
    where the kernels convert to fp8 in hardware (:func:`hardware_fp8`: its inline PTX
    ``min.NaN.xorsign.abs`` needs sm_86, and it has run on GPUs only beside the hardware
    conversion; the interpreter has no true FMA); on unless ``VLLM_KV_FAST_DIV=0``. It
    stores the division's fp8 bytes: checked on CPU with an exact FMA and on the H200 for
    every bf16/fp16 input against 79 scales
    (``test_fast_division_is_byte_identical_exhaustively``); split fp8 at scale 0.37
    reaches 0.98 x the copy ceiling there (``docs/performance.md``)."""
    if not hardware_fp8(device):
        return False
    return os.environ.get("VLLM_KV_FAST_DIV", "1") != "0"


_HW_NAN_CANONICAL: Final = frozenset({(9, 0)})
"""Compute capabilities whose fp8 conversion (``cvt.rn.satfinite.{e4m3,e5m2}x2.f32``)
was seen to store every NaN, whatever its sign and payload, as 0x7F (the reference's
byte): probed on the H200 (``tests/writers/test_writers_gpu.py`` checks it, and the
exhaustive byte test stores every bf16/fp16 NaN through it). Elsewhere the kernels keep
their select."""


def hardware_fp8_nan(device: torch.device) -> bool:
    """Whether the hardware fp8 conversion here stores every NaN as 0x7F by itself
    (``HW_NAN``: the kernels then store the converted bytes without a select);
    ``VLLM_KV_HW_NAN=0`` / ``1`` overrides (for A/B measurements and the GPU probe)."""
    if not hardware_fp8(device):
        return False
    env = os.environ.get("VLLM_KV_HW_NAN", "")
    if env in ("0", "1"):
        return env == "1"
    return nvidia_capability(device) in _HW_NAN_CANONICAL


TRITON_DEFAULT_WARPS: Final = 4
"""``num_warps`` of a launch that sets none (the tiled scatter)."""


def next_pow2(n: int) -> int:
    """The least power of two ``>= n`` (1 for ``n <= 1``): the block sizes of every
    launch (``tl.arange`` takes powers of two)."""
    return 1 << max(0, (n - 1).bit_length())


def input_tiles(kernel: str, consts: Mapping[str, int | bool]) -> list[int]:
    """Element counts of the tiles of input rows one program of ``kernel``
    (``scatter_kv_tiled_kernel`` or ``rope_kv_kernel``) holds, from its constexprs."""
    t = int(consts.get("BLOCK_T", 1))
    if kernel == "rope_kv_kernel":
        dims = ["BLOCK_R", "BLOCK_DV"] + (["BLOCK_PK"] if consts["PASS_K"] else [])
        return [t * int(consts["BLOCK_HK"]) * int(consts[d]) for d in dims]
    return [t * int(consts["BLOCK_H"]) * int(consts[d]) for d in ("BLOCK_DK", "BLOCK_DV")]


def pairs_fit(tiles: Iterable[int], num_warps: int) -> bool:
    """Whether every thread holds an even number of elements of each of ``tiles`` (their
    element counts, powers of two), which the kernels' two-element inline PTX
    (``PACKED_WIDEN``: ``_widen_bf16_pairs``, ``_round_to_bf16_pairs``) requires.
    Triton spreads a power-of-two tile over the ``32 * num_warps`` threads without
    repeating an element once it has at least that many, so twice that many is enough;
    smaller tiles (a few heads of a few dimensions) take the one-element code."""
    return all(t >= 64 * num_warps for t in tiles)


def packed_widen(kernel: str, consts: Mapping[str, int | bool], num_warps: int) -> bool:
    """``PACKED_WIDEN`` of a ``kernel`` launch with these constexprs at ``num_warps``:
    hardware conversions (``HW_CVT``) and tiles that fit :func:`pairs_fit`."""
    return bool(consts.get("HW_CVT")) and pairs_fit(input_tiles(kernel, consts), num_warps)


def fp8_consts(mode: int, device: torch.device) -> dict[str, int | bool]:
    """The fp8 constexprs shared by the tiled scatter and the fused RoPE kernel (the
    launches add ``PACKED_WIDEN``, :func:`packed_widen`, once their tiles are known).
    ``FAST_RCP`` (inline PTX) goes with ``HW_CVT``: both only on NVIDIA sm_89+."""
    hw = mode != 0 and hardware_fp8(device)
    return {"HW_CVT": hw,
            "FAST_DIV": mode != 0 and fast_division(device),
            "HW_NAN": mode != 0 and hardware_fp8_nan(device),
            "FAST_RCP": hw}


def direct_launch(device: torch.device) -> bool:
    """Whether a cached launch on ``device`` may call the compiled kernel's low-level
    launch function itself (:class:`~vllm.attention.writers.kernels.cached.BoundLaunch`):
    it passes the arguments in the order of Triton's CUDA launcher, so NVIDIA GPUs only;
    elsewhere every call goes through Triton's own launcher."""
    return nvidia_gpu(device)
