"""The shape and weights of one MLA layer: :class:`MLALayerSpec` and
:class:`MLAProjection`.

Below both the backends (:mod:`.common`) and the vendor kernels
(:mod:`vllm.attention.ops.mla_vendor`), which read the same spec; the math is in
``docs/mla.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.attention.backend import AttentionLayerSpec
from vllm.attention.errors import InvalidArgumentError, InvalidTypeError
from vllm.attention.ops.head_matmul import head_matmul
from vllm.attention.types import AttentionType, KVCacheDType


@dataclass(frozen=True, eq=False)
class MLAProjection:
    """The up-projections the impl absorbs (decode) or applies (prefill).

    ``w_uk``: ``[N, P, L]`` (``k_nope[n] = W_UK[n] @ kv_c``);
    ``w_uv``: ``[N, L, V]`` (``v[n] = kv_c @ W_UV[n]``). On the compute device,
    in any float dtype (the paths compute in float32 or the model dtype).
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("w_uk", "w_uv"):
            w = getattr(self, name)
            if not isinstance(w, torch.Tensor):
                raise InvalidTypeError(name, type(w).__name__, "a torch.Tensor")
            if w.dim() != 3 or not w.is_floating_point():
                raise InvalidArgumentError(
                    f"{name}.shape", tuple(w.shape), "a 3-D float tensor ([N, P, L] / [N, L, V])"
                )
        if self.w_uk.shape[0] != self.w_uv.shape[0] or self.w_uk.shape[2] != self.w_uv.shape[1]:
            raise InvalidArgumentError(
                "w_uv.shape", tuple(self.w_uv.shape),
                f"[N={self.w_uk.shape[0]}, L={self.w_uk.shape[2]}, V] to match w_uk",
            )

    @classmethod
    def from_kv_b_proj(cls, weight: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int,
                       v_head_dim: int) -> MLAProjection:
        """Split a ``kv_b_proj`` weight ``[N * (P + V), L]`` (``nn.Linear`` layout)."""
        rows = num_heads * (qk_nope_head_dim + v_head_dim)
        if weight.dim() != 2 or weight.shape[0] != rows:
            raise InvalidArgumentError(
                "weight.shape", tuple(weight.shape), f"[N * (P + V) = {rows}, kv_lora_rank]"
            )
        w = weight.view(num_heads, qk_nope_head_dim + v_head_dim, weight.shape[1])
        w_uk = w[:, :qk_nope_head_dim].contiguous()
        w_uv = w[:, qk_nope_head_dim:].transpose(1, 2).contiguous()
        return cls(w_uk=w_uk, w_uv=w_uv)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``[T, N, P]`` -> ``[T, N, L]`` (``q_nope[n] @ W_UK[n]``), in ``q_nope.dtype``
        (:func:`~vllm.attention.ops.head_matmul.head_matmul`: Triton at decode batch
        sizes on sm_90+, else ``torch.bmm``)."""
        return head_matmul(q_nope, self.w_uk.to(device=q_nope.device, dtype=q_nope.dtype))

    def project_output(self, o_lat: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, N, L]`` -> ``[T, N, V]`` (``o_lat[n] @ W_UV[n]``), in ``o_lat.dtype``;
        into ``out`` (``[T, N, V]``, that dtype, unit stride on the last axis: the
        rows of a layer's output) when given."""
        return head_matmul(o_lat, self.w_uv.to(device=o_lat.device, dtype=o_lat.dtype), out)


@dataclass(frozen=True, kw_only=True)
class MLALayerSpec(AttentionLayerSpec):
    """An MLA layer: ``num_kv_heads = 1`` and ``head_size = kv_lora_rank + rope_dim``
    (the cache row); queries are ``[T, N, qk_nope_head_dim + qk_rope_head_dim]`` and
    the output ``[T, N * v_head_dim]``. Build with :meth:`create`."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    projection: MLAProjection = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(name, value, "a positive int")
        if self.num_kv_heads != 1:
            raise InvalidArgumentError("num_kv_heads", self.num_kv_heads, "1 for MLA")
        if self.head_size != self.kv_lora_rank + self.qk_rope_head_dim:
            raise InvalidArgumentError(
                "head_size", self.head_size,
                f"kv_lora_rank + qk_rope_head_dim = {self.kv_lora_rank + self.qk_rope_head_dim}",
            )
        want_uk = (self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank)
        want_uv = (self.num_heads, self.kv_lora_rank, self.v_head_dim)
        if not isinstance(self.projection, MLAProjection):
            raise InvalidTypeError("projection", type(self.projection).__name__, "an MLAProjection")
        if tuple(self.projection.w_uk.shape) != want_uk:
            raise InvalidArgumentError("projection.w_uk.shape", tuple(self.projection.w_uk.shape),
                                       f"[N, P, L] = {list(want_uk)}")
        if tuple(self.projection.w_uv.shape) != want_uv:
            raise InvalidArgumentError("projection.w_uv.shape", tuple(self.projection.w_uv.shape),
                                       f"[N, L, V] = {list(want_uv)}")
        if self.sliding_window is not None or self.logits_soft_cap is not None:
            raise InvalidArgumentError(
                "sliding_window/logits_soft_cap", (self.sliding_window, self.logits_soft_cap),
                "None for MLA",
            )
        if self.attn_type is not AttentionType.DECODER:
            raise InvalidArgumentError("attn_type", self.attn_type.value, "decoder for MLA")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def create(
        cls,
        *,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        projection: MLAProjection,
        scale: float | None = None,
        kv_cache_dtype: KVCacheDType = "auto",
        kv_sharing_target_layer_name: str | None = None,
    ) -> MLALayerSpec:
        """The spec with the derived fields filled in; ``scale`` defaults to
        ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``."""
        return cls(
            num_heads=num_heads,
            head_size=kv_lora_rank + qk_rope_head_dim,
            num_kv_heads=1,
            scale=(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 if scale is None else scale,
            kv_cache_dtype=kv_cache_dtype,
            kv_sharing_target_layer_name=kv_sharing_target_layer_name,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            projection=projection,
        )
