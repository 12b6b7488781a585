"""Typed options shared by writers, backends and the layer.

Layouts are described once in ``docs/layouts.md``; this module only names them.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Final, Literal, get_args

import torch

from vllm.attention.errors import InvalidArgumentError

KVCacheDType = Literal[
    "auto",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_ds_mla",
    "int8_per_token_head",
    "fp8_per_token_head",
]
"""Cache element formats. ``auto`` stores the model dtype unscaled; ``fp8`` is E4M3."""

KV_CACHE_DTYPES: Final[tuple[KVCacheDType, ...]] = get_args(KVCacheDType)

HALF_DTYPES: Final[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
"""The 16-bit float dtypes: what the tensor-core and flash kernels take as operands."""


UNQUANTISED_SPELLINGS: Final[dict[str, torch.dtype]] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""vLLM's names for an unquantised cache of one dtype; they mean ``auto`` for a model of
that dtype (``docs/layouts.md``)."""

_ACCEPTED: Final[tuple[str, ...]] = KV_CACHE_DTYPES + tuple(UNQUANTISED_SPELLINGS)


def parse_kv_cache_dtype(
    value: str, *, argument: str = "kv_cache_dtype", model_dtype: torch.dtype | None = None
) -> KVCacheDType:
    """Return ``value`` as a :data:`KVCacheDType`, or raise naming the allowed values.

    vLLM's spellings ``bfloat16`` / ``float16`` (an unquantised cache of that dtype)
    become ``auto``; given ``model_dtype``, they must name it.
    """
    for allowed in KV_CACHE_DTYPES:
        if value == allowed:
            return allowed
    named = UNQUANTISED_SPELLINGS.get(value)
    if named is None:
        raise InvalidArgumentError(argument, value, f"one of {', '.join(_ACCEPTED)}")
    if model_dtype is not None and named != model_dtype:
        model = str(model_dtype).removeprefix("torch.")
        raise InvalidArgumentError(
            argument, value,
            f"'auto' or '{model}': an unquantised cache holds the model dtype ({model})",
        )
    return "auto"


_SAME_FORMAT: Final[dict[KVCacheDType, KVCacheDType]] = {"fp8": "fp8_e4m3"}


def kv_cache_format(cache_dtype: KVCacheDType) -> KVCacheDType:
    """The storage format a spelling names: ``fp8`` and ``fp8_e4m3`` are one (E4M3)."""
    return _SAME_FORMAT.get(cache_dtype, cache_dtype)


def declared_spelling(
    cache_dtype: KVCacheDType, declared: frozenset[KVCacheDType]
) -> KVCacheDType | None:
    """The member of ``declared`` that names the same format as ``cache_dtype`` (the
    spelling a backend's own code expects), or None when it declares no such format."""
    if cache_dtype in declared:
        return cache_dtype
    fmt = kv_cache_format(cache_dtype)
    return next((d for d in sorted(declared) if kv_cache_format(d) == fmt), None)


_FP8_TORCH_DTYPE: Final[dict[str, torch.dtype]] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8_scaled(cache_dtype: KVCacheDType) -> bool:
    """True for the per-tensor / per-head scaled fp8 formats (not the MLA or per-token ones)."""
    return cache_dtype in _FP8_TORCH_DTYPE


