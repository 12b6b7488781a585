"""An out-of-tree plugin backend registered with
``@register_backend(AttentionBackendEnum.CUSTOM)``: it subclasses the flagged
FlashAttention backend (its metadata, cache layout and ``do_kv_cache_update``) and
computes with torch's varlen flash attention API. Written against the interface of
torchtitan's vLLM attention backend: https://github.com/pytorch/torchtitan at commit
311e6fcba8c186e1ef545d89ce23e64c6b06d569, torchtitan/experiments/rl/models/attention.py,
the classes ``PyTorchVarlenAttentionBackend`` and ``PyTorchVarlenAttentionImpl``.

Kept from that interface: the imports, the class names and bases, the method names and
signatures, the registration, and the calls it makes (torch's
``current_flash_attention_impl`` / ``activate_flash_attention_impl``, ``varlen_attn_out``
with the arguments it passes and without ``enable_gqa``, which is why GQA and MQA layers
fail on torch 2.13, and the window ``(-1, 0)`` whatever the layer's sliding window or soft
cap). The code, docstrings and comments are this project's own. Where torchtitan imports
vLLM's FlashAttention it imports :mod:`.flash_attn_flagged` (this project's backend written
against that interface); torchtitan's helpers (``is_in_batch_invariant_mode``,
``warn_once``, ``has_cuda_capability``) and ``varlen_attn_out`` come from :mod:`.kernels`
(torch's flash kernel under ``varlen_attn_out`` has no CPU implementation).
``activate_flash_attention_impl`` and ``current_flash_attention_impl`` are torch's own.
torchtitan's model-side wrapper around the layer is left out.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl

from tests.legacy_backends.upstream import kernels as varlen
from tests.legacy_backends.upstream.flash_attn_flagged import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
)
from tests.legacy_backends.upstream.kernels import (
    has_cuda_capability,
    is_in_batch_invariant_mode,
    warn_once,
)
from vllm.v1.attention.backend import AttentionLayer, AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

logger = logging.getLogger(__name__)


@register_backend(AttentionBackendEnum.CUSTOM)
class PyTorchVarlenAttentionBackend(FlashAttentionBackend):
    """FlashAttention's metadata, cache and cache write, with the attention computed by
    torch's varlen kernel. Chosen by the engine when asked for the CUSTOM backend, the
    name a plugin must answer to."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[PyTorchVarlenAttentionImpl]:
        return PyTorchVarlenAttentionImpl


class PyTorchVarlenAttentionImpl(FlashAttentionImpl):
    """Decoder attention over the paged cache through
    ``torch.nn.attention.varlen.varlen_attn_out``: causal only, no encoder types, fp8
    cache, cascade, context parallelism or ALiBi."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not has_cuda_capability(9, 0):
            warn_once(logger, "torch varlen attention: no SM 9.0 device, using FA2")
        elif current_flash_attention_impl() != "FA3":
            # activating re-registers torch's kernels: do it once per process
            activate_flash_attention_impl("FA3")

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, num_heads, head_size]`` over ``kv_cache`` ``[2, num_blocks,
        block_size, num_kv_heads, head_size]`` (already holding this step's K/V);
        returns ``output[:num_actual_tokens]``, filled."""
        if output is None:
            raise ValueError("PyTorchVarlenAttentionImpl.forward writes into output")
        if self.vllm_flash_attn_version is None:
            raise RuntimeError("no FlashAttention version was found")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("PyTorchVarlenAttentionImpl does not quantise its output")
        if attn_metadata is None:  # a profiling step
            return output.fill_(0)

        m = attn_metadata
        unsupported = [
            (self.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER),
             f"attention type {self.attn_type}"),
            (self.kv_cache_dtype.startswith("fp8"), "an fp8 KV cache"),
            (m.use_cascade, "cascade attention"),
            (self.dcp_world_size != 1, "decode context parallelism"),
            (not m.causal, "non-causal attention"),
            (self.alibi_slopes is not None, "ALiBi"),
        ]
        for refused, what in unsupported:
            if refused:
                raise NotImplementedError(f"PyTorchVarlenAttentionImpl: no {what}")

        key_cache, value_cache = kv_cache.unbind(0)
        n = m.num_actual_tokens
        fa3 = current_flash_attention_impl() == "FA3"
        if fa3:
            cu_seqlens_k = None  # FA3 reads key lengths from seqused_k and the block table
        else:  # FA2 wants the cumulative key lengths as well
            cu_seqlens_k = torch.nn.functional.pad(
                torch.cumsum(m.seq_lens, dim=0, dtype=torch.int32), (1, 0))
        options: dict[str, Any] = {}
        if fa3 and is_in_batch_invariant_mode():
            options["num_splits"] = 1  # one split: the sum order never depends on the batch

        out = varlen.varlen_attn_out(
            output[:n],
            query[:n],
            key_cache,
            value_cache,
            m.query_start_loc,
            cu_seqlens_k,
            m.max_query_len,
            m.max_seq_len,
            scale=self.scale,
            window_size=(-1, 0),
            block_table=m.block_table,
            seqused_k=m.seq_lens,
            **options,
        )
        assert isinstance(out, torch.Tensor)  # no return_aux: the output alone
        return out
