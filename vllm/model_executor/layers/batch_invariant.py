"""Upstream's ``vllm.model_executor.layers.batch_invariant`` (the deprecated legacy
surface): whether batch-invariant kernels are asked for (``VLLM_BATCH_INVARIANT=1``)."""

from shim.upstream.utils import vllm_is_batch_invariant

__all__ = ["vllm_is_batch_invariant"]