def cache_storage_dtype(cache_dtype: KVCacheDType, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensor for ``cache_dtype`` with a model in ``model_dtype``."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in _FP8_TORCH_DTYPE:
        return _FP8_TORCH_DTYPE[cache_dtype]
    # Byte-packed formats: values and their scales share one uint8 row.
    return torch.uint8


class KVCacheLayout(enum.Enum):
    """How a backend's ``kv_cache`` tensor holds K and V (see ``docs/layouts.md``)."""

    SPLIT_NHD = "split_nhd"
    """Logical and physical ``(nb, 2, bs, H, D)``."""
    SPLIT_HND = "split_hnd"
    """Logical ``(nb, 2, bs, H, D)``, physical ``(nb, 2, H, bs, D)``."""
    SPLIT_KV_FIRST = "split_kv_first"
    """Logical and physical ``(2, nb, bs, H, D)``."""
    SPLIT_BLOCK_INTERLEAVED = "split_block_interleaved"
    """Logical ``(nb, 2, bs, H, D)``, physical ``(nb, bs, 2, H, D)`` (FlexAttention)."""
    LEGACY_PAGED = "legacy_paged"
    """``(2, nb, bs*H*D)``: K ``[nb, H, D/x, bs, x]``, V ``[nb, H, D, bs]``."""
    AITER_SHUFFLED = "aiter_shuffled"
    """``(2, nb, bs, H, D)`` bytes read as K ``[nb, H, D/x, bs, x]``, V ``[nb, H, bs/x, D, x]``."""
    DIFFKV_PACKED = "diffkv_packed"
    """``(nb, bs, H, Dk + Dv)``: K then V on the last axis."""
    PER_TOKEN_HEAD_QUANT = "per_token_head_quant"
    """``(nb, 2, bs, H, D + 4)`` bytes: D quantised values then a float32 scale."""
    MLA_LATENT = "mla_latent"
    """``(nb, bs, kv_lora_rank + rope_dim)``."""
    MLA_FP8_DS = "mla_fp8_ds"
    """``(nb, bs, 656)`` uint8: 512 E4M3, 4 float32 tile scales, 64 16-bit rope values."""


class AttentionType(str, enum.Enum):
    """Which tokens attend to which, and whether a cache is involved.

    Members are strings: ``AttentionType.DECODER == "decoder"``, as in vLLM.
    """

    DECODER = "decoder"
    """Causal self-attention over the paged cache."""
    ENCODER = "encoder"
    """Non-causal self-attention over the paged cache (encoder of an encoder-decoder)."""
    ENCODER_ONLY = "encoder_only"
    """Non-causal attention over this step's K/V; no cache at all."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention: decoder queries over the encoder K/V, written to the cache once."""


def _checked_scale(name: str, scale: object) -> torch.Tensor:
    """``scale`` as a 1-D float32 tensor; a 0-d one (vLLM's ``layer._k_scale``) becomes a
    ``[1]`` view of the same storage. Values are checked where that needs no device sync
    (a CPU tensor); a scale on an accelerator is the caller's to keep positive and finite
    (the :class:`~vllm.attention.Attention` layer checks its own when it is built)."""
    if not isinstance(scale, torch.Tensor):
        raise InvalidArgumentError(name, type(scale).__name__, "a float32 torch.Tensor")
    if scale.dtype != torch.float32:
        raise InvalidArgumentError(f"{name}.dtype", scale.dtype, "torch.float32")
    if scale.dim() == 0:
        scale = scale.view(1)
    if scale.dim() != 1 or scale.numel() < 1:
        raise InvalidArgumentError(
            f"{name}.shape", tuple(scale.shape), "[1] or [num_kv_heads] (or 0-d: one value)")
    if scale.device.type == "cpu" and not bool(((scale > 0) & scale.isfinite()).all()):
        raise InvalidArgumentError(name, scale.tolist(), "positive, finite values")
    return scale


_SCALES: dict[int, tuple[weakref.ref[torch.Tensor], int, float]] = {}


def host_scale(t: torch.Tensor) -> float:
    """``float(t)`` for a one-element scale, read from the device once per version of
    the tensor (so a warmed-up call reads no device value, also under graph capture):
    for kernels and legacy code that take a scale as a host float."""
    hit = _SCALES.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    value = float(t.reshape(-1)[0].item())
    if len(_SCALES) > 256:
        _SCALES.clear()
    _SCALES[id(t)] = (weakref.ref(t), t._version, value)
    return value


@dataclass(frozen=True)
class KVQuant:
    """How values are stored: the cache format and its float32 scales.

    ``k_scale`` / ``v_scale``: float32, shape ``[1]`` (per tensor) or ``[num_kv_heads]``; a
    0-d tensor is taken as ``[1]``. CPU scales must be positive and finite (checked here);
    scales on an accelerator are not read back to check them. Ignored for ``auto`` and the
    formats that carry their own scales.
    """

    kv_cache_dtype: KVCacheDType
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __post_init__(self) -> None:
        parse_kv_cache_dtype(self.kv_cache_dtype, argument="KVQuant.kv_cache_dtype")
        object.__setattr__(self, "k_scale", _checked_scale("k_scale", self.k_scale))
        object.__setattr__(self, "v_scale", _checked_scale("v_scale", self.v_scale))

    @classmethod
    def of_checked(cls, kv_cache_dtype: KVCacheDType, k_scale: torch.Tensor,
                   v_scale: torch.Tensor) -> KVQuant:
        """A ``KVQuant`` around scales a checked one already holds (a writer re-binding
        the tensors of a call it validated): no check runs again, so what passed once
        (a device tensor's values are never read) is not refused the second time."""
        quant = object.__new__(cls)
        object.__setattr__(quant, "kv_cache_dtype", kv_cache_dtype)
        object.__setattr__(quant, "k_scale", k_scale)
        object.__setattr__(quant, "v_scale", v_scale)
        return quant

    @classmethod
    def unscaled(
        cls, kv_cache_dtype: KVCacheDType = "auto", device: torch.device | str = "cpu"
    ) -> KVQuant:
        """Scales of 1.0 (per tensor) on ``device``."""
        one = torch.ones(1, dtype=torch.float32, device=device)
        return cls(kv_cache_dtype, one, one.clone())
