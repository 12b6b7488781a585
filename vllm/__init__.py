"""Attention backends with the KV-cache write as its own capability.

Imported as ``vllm``; distributed as ``vllm-kv-writer`` (it cannot share an
environment with upstream vLLM, which uses the same import name).
"""

__version__ = "0.1.0"
