"""Upstream's ``vllm.v1.kv_cache_interface``: the cache specs a builder is given.

Part of the deprecated legacy surface: upstream vLLM's names at upstream's import path, so a
backend written against upstream runs unchanged through the adapter. The types live in
``shim.upstream.kv_cache_interface``; new code uses ``vllm.attention`` (see ``migration_guide.md``,
"The legacy surface").
"""

from shim.upstream.kv_cache_interface import *  # noqa: F403
from shim.upstream.kv_cache_interface import __all__ as __all__
