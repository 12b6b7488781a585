"""``vllm.config``: the configuration objects a legacy backend reads.

Only the fields backends read are here, with upstream's names and defaults; the adapter
fills them from the layer it runs (see ``migration_guide.md``, "The legacy surface").
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

__all__ = [
    "AttentionConfig",
    "CUDAGraphMode",
    "CacheConfig",
    "CacheDType",
    "CompilationConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "VllmConfig",
    "get_current_vllm_config",
    "get_layers_from_vllm_config",
    "set_current_vllm_config",
]

CacheDType = Literal[
    "auto",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "int8_per_token_head",
    "fp8_per_token_head",
]
"""vLLM's ``--kv-cache-dtype`` values (``vllm.config.cache.CacheDType``)."""

BlockSize = int


class CUDAGraphMode(enum.Enum):
    """How the engine captures CUDA graphs (the builder asks whether graphs are full)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = 3
    FULL_AND_PIECEWISE = 4

    def has_full_cudagraphs(self) -> bool:
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY,
                        CUDAGraphMode.FULL_AND_PIECEWISE)

    def has_piecewise_cudagraphs(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1


@dataclass
class ModelConfig:
    """The model as a backend sees it: one layer group's heads and dtype."""

    dtype: torch.dtype = torch.bfloat16
    num_attention_heads: int = 1
    num_kv_heads: int = 1
    head_size: int = 64
    max_model_len: int = 8192
    is_hybrid: bool = False
    use_mla: bool = False
    enforce_eager: bool = False

    def get_num_attention_heads(self, parallel_config: ParallelConfig | None = None) -> int:
        return self.num_attention_heads

    def get_num_kv_heads(self, parallel_config: ParallelConfig | None = None) -> int:
        return self.num_kv_heads

    def get_head_size(self) -> int:
        return self.head_size


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: CacheDType = "auto"
    """The spelling the layer was built with (``fp8``, ``fp8_e4m3``, ``bfloat16``...)."""
    enable_prefix_caching: bool = False
    calculate_kv_scales: bool = False
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192


@dataclass
class CompilationConfig:
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    """The runner captures whole steps, but legacy builders are built for eager steps:
    they see ``NONE`` and keep no persistent graph buffers of their own."""
    full_cuda_graph: bool = False
    max_cudagraph_capture_size: int | None = None
    max_capture_size: int = 0
    cudagraph_capture_sizes: list[int] = field(default_factory=list)
    static_forward_context: Mapping[str, Any] = field(default_factory=dict)
    """Layer name -> the layer a legacy impl is called with (every adapted layer)."""


@dataclass
class AttentionConfig:
    backend: str | None = None
    flash_attn_version: int | None = None
    flash_attn_max_num_splits_for_cuda_graph: int = 32
    use_prefill_decode_attention: bool = False


@dataclass
class VllmConfig:
    model_config: ModelConfig | None = None
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    attention_config: AttentionConfig = field(default_factory=AttentionConfig)
    speculative_config: Any = None
    kv_transfer_config: Any = None
    lora_config: Any = None


_DEFAULT = VllmConfig()
_current: contextvars.ContextVar[VllmConfig | None] = contextvars.ContextVar(
    "vllm_legacy_config", default=None)


def get_current_vllm_config() -> VllmConfig:
    """The config of the legacy layer being built or run; outside one, the defaults
    (``model_config`` None), as upstream returns outside a config context."""
    cfg = _current.get()
    return _DEFAULT if cfg is None else cfg


@contextlib.contextmanager
def set_current_vllm_config(vllm_config: VllmConfig, *_args: object,
                            **_kwargs: object) -> Iterator[None]:
    token = _current.set(vllm_config)
    try:
        yield
    finally:
        _current.reset(token)


T = TypeVar("T")


def get_layers_from_vllm_config(vllm_config: VllmConfig, layer_type: type[T],
                                layer_names: list[str] | None = None) -> dict[str, T]:
    """The layers of ``vllm_config`` that are ``layer_type`` instances, by name.

    Legacy impls are called with the legacy layer (``vllm.model_executor.layers.attention
    .Attention``); asking for the new :class:`vllm.attention.Attention` returns those too,
    since a legacy backend of upstream's v0.10 line imported the layer from there.
    """
    forward_context = vllm_config.compilation_config.static_forward_context
    names = list(forward_context) if layer_names is None else layer_names
    found: dict[str, T] = {}
    for name in names:
        layer = forward_context.get(name)
        if isinstance(layer, layer_type) or isinstance(getattr(layer, "layer", None), layer_type):
            found[name] = layer  # type: ignore[assignment]
    return found
