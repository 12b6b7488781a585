"""Building blocks: RMSNorm, rotary embedding, tensor-parallel linears, SwiGLU.

Arithmetic follows Hugging Face's Llama exactly where it matters for greedy
equality (RMSNorm in float32, cos/sin computed in float32 then cast).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vllm.runner.config import RopeConfig
from vllm.runner.parallel import ParallelState

Shard = Literal["column", "row", "none"]
"""``column``: output features split over ranks; ``row``: input features split
(the partial products are all-reduced); ``none``: replicated."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding over the first ``dim`` channels it is given.

    ``forward(x, positions)``: ``x`` ``[T, H, dim]``, ``positions`` int64 ``[T]``.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, rope: RopeConfig, dim: int, max_positions: int, *,
                 device: torch.device) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(),
                            rope.inv_freq(dim))
        self.interleaved = rope.interleaved
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.interleaved:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        cos = torch.cat((cos, cos), dim=-1).to(x.dtype)
        sin = torch.cat((sin, sin), dim=-1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class ShardedLinear(nn.Module):
    """``nn.Linear`` (weight ``[out, in]``) holding this rank's shard.

    ``full_shape`` is the checkpoint's shape; the loader narrows it along
    :attr:`weight_shard_dim`.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, shard: Shard,
                 parallel: ParallelState, dtype: torch.dtype, device: torch.device,
                 what: str) -> None:
        super().__init__()
        self.shard: Shard = shard
        self.parallel = parallel
        self.full_shape = (out_features, in_features)
        if shard == "column":
            out_features = parallel.shard(out_features, f"{what} output features")[1]
        elif shard == "row":
            in_features = parallel.shard(in_features, f"{what} input features")[1]
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    @property
    def weight_shard_dim(self) -> int | None:
        return {"column": 0, "row": 1, "none": None}[self.shard]

    @property
    def bias_shard_dim(self) -> int | None:
        return 0 if self.shard == "column" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard != "row":
            return F.linear(x, self.weight, self.bias)
        y = self.parallel.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        def linear(n_in: int, n_out: int, shard: Shard) -> ShardedLinear:
            return ShardedLinear(n_in, n_out, bias=bias, shard=shard, parallel=parallel,
                                 dtype=dtype, device=device, what="intermediate_size")

        self.gate_proj = linear(hidden, intermediate, "column")
        self.up_proj = linear(hidden, intermediate, "column")
        self.down_proj = linear(intermediate, hidden, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out
