"""Upstream's ``vllm.attention.backends.abstract`` (the v0.10 line's backend bases).

Part of the deprecated legacy surface: upstream vLLM's names at upstream's import path, so a
backend written against upstream runs unchanged through the adapter. The types live in
``shim.upstream.backend``; new code uses ``vllm.attention`` (see ``migration_guide.md``,
"The legacy surface").
"""

from shim.upstream.backend import *  # noqa: F403
from shim.upstream.backend import __all__ as __all__
