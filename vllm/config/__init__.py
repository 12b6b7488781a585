"""Upstream's ``vllm.config``: the configuration a legacy backend reads.

Part of the deprecated legacy surface: upstream vLLM's names at upstream's import path, so a
backend written against upstream runs unchanged through the adapter. The types live in
``shim.upstream.config``; new code uses ``vllm.attention`` (see ``migration_guide.md``,
"The legacy surface").
"""

from shim.upstream.config import *  # noqa: F403
from shim.upstream.config import __all__ as __all__
