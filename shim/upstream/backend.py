"""``vllm.v1.attention.backend`` (and ``vllm.attention.backends.abstract``): the bases
and types of a legacy backend, with upstream's names, signatures and defaults.

One class serves both legacy lines: it has the class data of upstream's later line
(``supported_dtypes``, ``supported_kv_cache_dtypes``, ``forward_includes_kv_cache_update``,
``get_supported_kernel_block_sizes``) and the classmethods of its earlier one
(``get_supported_dtypes``, ``get_supported_kv_cache_dtypes``, ``get_supported_block_sizes``),
each answering from the other. The ``supports_*`` predicates are what the adapter reads.

Every base is ``@deprecated`` for the type checker only (no runtime warning: the adapter
warns once per backend class when the backend is first used).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from typing_extensions import deprecated

import vllm.attention.backend as new_api
from shim.upstream.config import CacheDType, VllmConfig
from shim.upstream.kv_cache_interface import AttentionSpec
from shim.upstream.parallel import get_dcp_group, get_pcp_group
from shim.upstream.platform import DeviceCapability
from vllm.attention.types import AttentionType

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionImplBase",
    "AttentionLayer",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "CommonAttentionMetadata",
    "MLAAttentionImpl",
    "MultipleOf",
    "SparseMLAAttentionImpl",
    "is_quantized_kv_cache",
]

class MultipleOf:
    """A kernel block size given as "any multiple of ``base``"."""

    base: int

    def __init__(self, base: int) -> None:
        self.base = base

    def __repr__(self) -> str:
        return f"MultipleOf({self.base})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MultipleOf) and other.base == self.base

    def __hash__(self) -> int:
        return hash(("MultipleOf", self.base))


_UNQUANTISED = frozenset({"auto", "bfloat16", "float16", "float32"})


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """True for a cache dtype that stores scaled or per-token quantised values."""
    return kv_cache_dtype not in _UNQUANTISED


@deprecated("the legacy AttentionBackend: subclass vllm.attention.AttentionBackend and "
            "declare its capabilities as class data (see migration_guide.md)", category=None)
class AttentionBackend(abc.ABC):
    """Abstract class for attention backends (the legacy surface)."""

    accept_output_buffer: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update: bool = True
    """False: the impl has ``do_kv_cache_update`` and ``forward`` only computes."""

    @staticmethod
    @abc.abstractmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    @abc.abstractmethod
    def get_impl_cls() -> type[AttentionImplBase[Any]]:  # type: ignore[deprecated]  # the legacy surface's own bases
        raise NotImplementedError

    @staticmethod
    @abc.abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder[Any]]:  # type: ignore[deprecated]  # the legacy surface's own bases
        raise NotImplementedError

    # The v0.10 line declares get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
    # head_size) and get_kv_cache_stride_order(); the later line adds cache_dtype_str and
    # include_num_layers_dimension. The trailing Any parameters let either line override.
    @staticmethod
    @abc.abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, *args: Any, **kwargs: Any) -> tuple[int, ...]:
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_stride_order(*args: Any, **kwargs: Any) -> tuple[int, ...]:
        """The physical order of the logical axes; not implemented means identity."""
        raise NotImplementedError

    @classmethod
    def get_kv_cache_block_dim(cls, block_size: int, num_kv_heads: int, head_size: int,
                               cache_dtype_str: str = "auto") -> int:
        probe = 1234567
        shape = cls.get_kv_cache_shape(probe, block_size, num_kv_heads, head_size,
                                       cache_dtype_str=cache_dtype_str)
        return shape.index(probe)

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

    @classmethod
    def make_metadata(cls, *args: Any, **kwargs: Any) -> Any:
        get_metadata_cls = getattr(cls, "get_metadata_cls", None)
        if get_metadata_cls is None:
            raise NotImplementedError(f"{cls.__qualname__} has no get_metadata_cls()")
        return get_metadata_cls()(*args, **kwargs)

    # -- sizes and dtypes ---------------------------------------------------------------
    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_block_sizes(cls) -> list[int]:
        """The earlier line's exact block sizes (empty: any)."""
        return []

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Ints are exact sizes, :class:`MultipleOf` admits multiples. (Upstream's later
        line also admits multiples of an int for its hybrid block splitting; a cache
        block here is the kernel block, so an int means exactly that size.)"""
        if block_size is None:
            return True
        exact = cls.get_supported_block_sizes()
        if exact and block_size not in exact:
            return False
        sizes = cls.get_supported_kernel_block_sizes()
        if not sizes:
            return True
        return any(block_size % s.base == 0 if isinstance(s, MultipleOf) else block_size == s
                   for s in sizes)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        if cls.supports_block_size(default_block_size):
            return default_block_size
        sizes = cls.get_supported_kernel_block_sizes()
        return min(s.base if isinstance(s, MultipleOf) else s for s in sizes)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """Empty means any head size."""
        return []

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        sizes = cls.get_supported_head_sizes()
        return not sizes or head_size in sizes

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return list(cls.supported_dtypes)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        dtypes = cls.get_supported_dtypes()
        return not dtypes or dtype in dtypes

    @classmethod
    def get_supported_kv_cache_dtypes(cls) -> list[CacheDType]:
        return list(cls.supported_kv_cache_dtypes)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: CacheDType | None) -> bool:
        if kv_cache_dtype is None:
            return True
        dtypes = cls.get_supported_kv_cache_dtypes()
        return not dtypes or kv_cache_dtype in dtypes

    # -- features -----------------------------------------------------------------------
    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def is_ssm(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def get_min_compute_capability(cls) -> DeviceCapability | None:
        return None

    @classmethod
    def get_max_compute_capability(cls) -> DeviceCapability | None:
        return None

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        low, high = cls.get_min_compute_capability(), cls.get_max_compute_capability()
        return (low is None or capability >= low) and (high is None or capability <= high)

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype,
                             kv_cache_dtype: CacheDType | None, block_size: int | None,
                             use_mla: bool, has_sink: bool, use_sparse: bool,
                             device_capability: DeviceCapability) -> str | None:
        return None

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype,
                               kv_cache_dtype: CacheDType | None, block_size: int | None,
                               use_mla: bool, has_sink: bool, use_sparse: bool,
                               device_capability: DeviceCapability,
                               attn_type: str = AttentionType.DECODER) -> list[str]:
        """Why the configuration is not supported (upstream's wording)."""
        reasons: list[str] = []
        if not cls.supports_head_size(head_size):
            reasons.append("head_size not supported")
        if not cls.supports_dtype(dtype):
            reasons.append("dtype not supported")
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            reasons.append("kv_cache_dtype not supported")
        if not cls.supports_block_size(block_size):
            reasons.append("block_size not supported")
        if use_mla != cls.is_mla():
            reasons.append("MLA not supported" if use_mla else "non-MLA not supported")
        if has_sink and not cls.supports_sink():
            reasons.append("attention sinks not supported")
        if use_sparse != cls.is_sparse():
            reasons.append("sparse not supported" if use_sparse else "non-sparse not supported")
        if not cls.supports_compute_capability(device_capability):
            reasons.append("compute capability not supported")
        if not cls.supports_attn_type(attn_type):
            reasons.append(f"attention type {attn_type} not supported")
        combination = cls.supports_combination(head_size, dtype, kv_cache_dtype, block_size,
                                               use_mla, has_sink, use_sparse, device_capability)
        if combination is not None:
            reasons.append(combination)
        return reasons

    @classmethod
    def get_required_kv_cache_layout(cls, *_args: object) -> str | None:
        return None


class AttentionMetadata(Protocol):
    """A legacy backend's metadata (may hold ``slot_mapping``). Structural, so any class
    is one: upstream's v1 metadata dataclasses do not derive from it, yet their backends
    return them as ``type[AttentionMetadata]`` and their impls are generic over them."""


T = TypeVar("T", bound=AttentionMetadata)
M = TypeVar("M")


class AttentionLayer(Protocol):
    """What a legacy impl reads from the layer it is called with."""

    _q_scale: torch.Tensor
    _k_scale: torch.Tensor
    _v_scale: torch.Tensor
    _k_scale_cpu: torch.Tensor
    _v_scale_cpu: torch.Tensor
    _q_scale_float: float
    _k_scale_float: float
    _v_scale_float: float
    _prob_scale: torch.Tensor

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor: ...


@deprecated("the legacy AttentionImplBase: subclass vllm.attention.AttentionImpl "
            "(see migration_guide.md)", category=None)
class AttentionImplBase(abc.ABC, Generic[T]):
    """State every legacy impl has before its ``__init__`` runs (context parallelism)."""

    num_heads: int
    head_size: int
    scale: float
    can_return_lse_for_decode: bool = False
    supports_pcp: bool = False
    need_to_return_lse_for_decode: bool = False
    supports_quant_query_input: bool = False
    dcp_world_size: int
    dcp_rank: int
    pcp_world_size: int
    pcp_rank: int
    total_cp_world_size: int
    total_cp_rank: int

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls)
        dcp, pcp = get_dcp_group(), get_pcp_group()
        self.dcp_world_size, self.dcp_rank = dcp.world_size, dcp.rank_in_group
        self.pcp_world_size, self.pcp_rank = pcp.world_size, pcp.rank_in_group
        self.total_cp_world_size = self.pcp_world_size * self.dcp_world_size
        self.total_cp_rank = self.pcp_rank * self.dcp_world_size + self.dcp_rank
        self.need_to_return_lse_for_decode = (
            self.dcp_world_size > 1 and self.can_return_lse_for_decode)
        return self

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        pass


