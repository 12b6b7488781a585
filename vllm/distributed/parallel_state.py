"""Upstream's ``vllm.distributed.parallel_state``: process groups of world size 1.

Part of the deprecated legacy surface: upstream vLLM's names at upstream's import path, so a
backend written against upstream runs unchanged through the adapter. The types live in
``shim.upstream.parallel``; new code uses ``vllm.attention`` (see ``migration_guide.md``,
"The legacy surface").
"""

from shim.upstream.parallel import *  # noqa: F403
from shim.upstream.parallel import __all__ as __all__
