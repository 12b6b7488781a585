"""A *flagged* legacy backend (``forward_includes_kv_cache_update = False``: the impl's
``do_kv_cache_update`` writes the cache, ``forward()`` only reads it), written against
the interface of vLLM's FlashAttention backend once that flag arrived:
https://github.com/vllm-project/vllm at commit 5704f34f361c6c59a9c092c4e1e96730cc6dc14d,
vllm/v1/attention/backends/flash_attn.py.

Kept from that interface: the framework imports, the class names, the public method
names and signatures, the declarations (``supported_dtypes``,
``get_supported_kernel_block_sizes`` with ``MultipleOf``, the ``supports_*``
predicates), the metadata dataclass's field names, and the calls into the framework
(what the builder reads from ``common_attn_metadata`` and ``vllm_config``,
``get_current_vllm_config()``, ``get_dcp_group()``, ``get_dcp_local_seq_lens``,
``get_kv_cache_layout()``, ``get_layers_from_vllm_config``,
``vllm_is_batch_invariant()``, the layer's ``_q_scale`` / ``_k_scale`` / ``_v_scale``,
``kv_cache.unbind(0)``, ``reshape_and_cache_flash`` in ``do_kv_cache_update``,
``flash_attn_varlen_func``'s keywords). The code, docstrings and comments are this
project's own. The flash-attention kernels, ``cp_lse_ag_out_rs`` and
``merge_attn_states`` come from :mod:`.kernels` (torch stand-ins with the same
signatures), where upstream imports ``vllm.v1.attention.backends.fa_utils`` and
``vllm.v1.attention.ops``; so do ``use_cascade_attention`` and ``cascade_attention``,
which upstream defines in this module.

Left out: the persistent FA3 scheduler buffer for full CUDA graphs (a legacy builder here
is never captured: ``cudagraph_mode`` is ``NONE``) and the cost model behind
``use_cascade_attention`` (a plain eligibility rule stands in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tests.legacy_backends.upstream.kernels import (
    cascade_attention,
    cp_lse_ag_out_rs,
    expand_descales,
    flash_attn_supports_fp8,
    flash_attn_supports_sinks,
    flash_attn_varlen_func,
    get_flash_attn_version,
    get_scheduler_metadata,
    is_flash_attn_varlen_func_available,
    merge_attn_states,
    reshape_and_cache_flash,
    use_cascade_attention,
)
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.config.cache import CacheDType
from vllm.distributed.parallel_state import get_dcp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.batch_invariant import vllm_is_batch_invariant
from vllm.platforms.interface import DeviceCapability
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
    is_quantized_kv_cache,
)
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens, get_kv_cache_layout
from vllm.v1.kv_cache_interface import AttentionSpec

logger = init_logger(__name__)

_NO_WINDOW = (-1, -1)
_CACHED_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_DECODER)
_UNCACHED_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
# (layout, with a leading layers axis) -> the physical order of the logical axes
_STRIDE_ORDER = {
    ("NHD", False): (0, 1, 2, 3, 4),
    ("HND", False): (0, 1, 3, 2, 4),
    ("NHD", True): (2, 0, 1, 3, 4, 5),
    ("HND", True): (2, 4, 0, 1, 3, 5),
}


class FlashAttentionBackend(AttentionBackend):
    """Paged FlashAttention over a ``(2, num_blocks, block_size, num_kv_heads,
    head_size)`` cache, written by the impl's ``do_kv_cache_update``."""

    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        config = get_current_vllm_config()
        cache = config.cache_config
        fp32_state = "float32" in (cache.mamba_ssm_cache_dtype, cache.mamba_cache_dtype)
        if config.model_config is not None and config.model_config.is_hybrid and fp32_state:
            # hybrid models with float32 Mamba state share pages with it; only these
            # sizes keep stale rows from turning outputs into NaN
            # (Dao-AILab/flash-attention#1974)
            return [16, 32, 64]
        return [MultipleOf(16)]

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in _CACHED_TYPES + _UNCACHED_TYPES

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if block_size % 16:
            raise ValueError(f"block_size={block_size}: FlashAttention pages in multiples of 16")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(
        include_num_layers_dimension: bool = False,
    ) -> tuple[int, ...]:
        layout = get_kv_cache_layout()
        order = _STRIDE_ORDER.get((layout, include_num_layers_dimension))
        if order is None:
            raise ValueError(f"kv cache layout {layout!r}: FlashAttention reads NHD or HND")
        return order

    @staticmethod
    def get_fp8_dtype_for_flashattn(kv_cache_dtype: str) -> torch.dtype:
        if kv_cache_dtype not in ("fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} has no FlashAttention fp8 dtype")
        return torch.float8_e4m3fn

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size <= 256 and head_size % 8 == 0

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: CacheDType | None) -> bool:
        if kv_cache_dtype is None:
            return True
        if kv_cache_dtype.startswith("fp8"):
            return flash_attn_supports_fp8()
        return kv_cache_dtype in ("auto", "bfloat16")

    @classmethod
    def supports_sink(cls) -> bool:
        return is_flash_attn_varlen_func_available() and flash_attn_supports_sinks()

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability >= DeviceCapability(8, 0)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        if has_sink and device_capability < DeviceCapability(9, 0):
            return f"attention sinks need compute capability 9.0, not {device_capability}"
        return None