@deprecated("the legacy AttentionImpl: subclass vllm.attention.AttentionImpl, whose "
            "forward never writes the cache (see migration_guide.md)", category=None)
class AttentionImpl(AttentionImplBase[T], Generic[T]):  # type: ignore[deprecated]  # the legacy surface's own bases
    """A legacy impl: ``forward`` (which may write the cache) and, when its backend sets
    ``forward_includes_kv_cache_update = False``, ``do_kv_cache_update``."""

    kv_cache_dtype: str

    @abc.abstractmethod
    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: T,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def get_supported_kernel_block_size(cls) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    def fused_output_quant_supported(self, quant_key: object) -> bool:
        return False


@deprecated("legacy MLA impls are not adapted: subclass vllm.attention.backends.mla's "
            "MLA bases (see migration_guide.md)", category=None)
class MLAAttentionImpl(AttentionImplBase[T], Generic[T]):  # type: ignore[deprecated]  # the legacy surface's own bases
    """A legacy MLA impl (``forward_mha`` / ``forward_mqa``). Exported so such modules
    import; the adapter does not run legacy MLA backends (``migration_guide.md``)."""

    @abc.abstractmethod
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 qk_head_dim: int, v_head_dim: int, kv_b_proj: Any,
                 indexer: object | None = None, q_pad_num_heads: int | None = None) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: T,
                    k_scale: torch.Tensor, output: torch.Tensor,
                    output_scale: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: T,
                    layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        from shim.upstream.ops import concat_and_cache_mla

        if kv_cache.numel() == 0:
            return
        concat_and_cache_mla(kv_c_normed, k_pe.squeeze(1), kv_cache, slot_mapping.flatten(),
                             kv_cache_dtype=kv_cache_dtype, scale=k_scale)


