"""Upstream vLLM's backend API, as a legacy backend imports it: the deprecated legacy
surface.

These modules hold the types; the modules at upstream's import paths under ``vllm/``
(``vllm.attention.backends.abstract``, ``vllm.v1.attention.backend``, ``vllm.config``,
...) only re-export them. A backend that subclasses these bases, or is written against
these names, runs unchanged through :func:`shim.adapt_legacy_backend`; what works and
what does not is listed in ``migration_guide.md`` ("The legacy surface"). The new API
(``vllm.attention``) never imports from here.
"""
