"""The KV-cache write as its own capability: protocols, backends, layers."""

from vllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    PagedAttentionMetadata,
    SizeSpec,
    allocate_kv_cache,
)
from vllm.attention.errors import (
    AttentionError,
    BackendNotFoundError,
    ForwardContextError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheWriteError,
    LegacyBackendError,
    NoBackendError,
    PluginLoadError,
    UnsupportedBackendError,
)
from vllm.attention.rope import RoPE
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writer import (
    FusedRoPEKVCacheWriter,
    FusedRoPEMLAKVCacheWriter,
    KVCacheWriter,
    MLAKVCacheWriter,
)

__all__ = [
    "AttentionBackend",
    "AttentionError",
    "AttentionImpl",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "BackendNotFoundError",
    "CommonAttentionMetadata",
    "ForwardContextError",
    "FusedRoPEKVCacheWriter",
    "FusedRoPEMLAKVCacheWriter",
    "InvalidArgumentError",
    "InvalidTypeError",
    "KVCacheDType",
    "KVCacheLayout",
    "KVCacheWriteError",
    "KVCacheWriter",
    "KVQuant",
    "LegacyBackendError",
    "MLAKVCacheWriter",
    "NoBackendError",
    "PagedAttentionMetadata",
    "PluginLoadError",
    "RoPE",
    "SizeSpec",
    "UnsupportedBackendError",
    "allocate_kv_cache",
]