class SparseMLAAttentionImpl(MLAAttentionImpl[T], Generic[T]):  # type: ignore[deprecated]  # the legacy surface's own bases
    """A legacy sparse MLA impl (decode only); not adapted, like :class:`MLAAttentionImpl`."""


@deprecated("the legacy CommonAttentionMetadata: new-style builders take "
            "vllm.attention.CommonAttentionMetadata, which has no slot_mapping "
            "(see migration_guide.md)", category=None)
@dataclass
class CommonAttentionMetadata:
    """The batch as a legacy builder is given it, with upstream's field names.

    The adapter fills ``slot_mapping`` with ``-1`` (vLLM's pad slot) at build time and
    puts each layer's real slot mapping into the legacy metadata right before the legacy
    ``forward`` runs.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    """``[num_reqs + 1]`` int32: where each request's tokens start."""
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    """``seq_lens - query lens``: tokens already in the cache, per request."""
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None
    encoder_seq_lens: torch.Tensor | None = None
    encoder_seq_lens_cpu: Any = None
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens_cpu: torch.Tensor | None = None
    block_size: int = 0
    """Not upstream's: the block size, for this package's earlier legacy examples."""

    @classmethod
    def from_new(cls, common: new_api.CommonAttentionMetadata,
                 slot_mapping: torch.Tensor | None = None) -> CommonAttentionMetadata:
        """The legacy form of a new-style batch description; ``slot_mapping`` defaults to
        ``-1`` (vLLM's pad slot) for every token."""
        if slot_mapping is None:
            slot_mapping = torch.full((common.num_actual_tokens,), -1, dtype=torch.int64,
                                      device=common.seq_lens.device)
        starts = common.query_start_loc_cpu
        return cls(
            query_start_loc=common.query_start_loc, query_start_loc_cpu=starts,
            seq_lens=common.seq_lens, seq_lens_cpu=common.seq_lens_cpu,
            num_computed_tokens_cpu=common.seq_lens_cpu - (starts[1:] - starts[:-1]),
            num_reqs=common.num_reqs, num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
            block_table_tensor=common.block_table, slot_mapping=slot_mapping,
            causal=common.causal, block_size=common.block_size,
        )

    @property
    def block_table(self) -> torch.Tensor:
        """Not upstream's: ``block_table_tensor`` under this package's earlier name."""
        return self.block_table_tensor

    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    def naive_query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def compute_num_computed_tokens(self) -> torch.Tensor:
        return self.seq_lens - self.naive_query_lens()

    def replace(self, **kwargs: Any) -> CommonAttentionMetadata:
        return dataclasses.replace(self, **kwargs)

    def unpadded(self, num_actual_tokens: int, num_actual_reqs: int) -> CommonAttentionMetadata:
        r, t = num_actual_reqs, num_actual_tokens

        def reqs(x: Any) -> Any:
            return None if x is None else x[:r]

        return dataclasses.replace(
            self, query_start_loc=self.query_start_loc[: r + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: r + 1],
            seq_lens=self.seq_lens[:r], seq_lens_cpu=self.seq_lens_cpu[:r],
            num_computed_tokens_cpu=self.num_computed_tokens_cpu[:r], num_reqs=r,
            num_actual_tokens=t, block_table_tensor=self.block_table_tensor[:r],
            slot_mapping=self.slot_mapping[:t], encoder_seq_lens=reqs(self.encoder_seq_lens),
            encoder_seq_lens_cpu=reqs(self.encoder_seq_lens_cpu),
            dcp_local_seq_lens=reqs(self.dcp_local_seq_lens),
            dcp_local_seq_lens_cpu=reqs(self.dcp_local_seq_lens_cpu),
        )


