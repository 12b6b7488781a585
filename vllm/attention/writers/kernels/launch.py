"""What every writer launch is built from: the kernel module, the cache addressing of
one operand (:class:`ScatterTarget`) and one launch (:class:`Launch`).

Triton is imported lazily: importing this module never imports it. CUDA tensors
run the compiled kernels; CPU tensors run the same kernels under Triton's
interpreter (``TRITON_INTERPRET=1`` semantics, loaded as a separate module copy),
which is how the kernels are tested without a GPU.

The writers validate every argument before calling in here; the launchers only
translate tensors into pointers, strides and launch constants.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Final

import torch

_KERNELS: Final = "vllm.attention.writers.kernels.triton_kernels"

_IN_KIND: Final[dict[torch.dtype, int]] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_BITS: Final[dict[int, torch.dtype]] = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_MAX_TILE: Final = 4096
"""Elements per program (heads x head size); larger tiles only add registers."""


@functools.cache
def triton_importable() -> bool:
    """True when ``import triton`` succeeds here."""
    try:
        importlib.import_module("triton")
    except Exception:  # a broken install is as good as none
        return False
    return True


def load_kernels(interpret: bool) -> ModuleType:
    """The writer kernel module, compiled (``interpret=False``) or for the CPU
    interpreter (:func:`vllm.attention.ops.triton_loader.load_kernel_module`)."""
    from vllm.attention.ops.triton_loader import load_kernel_module

    return load_kernel_module(_KERNELS, interpret=interpret)


def _kernels_for(t: torch.Tensor) -> ModuleType:
    return load_kernels(interpret=t.device.type != "cuda")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as same-size integers (strides unchanged)."""
    return t.view(_BITS[t.element_size()])


@dataclass(frozen=True)
class ScatterTarget:
    """Where element ``(slot, head, dim)`` of one operand (K or V) is stored.

    With ``blk, off = divmod(slot, block_size)`` the element index (relative to
    ``tensor.data_ptr()``, in elements of ``tensor``) is::

        blk * stride_block + (off // off_split) * stride_off_hi + (off % off_split) * stride_off_lo
        + head * stride_head + (dim // dim_split) * stride_dim_hi + (dim % dim_split) * stride_dim_lo

    ``tensor``: the cache view whose first element is ``(0, 0, 0)``; fp8 caches are
    passed as themselves and written as bytes.
    """

    tensor: torch.Tensor
    block_size: int
    num_heads: int
    head_size: int
    stride_block: int
    stride_head: int
    stride_off_hi: int
    stride_dim_hi: int
    stride_off_lo: int = 0
    off_split: int = 1
    stride_dim_lo: int = 0
    dim_split: int = 1

    @classmethod
    def token_major(cls, view: torch.Tensor) -> ScatterTarget:
        """From a ``[nb, bs, H, D]`` view with any strides."""
        _, bs, h, d = view.shape
        sb, so, sh, sd = view.stride()
        return cls(view, bs, h, d, sb, sh, so, sd)

    @classmethod
    def x_split_key(cls, k5: torch.Tensor) -> ScatterTarget:
        """From a legacy / AITER K view ``[nb, H, D/x, bs, x]``."""
        _, h, dx, bs, x = k5.shape
        sb, sh, sdx, so, sx = k5.stride()
        return cls(k5, bs, h, dx * x, sb, sh, so, sdx, stride_dim_lo=sx, dim_split=x)

    @classmethod
    def head_major_value(cls, v4: torch.Tensor) -> ScatterTarget:
        """From a legacy V view ``[nb, H, D, bs]``."""
        _, h, d, bs = v4.shape
        sb, sh, sd, so = v4.stride()
        return cls(v4, bs, h, d, sb, sh, so, sd)

    @classmethod
    def x_split_value(cls, v5: torch.Tensor) -> ScatterTarget:
        """From an AITER V view ``[nb, H, bs/x, D, x]``."""
        _, h, bx, d, x = v5.shape
        sb, sh, sbx, sd, sx = v5.stride()
        return cls(v5, bx * x, h, d, sb, sh, sbx, sd, stride_off_lo=sx, off_split=x)

    @property
    def slot_linear(self) -> bool:
        """Whether each block follows the last (``stride_block == block_size *
        stride_off_hi``, no x-split of the offset): slot ``s`` then starts at
        ``s * stride_off_hi``, without dividing by the block size."""
        return self.off_split == 1 and self.stride_block == self.block_size * self.stride_off_hi

    @property
    def num_slots(self) -> int:
        """Slots of the cache (``num_blocks * block_size``): the kernels store nothing for
        a slot outside ``[0, num_slots)``."""
        return int(self.tensor.shape[0]) * self.block_size

    def args(self) -> tuple[torch.Tensor | int, ...]:
        return (_bits(self.tensor), self.stride_block, self.stride_off_hi, self.stride_off_lo,
                self.stride_head, self.stride_dim_hi, self.stride_dim_lo)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``[T, H, D]`` input as bits and its three strides."""
    st, sh, sd = x.stride()
    return _bits(x), st, sh, sd


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the kernel's name in ``triton_kernels``, its grid,
    positional arguments and constexpr keywords. Built separately from running it
    so tests can compile exactly these arguments for a GPU target without one."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple[torch.Tensor | int, ...]
    constexprs: dict[str, int | bool]
    options: dict[str, int | bool] = field(default_factory=dict)
    """Compiler options (``num_warps``, ``enable_fp_fusion``, ...)."""
    roles: tuple[str, ...] = ()
    """For each tensor of ``args``, in order, the argument it addresses (``"key"``,
    ``"cache"``, ...): what a cached launch recomputes its pointers from."""

    def run(self) -> None:
        self.launch()

    def launch(self) -> object:
        """Run through Triton's own launcher; returns what it returns (the compiled
        kernel, for a GPU launch) or None for an empty grid."""
        if self.grid[0] == 0 or (len(self.grid) > 1 and self.grid[1] == 0):
            return None
        anchor = next(a for a in self.args if isinstance(a, torch.Tensor))
        fn = getattr(_kernels_for(anchor), self.kernel)
        result: object = fn[self.grid](*self.args, **self.constexprs, **self.options)
        return result


def _one_scale(mode: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> bool:
    """``SCALAR_S`` of the fp8 kernels: one K and one V scale for every head (``[1]``),
    loaded and tested once per program instead of per head."""
    return mode != 0 and k_scale.numel() == 1 and v_scale.numel() == 1


def _bs_shift(block_size: int) -> int:
    """``BS_SHIFT`` of the kernels: ``log2(block_size)`` for a power of two, else -1."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1
