"""Upstream's ``vllm._custom_ops``: the cache-write ops, routed through this package's writers.

Part of the deprecated legacy surface: upstream vLLM's names at upstream's import path, so a
backend written against upstream runs unchanged through the adapter. The types live in
``shim.upstream.ops``; new code uses ``vllm.attention`` (see ``migration_guide.md``,
"The legacy surface").
"""

from shim.upstream.ops import *  # noqa: F403
from shim.upstream.ops import __all__ as __all__
