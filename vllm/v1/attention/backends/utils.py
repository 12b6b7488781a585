"""Upstream's ``vllm.v1.attention.backends.utils``: builder bases and batch helpers.

Part of the deprecated legacy surface: upstream vLLM's names at upstream's import path, so a
backend written against upstream runs unchanged through the adapter. The types live in
``shim.upstream.batch_utils``; new code uses ``vllm.attention`` (see ``migration_guide.md``,
"The legacy surface").
"""

from shim.upstream.batch_utils import *  # noqa: F403
from shim.upstream.batch_utils import __all__ as __all__
