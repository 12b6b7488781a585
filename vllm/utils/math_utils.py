"""Upstream's ``vllm.utils.math_utils``.

Part of the deprecated legacy surface: upstream vLLM's names at upstream's import path, so a
backend written against upstream runs unchanged through the adapter. The types live in
``shim.upstream.utils``; new code uses ``vllm.attention`` (see ``migration_guide.md``,
"The legacy surface").
"""

from shim.upstream.utils import *  # noqa: F403
from shim.upstream.utils import __all__ as __all__
