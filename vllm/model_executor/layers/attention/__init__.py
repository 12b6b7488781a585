"""Upstream's ``vllm.model_executor.layers.attention``: the layer a legacy impl is called with.

Part of the deprecated legacy surface: upstream vLLM's names at upstream's import path, so a
backend written against upstream runs unchanged through the adapter. The types live in
``shim.upstream.layer``; new code uses ``vllm.attention`` (see ``migration_guide.md``,
"The legacy surface").
"""

from shim.upstream.layer import *  # noqa: F403
from shim.upstream.layer import __all__ as __all__
