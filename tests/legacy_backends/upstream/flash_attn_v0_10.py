"""A *fused* legacy backend (``forward()`` writes the cache with
``reshape_and_cache_flash`` from ``attn_metadata.slot_mapping``), written against the
interface of vLLM's v1 FlashAttention backend of the v0.10 line:
https://github.com/vllm-project/vllm at commit 0084b783bcda6d7ee15c337b1062cbee9985c954,
vllm/v1/attention/backends/flash_attn.py.

Kept from that interface: the framework imports, the class names, the public method
names and signatures, the metadata dataclass's field names, and the calls into the
framework (what the builder reads from ``common_attn_metadata`` and ``vllm_config``,
``get_kv_cache_layout()``, ``get_layers_from_vllm_config``, the layer's ``_q_scale`` /
``_k_scale`` / ``_v_scale``, ``kv_cache.unbind(0)``, ``reshape_and_cache_flash`` inside
``forward``, ``flash_attn_varlen_func``'s keywords). The code, docstrings and comments
are this project's own. The flash-attention kernels and ``_custom_ops`` helpers come from
:mod:`.kernels` (torch stand-ins with the same signatures), where upstream imports
``vllm.attention.utils.fa_utils``, ``vllm._custom_ops`` and ``merge_attn_states``; so do
``use_cascade_attention`` and ``cascade_attention``, which upstream defines in this module.

Left out: the persistent FA3 scheduler buffer for full CUDA graphs (a legacy builder here
is never captured: ``cudagraph_mode`` is ``NONE``) and the cost model behind
``use_cascade_attention`` (a plain eligibility rule stands in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from tests.legacy_backends.upstream import kernels as ops
from tests.legacy_backends.upstream.kernels import (
    cascade_attention,
    expand_descales,
    flash_attn_supports_fp8,
    flash_attn_varlen_func,
    get_flash_attn_version,
    get_scheduler_metadata,
    reshape_and_cache_flash,
    use_cascade_attention,
)
from vllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionType,
    is_quantized_kv_cache,
)
from vllm.attention.layer import Attention
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backends.utils import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    get_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import AttentionSpec

logger = init_logger(__name__)

_NO_WINDOW = (-1, -1)
_STRIDE_ORDER = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}


class FlashAttentionBackend(AttentionBackend):
    """Paged FlashAttention over a ``(2, num_blocks, block_size, num_kv_heads,
    head_size)`` cache; the impl's ``forward`` writes the step's K/V before reading."""

    accept_output_buffer: bool = True

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(32, 257, 32))

    @classmethod
    def validate_head_size(cls, head_size: int) -> None:
        allowed = cls.get_supported_head_sizes()
        if head_size not in allowed:
            raise ValueError(
                f"{cls.__name__}: head_size={head_size} is not one of {allowed}; "
                "FLEX_ATTENTION takes any head size.")

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN_VLLM_V1"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        return FlashAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
    ) -> tuple[int, ...]:
        if block_size % 16:
            raise ValueError(f"block_size={block_size}: FlashAttention pages in multiples of 16")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def swap_blocks(
        src_kv_cache: torch.Tensor,
        dst_kv_cache: torch.Tensor,
        src_to_dst: torch.Tensor,
    ) -> None:
        for half in range(2):  # keys, then values
            ops.swap_blocks(src_kv_cache[half], dst_kv_cache[half], src_to_dst)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        layout = get_kv_cache_layout()
        if layout not in _STRIDE_ORDER:
            raise ValueError(f"kv cache layout {layout!r}: FlashAttention reads NHD or HND")
        return _STRIDE_ORDER[layout]

    @staticmethod
    def get_fp8_dtype_for_flashattn(kv_cache_dtype: str) -> torch.dtype:
        if kv_cache_dtype not in ("fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} has no FlashAttention fp8 dtype")
        return torch.float8_e4m3fn


@dataclass
class FlashAttentionMetadata:
    """One step's batch. Per request, ``seq_lens`` counts every key it attends to (the
    cached context plus this step's tokens) and the query length is the difference of
    consecutive ``query_start_loc`` entries; ``slot_mapping`` names where this step's
    tokens are written. The ``cu_prefix_query_lens`` / ``prefix_kv_lens`` /
    ``suffix_kv_lens`` are set only when ``use_cascade``."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    use_cascade: bool
    common_prefix_len: int
    cu_prefix_query_lens: torch.Tensor | None
    prefix_kv_lens: torch.Tensor | None
    suffix_kv_lens: torch.Tensor | None

    scheduler_metadata: torch.Tensor | None = None
    prefix_scheduler_metadata: torch.Tensor | None = None
    max_num_splits: int = 0

    causal: bool = True


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Turns the common batch description into :class:`FlashAttentionMetadata`; on FA3 it
    also asks the ahead-of-time scheduler for each pass's work split."""

    cudagraph_support = (AttentionCGSupport.ALWAYS if get_flash_attn_version() == 3
                         else AttentionCGSupport.UNIFORM_BATCH)

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.cache_config = vllm_config.cache_config
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        if model is None:
            raise ValueError("FlashAttentionMetadataBuilder needs vllm_config.model_config")
        self.num_heads_q = model.get_num_attention_heads(parallel)
        self.num_heads_kv = model.get_num_kv_heads(parallel)
        self.headdim = model.get_head_size()
        self.kv_cache_dtype = kv_cache_spec.dtype
        self.block_size = kv_cache_spec.block_size
        self.aot_schedule = get_flash_attn_version() == 3
        compilation = vllm_config.compilation_config
        self.use_full_cuda_graph = compilation.cudagraph_mode.has_full_cudagraphs()
        self.max_num_splits = 0
        # the scheduler needs one window for every layer; known once the layers exist
        self.aot_sliding_window: tuple[int, int] | None = None

    def _resolve_aot_window(self) -> None:
        # the layers found are the views legacy impls are called with, holding those impls
        windows = {cast(FlashAttentionImpl, layer.impl).sliding_window
                   for layer in get_layers_from_vllm_config(self.vllm_config, Attention).values()}
        if len(windows) > 1:
            logger.info_once("layers differ in sliding window: FA3 schedules per call")
            self.aot_schedule = False
        self.aot_sliding_window = windows.pop() if len(windows) == 1 else _NO_WINDOW

    def _schedule(self, enabled: bool, num_reqs: int, cu_query_lens: torch.Tensor,
                  max_query_len: int, kv_lens: torch.Tensor, max_kv_len: int,
                  causal: bool) -> torch.Tensor | None:
        if not enabled:
            return None
        spelled = self.cache_config.cache_dtype
        qkv_dtype = (FlashAttentionBackend.get_fp8_dtype_for_flashattn(spelled)
                     if spelled.startswith("fp8") else self.kv_cache_dtype)
        return get_scheduler_metadata(
            batch_size=num_reqs, max_seqlen_q=max_query_len, max_seqlen_k=max_kv_len,
            num_heads_q=self.num_heads_q, num_heads_kv=self.num_heads_kv,
            headdim=self.headdim, cache_seqlens=kv_lens, qkv_dtype=qkv_dtype,
            cu_seqlens_q=cu_query_lens, page_size=self.block_size, causal=causal,
            window_size=self.aot_sliding_window, num_splits=self.max_num_splits)

    def build(self,
              common_prefix_len: int,
              common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashAttentionMetadata:
        """``fast_build`` skips the FA3 scheduler (few steps reuse it: drafting)."""
        c = common_attn_metadata
        if self.aot_schedule and not fast_build and self.aot_sliding_window is None:
            self._resolve_aot_window()
        aot = self.aot_schedule and not fast_build

        cascade: dict[str, Any] = dict.fromkeys(
            ("cu_prefix_query_lens", "prefix_kv_lens", "suffix_kv_lens",
             "prefix_scheduler_metadata"))
        if common_prefix_len > 0:
            as_i32: dict[str, Any] = dict(dtype=torch.int32, device=self.device)
            suffix = (c.seq_lens_cpu[:c.num_reqs] - common_prefix_len).to(self.device,
                                                                        non_blocking=True)
            cascade.update(
                cu_prefix_query_lens=torch.tensor([0, c.num_actual_tokens], **as_i32),
                prefix_kv_lens=torch.tensor([common_prefix_len], **as_i32),
                suffix_kv_lens=suffix)
            cascade["prefix_scheduler_metadata"] = self._schedule(
                aot, 1, cascade["cu_prefix_query_lens"], c.num_actual_tokens,
                cascade["prefix_kv_lens"], common_prefix_len, causal=False)
            own = self._schedule(aot, c.num_reqs, c.query_start_loc, c.max_query_len,
                                 suffix, c.max_seq_len - common_prefix_len, causal=True)
        else:
            own = self._schedule(aot, c.num_reqs, c.query_start_loc, c.max_query_len,
                                 c.seq_lens, c.max_seq_len, causal=c.causal)

        return FlashAttentionMetadata(
            num_actual_tokens=c.num_actual_tokens,
            max_query_len=c.max_query_len,
            query_start_loc=c.query_start_loc,
            max_seq_len=c.max_seq_len,
            seq_lens=c.seq_lens,
            block_table=c.block_table_tensor,
            slot_mapping=c.slot_mapping,
            use_cascade=common_prefix_len > 0,
            common_prefix_len=common_prefix_len,
            scheduler_metadata=own,
            max_num_splits=0,
            causal=c.causal,
            **cascade,
        )

    def use_cascade_attention(self, *args: Any, **kwargs: Any) -> bool:
        return use_cascade_attention(*args, **kwargs)


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata]):
    """Writes the step's K/V into the cache, then runs FlashAttention over the cache
    (decoder) or over the step's own K/V (encoder, no cache)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        FlashAttentionBackend.validate_head_size(head_size)
        self.vllm_flash_attn_version = get_flash_attn_version()
        if is_quantized_kv_cache(kv_cache_dtype) and not flash_attn_supports_fp8():
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r}: FlashAttention "
                f"{self.vllm_flash_attn_version} reads no fp8 cache (FA3 does)")
        if sinks is not None:
            if self.vllm_flash_attn_version != 3:
                raise NotImplementedError("attention sinks need FlashAttention 3")
            if sinks.shape[0] != num_heads:
                raise ValueError(f"sinks has {sinks.shape[0]} entries for {num_heads} heads")

        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.scale = float(scale)
        self.alibi_slopes = (None if alibi_slopes is None
                             else torch.tensor(alibi_slopes, dtype=torch.float32))
        # flash-attn windows are (keys left, keys right) of the query's position
        if sliding_window is None:
            self.sliding_window = _NO_WINDOW
        else:
            right = sliding_window - 1 if attn_type == AttentionType.ENCODER_ONLY else 0
            self.sliding_window = (sliding_window - 1, right)
        self.logits_soft_cap = logits_soft_cap or 0  # flash-attn reads a cap of 0 as none
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks

    def _descales(self, layer: AttentionLayer, num_seqs: int) -> dict[str, Any]:
        """The layer's per-tensor scales broadcast to flash-attn's ``[num_seqs,
        num_kv_heads]`` without copying."""
        return expand_descales(num_seqs, self.num_kv_heads,
                               layer._q_scale, layer._k_scale, layer._v_scale)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, num_heads, head_size]``, ``key`` / ``value`` ``[T, num_kv_heads,
        head_size]`` (``T`` may include padding past ``num_actual_tokens``), ``kv_cache``
        ``[2, num_blocks, block_size, num_kv_heads, head_size]``; fills and returns
        ``output`` ``[T, num_heads, head_size]``."""
        if output is None:
            raise ValueError("FlashAttentionImpl.forward writes into output; none was given")
        if self.vllm_flash_attn_version is None:
            raise RuntimeError("no FlashAttention version was found")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("FlashAttentionImpl does not quantise its output")
        if attn_metadata is None:  # a profiling step
            return output

        n = attn_metadata.num_actual_tokens
        if self.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
            if key is None or value is None:
                raise ValueError("encoder attention needs this step's key and value")
            return self._forward_encoder_attention(query[:n], key[:n], value[:n], output[:n],
                                                   attn_metadata, layer)

        key_cache, value_cache = kv_cache.unbind(0)
        # a layer reading another layer's cache writes nothing; a cross-attention layer
        # gets key None after the encoder's step has filled its cache
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            # slot_mapping is unpadded: the op writes its length's worth of rows only
            reshape_and_cache_flash(key, value, key_cache, value_cache,
                                    attn_metadata.slot_mapping, self.kv_cache_dtype,
                                    layer._k_scale, layer._v_scale)

        if self.kv_cache_dtype.startswith("fp8"):
            fp8 = FlashAttentionBackend.get_fp8_dtype_for_flashattn(self.kv_cache_dtype)
            key_cache, value_cache = key_cache.view(fp8), value_cache.view(fp8)
            rows, heads, dim = query.shape
            flat, _ = ops.scaled_fp8_quant(query.reshape(rows, heads * dim).contiguous(),
                                           layer._q_scale)
            query = flat.reshape(rows, heads, dim)

        m = attn_metadata
        if m.use_cascade:
            # build() sets the cascade lengths whenever it sets use_cascade
            assert m.cu_prefix_query_lens is not None and m.prefix_kv_lens is not None
            assert m.suffix_kv_lens is not None
            cascade_attention(
                output[:n], query[:n], key_cache, value_cache,
                cu_query_lens=m.query_start_loc, max_query_len=m.max_query_len,
                cu_prefix_query_lens=m.cu_prefix_query_lens, prefix_kv_lens=m.prefix_kv_lens,
                suffix_kv_lens=m.suffix_kv_lens, max_kv_len=m.max_seq_len,
                softmax_scale=self.scale, alibi_slopes=self.alibi_slopes,
                sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                block_table=m.block_table, common_prefix_len=m.common_prefix_len,
                fa_version=self.vllm_flash_attn_version,
                prefix_scheduler_metadata=m.prefix_scheduler_metadata,
                suffix_scheduler_metadata=m.scheduler_metadata,
                q_descale=layer._q_scale, k_descale=layer._k_scale, v_descale=layer._v_scale)
            return output

        flash_attn_varlen_func(
            q=query[:n],
            k=key_cache,
            v=value_cache,
            out=output[:n],
            cu_seqlens_q=m.query_start_loc,
            max_seqlen_q=m.max_query_len,
            seqused_k=m.seq_lens,
            max_seqlen_k=m.max_seq_len,
            softmax_scale=self.scale,
            causal=m.causal,
            alibi_slopes=self.alibi_slopes,
            window_size=self.sliding_window,
            block_table=m.block_table,
            softcap=self.logits_soft_cap,
            scheduler_metadata=m.scheduler_metadata,
            fa_version=self.vllm_flash_attn_version,
            num_splits=m.max_num_splits,
            s_aux=self.sinks,
            **self._descales(layer, m.query_start_loc.shape[0] - 1),
        )
        return output

    def _forward_encoder_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        layer: AttentionLayer,
    ) -> torch.Tensor:
        """Bidirectional attention of each request over its own tokens of this step
        (``[T, heads, head_size]`` each): the keys are split like the queries."""
        if self.kv_cache_dtype.startswith("fp8"):
            raise NotImplementedError("encoder attention reads no cache, so no fp8 one")
        if self.vllm_flash_attn_version is None:
            raise RuntimeError("no FlashAttention version was found")
        bounds, longest = attn_metadata.query_start_loc, attn_metadata.max_query_len
        flash_attn_varlen_func(
            q=query,
            k=key,
            v=value,
            out=output,
            cu_seqlens_q=bounds,
            cu_seqlens_k=bounds,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=self.scale,
            causal=False,
            alibi_slopes=self.alibi_slopes,
            window_size=self.sliding_window,
            softcap=self.logits_soft_cap,
            fa_version=self.vllm_flash_attn_version,
            **self._descales(layer, bounds.shape[0] - 1),
        )
        return output

