"""Upstream's ``vllm.utils``: ``cdiv`` and ``round_up`` (the deprecated legacy surface).

This package's own helpers live under ``vllm.attention``; nothing here is new API.
"""

from shim.upstream.utils import cdiv, round_up

__all__ = ["cdiv", "round_up"]