class AttentionCGSupport(enum.Enum):
    """How far a builder's metadata can be replayed in a CUDA graph."""

    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


@deprecated("the legacy AttentionMetadataBuilder: subclass "
            "vllm.attention.AttentionMetadataBuilder (see migration_guide.md)", category=None)
class AttentionMetadataBuilder(abc.ABC, Generic[M]):
    """A legacy builder: built once per layer group, ``build`` once per step."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None
    supports_update_block_table: bool = False

    @abc.abstractmethod
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig,
                              kv_cache_spec: AttentionSpec) -> AttentionCGSupport:
        return cls._cudagraph_support

    def _init_reorder_batch_threshold(self, reorder_batch_threshold: int | None = 1,
                                      supports_spec_as_decode: bool = False,
                                      supports_dcp_with_varlen: bool = False) -> None:
        self.reorder_batch_threshold = reorder_batch_threshold

    @abc.abstractmethod
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,  # type: ignore[deprecated]
              fast_build: bool = False) -> M:
        raise NotImplementedError

    def update_block_table(self, metadata: M, blk_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> M:
        raise NotImplementedError

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:  # type: ignore[deprecated]
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata,  # type: ignore[deprecated]
                           draft_index: int) -> M:
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata,
                          fast_build=True)

    def reorder_batch(self, input_batch: Any, scheduler_output: Any) -> bool:
        return False

    def use_cascade_attention(self, *args: Any, **kwargs: Any) -> bool:
        return False