@dataclass
class FlashAttentionMetadata:
    """One step's batch. Per request, ``seq_lens`` counts every key it attends to (the
    cached context plus this step's tokens) and the query length is the difference of
    consecutive ``query_start_loc`` entries. The ``cu_prefix_query_lens`` /
    ``prefix_kv_lens`` / ``suffix_kv_lens`` are set only when ``use_cascade``; the
    ``dcp_*`` fields only under decode context parallelism (this rank's share of each
    request's context)."""

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

    max_dcp_context_kv_len: int | None = None
    dcp_context_kv_lens: torch.Tensor | None = None

    scheduler_metadata: torch.Tensor | None = None
    prefix_scheduler_metadata: torch.Tensor | None = None
    max_num_splits: int = 0

    causal: bool = True


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Turns the common batch description into :class:`FlashAttentionMetadata`; on FA3 it
    also asks the ahead-of-time scheduler for each pass's work split."""

    _cudagraph_support = (AttentionCGSupport.ALWAYS if get_flash_attn_version() == 3
                          else AttentionCGSupport.UNIFORM_BATCH)
    supports_update_block_table: bool = True

    @classmethod
    def get_cudagraph_support(
        cls,
        vllm_config: VllmConfig,
        kv_cache_spec: AttentionSpec,
    ) -> AttentionCGSupport:
        return cls._cudagraph_support

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
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

        try:
            dcp = get_dcp_group()
            self.dcp_world_size, self.dcp_rank = dcp.world_size, dcp.rank_in_group
        except AssertionError:  # no distributed state (a builder made in a unit test)
            self.dcp_world_size, self.dcp_rank = 1, 0
        self.cp_kv_cache_interleave_size = parallel.cp_kv_cache_interleave_size

        compilation = vllm_config.compilation_config
        self.use_full_cuda_graph = compilation.cudagraph_mode.has_full_cudagraphs()
        self.max_cudagraph_size = compilation.max_cudagraph_capture_size
        # under captured graphs FA3 needs its split count fixed in advance
        self.max_num_splits = (
            vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph
            if self.use_full_cuda_graph and self.aot_schedule else 0)
        # the scheduler needs one window for every layer; known once the layers exist
        self.aot_sliding_window: tuple[int, int] | None = None

    def _resolve_aot_window(self) -> None:
        windows = {layer.impl.sliding_window
                   for layer in get_layers_from_vllm_config(self.vllm_config, Attention).values()}
        if len(windows) > 1:
            logger.info_once("layers differ in sliding window: FA3 schedules per call")
            self.aot_schedule = False
        self.aot_sliding_window = windows.pop() if len(windows) == 1 else _NO_WINDOW

    def _splits(self, num_tokens: int) -> int:
        """0 lets FA3 choose per call; a captured step needs the fixed count; batch
        invariance needs one split so a request's sum never depends on its batch."""
        if vllm_is_batch_invariant():
            return 1
        captured = (self.use_full_cuda_graph and self.max_cudagraph_size is not None
                    and num_tokens <= self.max_cudagraph_size)
        return self.max_num_splits if captured else 0

    def _schedule(self, enabled: bool, splits: int, num_reqs: int,
                  cu_query_lens: torch.Tensor, max_query_len: int, kv_lens: torch.Tensor,
                  max_kv_len: int, causal: bool) -> torch.Tensor | None:
        if not enabled:
            return None
        spelled = self.cache_config.cache_dtype
        qkv_dtype = (FlashAttentionBackend.get_fp8_dtype_for_flashattn(spelled)
                     if spelled.startswith("fp8") else self.kv_cache_dtype)
        return get_scheduler_metadata(
            batch_size=num_reqs, max_seqlen_q=max_query_len, max_seqlen_k=max_kv_len,
            # under DCP the context pass runs every rank's query heads
            num_heads_q=self.num_heads_q * self.dcp_world_size,
            num_heads_kv=self.num_heads_kv, headdim=self.headdim, cache_seqlens=kv_lens,
            qkv_dtype=qkv_dtype, cu_seqlens_q=cu_query_lens, page_size=self.block_size,
            causal=causal, window_size=self.aot_sliding_window, num_splits=splits)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlashAttentionMetadata:
        """``fast_build`` skips the FA3 scheduler (few steps reuse it: drafting)."""
        c = common_attn_metadata
        if self.aot_schedule and not fast_build and self.aot_sliding_window is None:
            self._resolve_aot_window()
        aot = self.aot_schedule and not fast_build
        splits = self._splits(c.num_actual_tokens)

        extra: dict[str, Any] = {}
        if self.dcp_world_size > 1:
            # this rank attends to its share of the cached context; the step's own
            # tokens are attended to separately in forward()
            context = c.seq_lens - (c.query_start_loc[1:] - c.query_start_loc[:-1])
            local = get_dcp_local_seq_lens(context, self.dcp_world_size, self.dcp_rank,
                                           self.cp_kv_cache_interleave_size)
            chunk = self.cp_kv_cache_interleave_size
            longest = cdiv(c.max_seq_len, self.dcp_world_size * chunk) * chunk
            extra.update(dcp_context_kv_lens=local, max_dcp_context_kv_len=longest)
            own = self._schedule(aot, splits, c.num_reqs, c.query_start_loc,
                                 c.max_query_len, local, longest, causal=False)
        elif common_prefix_len > 0:
            as_i32: dict[str, Any] = dict(dtype=torch.int32, device=self.device)
            suffix = c.seq_lens[:c.num_reqs] - common_prefix_len
            extra.update(
                cu_prefix_query_lens=torch.tensor([0, c.num_actual_tokens], **as_i32),
                prefix_kv_lens=torch.tensor([common_prefix_len], **as_i32),
                suffix_kv_lens=suffix)
            extra["prefix_scheduler_metadata"] = self._schedule(
                aot, splits, 1, extra["cu_prefix_query_lens"], c.num_actual_tokens,
                extra["prefix_kv_lens"], common_prefix_len, causal=False)
            own = self._schedule(aot, splits, c.num_reqs, c.query_start_loc,
                                 c.max_query_len, suffix, c.max_seq_len - common_prefix_len,
                                 causal=True)
        else:
            own = self._schedule(aot, splits, c.num_reqs, c.query_start_loc,
                                 c.max_query_len, c.seq_lens, c.max_seq_len, causal=c.causal)

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
            cu_prefix_query_lens=extra.pop("cu_prefix_query_lens", None),
            prefix_kv_lens=extra.pop("prefix_kv_lens", None),
            suffix_kv_lens=extra.pop("suffix_kv_lens", None),
            scheduler_metadata=own,
            max_num_splits=splits,
            causal=c.causal,
            **extra,
        )

    def update_block_table(
        self,
        metadata: FlashAttentionMetadata,
        blk_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> FlashAttentionMetadata:
        return dataclasses.replace(metadata, block_table=blk_table, slot_mapping=slot_mapping)

    def use_cascade_attention(self, *args: Any, **kwargs: Any) -> bool:
        return use_cascade_attention(*args, **kwargs)


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata]):
    """``do_kv_cache_update`` writes the step's K/V; ``forward`` runs FlashAttention over
    the cache (decoder) or over the step's own K/V (encoder, no cache)."""

    can_return_lse_for_decode: bool = True

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
        self.vllm_flash_attn_version = get_flash_attn_version()
        if is_quantized_kv_cache(kv_cache_dtype) and not flash_attn_supports_fp8():
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r}: FlashAttention "
                f"{self.vllm_flash_attn_version} reads no fp8 cache (FA3 does)")
        if sinks is not None:
            if not flash_attn_supports_sinks():
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
        self.batch_invariant_enabled = vllm_is_batch_invariant()
        # the layer hands over an fp8 query when the cache is fp8; per-head scales are FA3's
        self.supports_quant_query_input = True
        self.supports_per_head_quant_scales = (self.vllm_flash_attn_version or 0) >= 3

    def _descales(self, layer: AttentionLayer, num_seqs: int) -> dict[str, Any]:
        """The layer's per-tensor scales broadcast to flash-attn's ``[num_seqs,
        num_kv_heads]`` without copying."""
        return expand_descales(num_seqs, self.num_kv_heads,
                               layer._q_scale, layer._k_scale, layer._v_scale)

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
        """``query`` ``[T, num_heads, head_size]``, ``key`` / ``value`` ``[T, num_kv_heads,
        head_size]`` (``T`` may include padding past ``num_actual_tokens``), ``kv_cache``
        ``[2, num_blocks, block_size, num_kv_heads, head_size]``, already holding this
        step's K/V; fills and returns ``output`` ``[T, num_heads, head_size]``."""
        if output is None:
            raise ValueError("FlashAttentionImpl.forward writes into output; none was given")
        if self.vllm_flash_attn_version is None:
            raise RuntimeError("no FlashAttention version was found")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("FlashAttentionImpl does not quantise its output")
        if attn_metadata is None:  # a profiling step
            return output.fill_(0)

        m = attn_metadata
        n = m.num_actual_tokens
        if self.attn_type in _UNCACHED_TYPES:
            return self._forward_encoder_attention(query[:n], key[:n], value[:n], output[:n],
                                                   m, layer)

        key_cache, value_cache = kv_cache.unbind(0)
        if self.kv_cache_dtype.startswith("fp8"):  # the layer has quantised the query
            fp8 = FlashAttentionBackend.get_fp8_dtype_for_flashattn(self.kv_cache_dtype)
            key_cache, value_cache = key_cache.view(fp8), value_cache.view(fp8)

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
                max_num_splits=1 if vllm_is_batch_invariant() else m.max_num_splits,
                fa_version=self.vllm_flash_attn_version,
                prefix_scheduler_metadata=m.prefix_scheduler_metadata,
                suffix_scheduler_metadata=m.scheduler_metadata,
                q_descale=layer._q_scale, k_descale=layer._k_scale, v_descale=layer._v_scale,
                s_aux=self.sinks)
            return output

        descales = self._descales(layer, m.query_start_loc.shape[0] - 1)
        if self.dcp_world_size > 1:
            self._forward_with_dcp(query[:n], key[:n], value[:n], key_cache, value_cache,
                                   output[:n], m, **descales)
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
            window_size=list(self.sliding_window),
            block_table=m.block_table,
            softcap=self.logits_soft_cap,
            scheduler_metadata=m.scheduler_metadata,
            fa_version=self.vllm_flash_attn_version,
            num_splits=m.max_num_splits,
            s_aux=self.sinks,
            **descales,
        )
        return output

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key`` / ``value`` ``[T, num_kv_heads, head_size]`` at ``slot_mapping``
        ``[n]`` (``n <= T``; a negative slot is skipped). Encoder attention keeps no cache;
        a layer reading another layer's cache writes nothing; a cross-attention layer gets
        ``key`` None once the encoder's step has filled its cache."""
        if self.attn_type in _UNCACHED_TYPES or self.kv_sharing_target_layer_name is not None:
            return
        if key is None or value is None:
            return
        key_cache, value_cache = kv_cache.unbind(0)
        reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                self.kv_cache_dtype, layer._k_scale, layer._v_scale)

    def _forward_with_dcp(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode context parallelism: each rank holds a share of every request's cached
        context. The query heads of all ranks attend to this rank's share; the partial
        results are combined across ranks (back to this rank's heads), then merged with
        this rank's queries over the step's own K/V."""
        m = attn_metadata
        # build() sets the context lengths whenever this rank runs context-parallel
        assert m.max_dcp_context_kv_len is not None
        group = get_dcp_group()
        common: dict[str, Any] = dict(
            softmax_scale=self.scale, alibi_slopes=self.alibi_slopes,
            window_size=list(self.sliding_window), softcap=self.logits_soft_cap,
            return_softmax_lse=True, fa_version=self.vllm_flash_attn_version,
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        every_head = group.all_gather(query.contiguous(), dim=1)
        context_out, context_lse = flash_attn_varlen_func(
            q=every_head, k=key_cache, v=value_cache, out=None,
            cu_seqlens_q=m.query_start_loc, max_seqlen_q=m.max_query_len,
            seqused_k=m.dcp_context_kv_lens, max_seqlen_k=m.max_dcp_context_kv_len,
            causal=False, block_table=m.block_table,
            scheduler_metadata=m.scheduler_metadata, **common)
        # flash-attn's log-sum-exp is [heads, tokens]; the cross-rank step takes [tokens, heads]
        context_out, context_lse = cp_lse_ag_out_rs(context_out, context_lse.transpose(0, 1),
                                                    group, return_lse=True)
        own_out, own_lse = flash_attn_varlen_func(
            q=query, k=key, v=value, out=None,
            cu_seqlens_q=m.query_start_loc, max_seqlen_q=m.max_query_len,
            cu_seqlens_k=m.query_start_loc, max_seqlen_k=m.max_query_len,
            causal=m.causal, **common)
        merge_attn_states(output, context_out, context_lse.transpose(0, 1).contiguous(),
                          own_out, own_lse)
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
            window_size=list(self.sliding_window),
            softcap=self.logits_soft_cap,
            fa_version=self.vllm_flash_attn_version,
            num_splits=1 if self.batch_invariant_enabled else 0,
            **self._descales(layer, bounds.shape[0] - 1),
        )
        return output

