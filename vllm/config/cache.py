"""Upstream's ``vllm.config.cache``: ``CacheDType`` and ``CacheConfig``.

Part of the deprecated legacy surface (see ``vllm.config``).
"""

from shim.upstream.config import BlockSize, CacheConfig, CacheDType

__all__ = ["BlockSize", "CacheConfig", "CacheDType"]
