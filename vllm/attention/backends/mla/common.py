"""What the eight MLA backends share: layer spec, metadata, builder, impl, declarations.

The math (absorbed decode, expanded prefill, sparse top-k) is in ``docs/mla.md``;
the cache layouts in ``docs/layouts.md``. Nothing here writes the cache and no
metadata class carries ``slot_mapping``: the layer writes through the backend's
:class:`~vllm.attention.MLAKVCacheWriter` before calling the impl.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Final, Generic, TypeVar

import torch

from vllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayerProtocol,
    AttentionLayerSpec,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    ComputePath,
    SizeSpec,
    common_fields,
    exactly,
    multiple_of,
)
from vllm.attention.backends.mla.spec import MLALayerSpec as MLALayerSpec
from vllm.attention.backends.mla.spec import MLAProjection as MLAProjection
from vllm.attention.env import env_switch
from vllm.attention.errors import InvalidArgumentError, InvalidTypeError
from vllm.attention.layouts import (
    FP8_DS_MLA_ENTRY_BYTES,
    FP8_DS_MLA_LATENT,
    FP8_DS_MLA_ROPE,
)
from vllm.attention.ops.mla_attention import (
    DecodeGroup,
    LatentFormat,
    PrefillGroup,
    mla_decode_torch,
    mla_prefill_torch,
    mla_sparse_torch,
)
from vllm.attention.types import KVCacheDType, KVCacheLayout, kv_cache_format

if TYPE_CHECKING:
    from vllm.attention.ops.mla_vendor import MLAVendorKernel
    from vllm.attention.writer import KVCacheWriter, MLAKVCacheWriter

HALF_DTYPES: Final = frozenset({torch.float16, torch.bfloat16})
FLOAT_DTYPES: Final = frozenset({torch.float32, torch.float16, torch.bfloat16})
DEEPSEEK_HEAD_SIZE: Final = FP8_DS_MLA_LATENT + FP8_DS_MLA_ROPE
"""576: kv_lora_rank 512 + rope 64, the only latent size the vendor kernels take."""


# -- metadata -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MLAMetadata(CommonAttentionMetadata, AttentionMetadata):
    """One step of an MLA batch, split into the absorbed (decode) and expanded
    (prefill) paths. Request ``i`` is a decode request iff its query length is at
    most ``decode_threshold``. Token index tensors select rows of the step's ``q``.
    """

    token_req: torch.Tensor
    """``[num_actual_tokens]`` int32: the request of each query token."""
    token_pos: torch.Tensor
    """``[num_actual_tokens]`` int32: each query token's position in its sequence."""
    decode_threshold: int
    decode_token_idx: torch.Tensor
    """``[num_decode_tokens]`` int64 rows of ``q`` on the absorbed path, by request."""
    prefill_token_idx: torch.Tensor
    """``[num_prefill_tokens]`` int64 rows of ``q`` on the expanded path, by request."""
    decode_groups: tuple[DecodeGroup, ...]
    """Per decode request: its rows of the decode batch and its sequence length."""
    prefill_groups: tuple[PrefillGroup, ...]
    decode_req_ids: torch.Tensor
    """``[num_decode_reqs]`` int64 (on device): the decode requests in decode-batch order."""
    decode_token_req: torch.Tensor
    """``[num_decode_tokens]`` int32: ``token_req`` of the decode rows (gathered once a step)."""
    decode_token_pos: torch.Tensor
    """``[num_decode_tokens]`` int32: ``token_pos`` of the decode rows."""
    decode_seq_lens: torch.Tensor
    """``[num_decode_reqs]`` int32: the decode requests' sequence lengths."""
    decode_block_table: torch.Tensor
    """``[num_decode_reqs, max_blocks]`` int32: the decode requests' block-table rows."""
    max_decode_seq_len: int
    uniform_single_token_decode: bool
    """Every decode request has exactly one query token (what vendor decode kernels take)."""
    prefill_chunk_tokens: int
    """Context tokens expanded at once on the prefill path (bounds its memory)."""
    decode_rows: slice | None = None
    """``decode_token_idx`` as one slice of ``q`` when the decode rows are contiguous
    (vLLM puts decode requests first): the forward then reads the query and writes the
    output in place instead of gathering and scattering them."""
    prefill_rows: slice | None = None
    """``prefill_token_idx`` as one slice of ``q`` when the prefill rows are contiguous
    (after the decode rows, as vLLM orders a batch): read and written in place."""

    @property
    def num_decode_tokens(self) -> int:
        return int(self.decode_token_idx.shape[0])

    @property
    def num_prefill_tokens(self) -> int:
        return int(self.prefill_token_idx.shape[0])


@dataclass(frozen=True, kw_only=True)
class MLASparseMetadata(MLAMetadata):
    """MLA metadata plus the indexer's choice: every token attends over its top-k
    positions only, on the absorbed path (``docs/mla.md``, "Sparse")."""

    topk_indices: torch.Tensor | None = None
    """``[num_actual_tokens, topk]`` int32 positions within the token's request;
    ``-1`` pads. A position is attended iff ``0 <= p <= token position``."""

    def with_topk_indices(self, topk_indices: torch.Tensor) -> MLASparseMetadata:
        """A copy carrying ``topk_indices`` (as an indexer produces them per step)."""
        check_topk_indices(topk_indices, self.num_actual_tokens, self.token_req.device)
        return dataclasses.replace(self, topk_indices=topk_indices)


def check_topk_indices(topk: object, num_tokens: int, device: torch.device) -> torch.Tensor:
    if not isinstance(topk, torch.Tensor):
        raise InvalidTypeError("topk_indices", type(topk).__name__, "a torch.Tensor")
    if topk.dtype != torch.int32:
        raise InvalidArgumentError("topk_indices.dtype", topk.dtype, "torch.int32")
    if topk.dim() != 2 or topk.shape[0] < num_tokens or topk.shape[1] < 1:
        raise InvalidArgumentError("topk_indices.shape", tuple(topk.shape),
                                   f"[>= num_tokens={num_tokens}, topk >= 1]")
    if topk.device != device:
        raise InvalidArgumentError("topk_indices.device", str(topk.device), f"{device}")
    return topk


MT = TypeVar("MT", bound=MLAMetadata)


def _as_slice(rows: list[int]) -> slice | None:
    """``rows`` (ascending) as one slice when they are contiguous, else None."""
    if rows and rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return None


def split_batch(cls: type[MT], common: CommonAttentionMetadata, *, decode_threshold: int,
                prefill_chunk_tokens: int, device: torch.device) -> MT:
    """``cls`` metadata for ``common``: the decode/prefill split, computed on the host
    from ``*_cpu`` tensors (no device sync) and copied to ``device`` once."""
    if not common.causal:
        raise InvalidArgumentError("common.causal", False, "True: MLA is causal decoder attention")
    if prefill_chunk_tokens <= 0:
        raise InvalidArgumentError("prefill_chunk_tokens", prefill_chunk_tokens, "a positive int")
    starts = [int(x) for x in common.query_start_loc_cpu.tolist()]
    lens = [int(x) for x in common.seq_lens_cpu.tolist()]
    token_req: list[int] = []
    token_pos: list[int] = []
    dec_idx: list[int] = []
    pre_idx: list[int] = []
    dec_groups: list[DecodeGroup] = []
    pre_groups: list[PrefillGroup] = []
    dec_reqs: list[int] = []
    single = True
    for r in range(common.num_reqs):
        qs, qe, sl = starts[r], starts[r + 1], lens[r]
        ql = qe - qs
        if ql > sl:
            raise InvalidArgumentError(f"seq_lens[{r}]", sl, f">= its query length {ql}")
        token_req.extend([r] * ql)
        token_pos.extend(range(sl - ql, sl))
        if ql == 0:
            continue
        if ql <= decode_threshold:
            dec_groups.append(DecodeGroup(r, sl, slice(len(dec_idx), len(dec_idx) + ql)))
            dec_idx.extend(range(qs, qe))
            dec_reqs.append(r)
            single = single and ql == 1
        else:
            pre_groups.append(PrefillGroup(r, sl, slice(len(pre_idx), len(pre_idx) + ql)))
            pre_idx.extend(range(qs, qe))

    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    dec_reqs_t = t(dec_reqs, torch.int64)
    return cls(
        **common_fields(common),
        token_req=t(token_req, torch.int32), token_pos=t(token_pos, torch.int32),
        decode_threshold=decode_threshold,
        decode_token_idx=t(dec_idx, torch.int64), prefill_token_idx=t(pre_idx, torch.int64),
        decode_groups=tuple(dec_groups), prefill_groups=tuple(pre_groups),
        decode_req_ids=dec_reqs_t,
        decode_token_req=t([token_req[i] for i in dec_idx], torch.int32),
        decode_token_pos=t([token_pos[i] for i in dec_idx], torch.int32),
        decode_seq_lens=common.seq_lens[dec_reqs_t].to(torch.int32),
        decode_block_table=common.block_table[dec_reqs_t],
        max_decode_seq_len=max((g.seq_len for g in dec_groups), default=0),
        uniform_single_token_decode=single, prefill_chunk_tokens=prefill_chunk_tokens,
        decode_rows=_as_slice(dec_idx), prefill_rows=_as_slice(pre_idx),
    )


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """Splits the batch: requests with at most ``decode_threshold`` new tokens take
    the absorbed path, the rest the expanded (prefill) path."""

    decode_threshold: int = 1
    prefill_chunk_tokens: int = 4096

    def build(self, common: CommonAttentionMetadata) -> MLAMetadata:
        return split_batch(MLAMetadata, common, decode_threshold=self.decode_threshold,
                           prefill_chunk_tokens=self.prefill_chunk_tokens, device=self.device)


class MLASparseMetadataBuilder(AttentionMetadataBuilder[MLASparseMetadata]):
    """Sparse MLA: every token takes the absorbed path over its top-k positions."""

    prefill_chunk_tokens: int = 4096

    def build(self, common: CommonAttentionMetadata,
              topk_indices: torch.Tensor | None = None) -> MLASparseMetadata:
        """``topk_indices`` may also be attached later with
        :meth:`MLASparseMetadata.with_topk_indices`."""
        meta = split_batch(MLASparseMetadata, common,
                           decode_threshold=max(common.max_query_len, 1),
                           prefill_chunk_tokens=self.prefill_chunk_tokens, device=self.device)
        return meta if topk_indices is None else meta.with_topk_indices(topk_indices)


MM = TypeVar("MM", bound=MLAMetadata)


# -- the impl -------------------------------------------------------------------------
def _triton_available() -> bool:
    return _importable("triton")


@functools.cache
def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # any failure to import means the path cannot run here
        return False
    return True


def portable_path(device: torch.device) -> ComputePath:
    """``triton`` (Triton decode kernel, torch prefill) on CUDA when Triton imports,
    else ``torch``."""
    if device.type == "cuda" and _triton_available():
        return "triton"
    return "torch"


def fp8_mma_from_env() -> bool | None:
    """``VLLM_MLA_FP8_MMA``: the value of :attr:`MLACommonImpl.fp8_mma` for the layers
    built after it is read: on for ``1``/``true``/``yes``/``on``, off for ``0``/``false``/
    ``no``/``off``, None (each backend's default) when unset or empty. Any other value
    is refused, not read as off."""
    return env_switch("VLLM_MLA_FP8_MMA")


class MLACommonImpl(AttentionImpl[MM], Generic[MM]):
    """Compute of one MLA layer over its latent cache. Never writes ``kv_cache``.

    Decode rows run absorbed (``q_nope @ W_UK`` against the latent, output through
    ``W_UV``); prefill rows expand K/V from the latent and run causal attention,
    chunked over the context. ``vendor`` (a class attribute set per backend) is
    used for decode when it can run; ``last_path`` records what ran.
    """

    vendor: ClassVar[MLAVendorKernel | None] = None
    is_sparse: ClassVar[bool] = False
    fp8_mma_default: ClassVar[bool] = False
    """Whether this backend's portable decode, with an E4M3 cache and :attr:`fp8_mma`
    left at None, runs on fp8 tensor cores (the query and the probabilities rounded to
    E4M3) where that is the faster kernel: past ``FEW_HEADS_MAX`` heads, where the exact
    kernel is the lead-warpgroup one. FLASHMLA sets it (upstream's FLASHMLA decodes an
    fp8 cache with an fp8 query); the others keep exact dots, as upstream's TRITON_MLA
    does (``docs/mla.md``)."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        if not isinstance(spec, MLALayerSpec):
            raise InvalidTypeError(
                "spec", type(spec).__name__,
                "an MLALayerSpec (MLA backends need the latent dims and weights)")
        super().__init__(spec)
        self.mla: MLALayerSpec = spec
        self.force_path: ComputePath | None = None
        """Tests and benchmarks pin a path (``torch``, ``triton`` or the vendor's)."""
        self.fp8_mma: bool | None = fp8_mma_from_env()
        """With an E4M3 cache, whether the portable decode on sm_90 runs on fp8 tensor
        cores, the query and the probabilities rounded to E4M3 (FlashMLA's fp8 numerics:
        less exact, ``triton_mla_decode.FP8_MMA_TOLERANCE``; ``docs/mla.md``). True or
        False at any head count; None (unless ``VLLM_MLA_FP8_MMA`` is set,
        :func:`fp8_mma_from_env`): the backend's choice, :attr:`fp8_mma_default`.
        :meth:`uses_fp8_mma` says what it comes to."""
        self.last_path: ComputePath | None = None
        self._paths: dict[tuple[torch.device, int, bool], ComputePath] = {}

    # -- path choice --------------------------------------------------------------------
    def uses_fp8_mma(self) -> bool:
        """Whether the portable decode asks for the fp8-MMA kernel: :attr:`fp8_mma`, or
        where it is None, :attr:`fp8_mma_default` past ``FEW_HEADS_MAX`` heads (up to it
        the exact few-heads kernel is the faster). The kernel takes the decode only on
        sm_90 with an E4M3 cache (``triton_mla_decode.takes_fp8_mma``)."""
        if self.fp8_mma is not None:
            return self.fp8_mma
        from vllm.attention.ops.triton_mla_decode import FEW_HEADS_MAX

        return type(self).fp8_mma_default and self.mla.num_heads > FEW_HEADS_MAX

    def prefill_path(self, device: torch.device, dtype: torch.dtype) -> str:
        """``flash-prefill`` (:mod:`~vllm.attention.ops.mla_prefill_flash`: torch's flash
        kernel in the model dtype) where it runs, unless :attr:`force_path` is
        ``torch``; else ``torch-prefill`` (float32 torch)."""
        if self.force_path == "torch":
            return "torch-prefill"
        from vllm.attention.ops.mla_prefill_flash import mla_prefill_flash_rejects

        spec = self.mla
        if mla_prefill_flash_rejects(device, dtype, qk_head_dim=spec.qk_head_dim,
                                     v_head_dim=spec.v_head_dim):
            return "torch-prefill"
        return "flash-prefill"

    def compute_tolerance(self, tolerance: float) -> float:
        """The relative error this impl's decode is held to, given its backend's
        ``tolerance`` for the model dtype: with an E4M3 cache and :meth:`uses_fp8_mma`,
        at least ``triton_mla_decode.FP8_MMA_TOLERANCE`` (the query and the
        probabilities rounded to E4M3), else ``tolerance``."""
        if kv_cache_format(self.mla.kv_cache_dtype) == "fp8_e4m3" and self.uses_fp8_mma():
            from vllm.attention.ops.triton_mla_decode import FP8_MMA_TOLERANCE

            return max(tolerance, FP8_MMA_TOLERANCE)
        return tolerance

    def decode_path(self, device: torch.device, meta: MLAMetadata) -> ComputePath:
        """The vendor kernel when it can take this step, else the portable path."""
        if self.force_path is not None:
            return self.force_path
        key = (device, meta.block_size, meta.uniform_single_token_decode)
        path = self._paths.get(key)
        if path is None:
            v = self.vendor
            if (v is not None and not self.is_sparse and meta.uniform_single_token_decode
                    and not v.unavailable_reasons(device, self.mla.kv_cache_dtype)
                    and not v.config_reasons(self.mla, meta.block_size)):
                path = v.name
            else:
                path = portable_path(device)
            self._paths[key] = path
        return path

    # -- forward ------------------------------------------------------------------------
    def forward(
        self,
        layer: AttentionLayerProtocol,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: MM,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """MLA attention of this step's queries.

        Args:
            query: ``[>= T, N, P + R]``.
            key, value: this step's ``kv_c_normed`` ``[T, L]`` and ``k_pe`` ``[T, R]``,
                already in the cache; unused (compute reads the cache).
            kv_cache: ``(nb, bs, L + R)`` or ``(nb, bs, 656)`` uint8 (read only).
            output: ``[>= T, N * V]`` or ``[>= T, N, V]``; rows ``< T`` are written.
        Returns:
            ``output``.
        """
        spec = self.mla
        meta = attn_metadata
        t = meta.num_actual_tokens
        n, v_dim = spec.num_heads, spec.v_head_dim
        self._check_inputs(query, kv_cache, output, t)
        out3 = output.view(output.shape[0], n, v_dim)
        fmt = self.latent_format(layer, query.dtype)
        if self.is_sparse:
            self._forward_sparse(query, kv_cache, meta, fmt, out3)
            return output
        paths: list[str] = []
        if meta.num_decode_tokens:
            path = self.decode_path(query.device, meta)
            rows = meta.decode_rows
            q = query[meta.decode_token_idx] if rows is None else query[rows]
            o_lat = self._decode(path, q, kv_cache, meta, fmt).to(query.dtype)
            if rows is not None and output.dtype == query.dtype:
                # the output projection writes its rows of the output directly
                spec.projection.project_output(o_lat, out=out3[rows])
            else:
                out3[meta.decode_token_idx] = spec.projection.project_output(
                    o_lat).to(output.dtype)
            paths.append(path)
        if meta.num_prefill_tokens:
            prows = meta.prefill_rows
            q = query[meta.prefill_token_idx] if prows is None else query[prows]
            prefill = self.prefill_path(q.device, q.dtype)
            run = mla_prefill_torch
            if prefill == "flash-prefill":
                from vllm.attention.ops.mla_prefill_flash import mla_prefill_flash

                run = mla_prefill_flash
            o = run(q, kv_cache, meta.block_table, meta.prefill_groups, fmt,
                    spec.projection.w_uk, spec.projection.w_uv, scale=spec.scale,
                    chunk_tokens=meta.prefill_chunk_tokens)
            if prows is None:
                out3[meta.prefill_token_idx] = o.to(output.dtype)
            else:
                out3[prows] = o
            paths.append(prefill)
        self.last_path = "+".join(paths) if paths else None
        return output

    def _absorb(self, q: torch.Tensor) -> torch.Tensor:
        """``[T, N, P + R]`` -> ``[T, N, L + R]``: ``[q_nope @ W_UK, q_pe]``."""
        p = self.mla.qk_nope_head_dim
        ql_nope = self.mla.projection.absorb_query(q[..., :p])
        return torch.cat([ql_nope, q[..., p:]], dim=-1)

    def _decode(self, path: ComputePath, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: MLAMetadata, fmt: LatentFormat) -> torch.Tensor:
        """``q`` ``[Td, N, P + R]`` -> ``[Td, N, L]`` on ``path`` (float32, or the model
        dtype on the Triton path)."""
        scale = self.mla.scale
        if path == "torch":
            return mla_decode_torch(self._absorb(q), kv_cache, meta.block_table,
                                    meta.decode_groups, fmt, scale=scale)
        if path == "triton":
            from vllm.attention.ops.triton_mla import mla_decode_triton

            # the kernel reads the absorbed part and the rope part where they are (no
            # [Td, N, L + R] copy) and writes the model dtype the output projection takes
            p = self.mla.qk_nope_head_dim
            return mla_decode_triton(
                self.mla.projection.absorb_query(q[..., :p]), kv_cache, meta.block_table,
                meta.decode_token_req, meta.decode_token_pos, fmt, scale=scale,
                max_seq_len=meta.max_decode_seq_len, out_dtype=q.dtype, q_pe=q[..., p:],
                fp8_mma=self.uses_fp8_mma(),
            )
        v = self.vendor
        if v is None or path != v.name:
            raise InvalidArgumentError(
                "force_path", path,
                "'torch', 'triton'" + (f" or {v.name!r}" if v is not None else ""),
            )
        return v.decode(self._absorb(q), kv_cache, meta.decode_block_table,
                        meta.decode_seq_lens, meta.max_decode_seq_len, self.mla, fmt)

    def _forward_sparse(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: MLAMetadata,
                        fmt: LatentFormat, out3: torch.Tensor) -> None:
        topk = meta.topk_indices if isinstance(meta, MLASparseMetadata) else None
        t = meta.num_actual_tokens
        if topk is None:
            raise InvalidArgumentError(
                "attn_metadata.topk_indices", None,
                "[num_tokens, topk] int32 from the indexer (MLASparseMetadata.with_topk_indices)",
            )
        if t == 0:
            self.last_path = None
            return
        q_lat = self._absorb(query[:t])
        path = self.force_path or portable_path(query.device)
        if path == "triton":
            from vllm.attention.ops.triton_mla import mla_sparse_triton

            o_lat = mla_sparse_triton(q_lat, kv_cache, topk[:t], meta.token_req, meta.token_pos,
                                      meta.block_table, fmt, scale=self.mla.scale)
        elif path == "torch":
            o_lat = mla_sparse_torch(q_lat, kv_cache, topk[:t], meta.token_req, meta.token_pos,
                                     meta.block_table, fmt, scale=self.mla.scale)
        else:
            raise InvalidArgumentError("force_path", path, "'torch' or 'triton' for sparse MLA")
        out3[:t] = self.mla.projection.project_output(o_lat.to(query.dtype)).to(out3.dtype)
        self.last_path = path

    # -- checks and formats ---------------------------------------------------------------
    def latent_format(self, layer: AttentionLayerProtocol,
                      model_dtype: torch.dtype) -> LatentFormat:
        """How ``layer``'s cache rows decode (format, dims, scale, rope bytes' dtype)."""
        quant = layer.kv_quant
        return LatentFormat(
            cache_dtype=quant.kv_cache_dtype, kv_lora_rank=self.mla.kv_lora_rank,
            rope_dim=self.mla.qk_rope_head_dim, k_scale=quant.k_scale,
            rope_dtype=torch.float16 if model_dtype == torch.float16 else torch.bfloat16,
        )

    def _check_inputs(self, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                      t: int) -> None:
        spec = self.mla
        want_q = (spec.num_heads, spec.qk_head_dim)
        if query.dim() != 3 or tuple(query.shape[1:]) != want_q or query.shape[0] < t:
            raise InvalidArgumentError("query.shape", tuple(query.shape),
                                       f"[>= {t}, N={want_q[0]}, P + R={want_q[1]}]")
        width = spec.num_heads * spec.v_head_dim
        if output.dim() < 2 or output.shape[0] < t or math.prod(output.shape[1:]) != width:
            raise InvalidArgumentError("output.shape", tuple(output.shape),
                                       f"[>= {t}, N * V = {width}] or [>= {t}, N, V]")
        entry = (FP8_DS_MLA_ENTRY_BYTES if spec.kv_cache_dtype == "fp8_ds_mla"
                 else spec.head_size)
        if kv_cache.dim() != 3 or kv_cache.shape[2] != entry:
            raise InvalidArgumentError("kv_cache.shape", tuple(kv_cache.shape),
                                       f"(num_blocks, block_size, {entry})")
        if kv_cache.device != query.device:
            raise InvalidArgumentError("kv_cache.device", str(kv_cache.device),
                                       f"{query.device} (the query's)")


# -- the backend declarations -------------------------------------------------------------
class MLABackend(AttentionBackend[MM]):
    """Declarations every MLA backend shares; subclasses set the capability data,
    ``get_impl_cls`` (whose ``vendor`` names the kernel package) and the builder."""

    is_mla: ClassVar[bool] = True
    kv_cache_layout: ClassVar[KVCacheLayout] = KVCacheLayout.MLA_LATENT
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = HALF_DTYPES
    head_sizes: ClassVar[SizeSpec] = exactly(DEEPSEEK_HEAD_SIZE)
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def get_impl_cls(cls) -> type[MLACommonImpl[MM]]: ...

    @classmethod
    def kv_cache_layout_for(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheLayout:
        """``MLA_FP8_DS`` (``(nb, bs, 656)`` uint8) for ``fp8_ds_mla``, else ``MLA_LATENT``."""
        return KVCacheLayout.MLA_FP8_DS if cache_dtype == "fp8_ds_mla" else KVCacheLayout.MLA_LATENT

    @classmethod
    def get_kv_cache_writer(
        cls, cache_dtype: KVCacheDType = "auto"
    ) -> KVCacheWriter | MLAKVCacheWriter:
        """The latent writer (``auto`` / fp8) or the 656-byte ``fp8_ds_mla`` writer."""
        spelled = cls.cache_dtype_spelling(cache_dtype)
        if spelled is None:
            raise InvalidArgumentError(
                "cache_dtype", cache_dtype,
                f"one of {', '.join(sorted(cls.supported_kv_cache_dtypes))} for {cls.name}",
            )
        cache_dtype = spelled
        if cache_dtype == "fp8_ds_mla":
            from vllm.attention.writers.fp8_ds_mla import FP8DsMLACacheWriter

            return FP8DsMLACacheWriter()
        from vllm.attention.writers.mla import MLALatentCacheWriter

        return MLALatentCacheWriter(
            tuple(sorted(c for c in cls.supported_kv_cache_dtypes if c != "fp8_ds_mla")))

    # -- compute path -----------------------------------------------------------------
    @classmethod
    def compute_path(cls, device: torch.device, cache_dtype: KVCacheDType = "auto") -> ComputePath:
        """The decode path that runs on ``device`` for ``cache_dtype`` (prefill is torch)."""
        v = cls.get_impl_cls().vendor
        if v is not None and not v.unavailable_reasons(device, cache_dtype):
            return v.name
        return portable_path(device)

    @classmethod
    def compute_path_notes(cls, device: torch.device) -> list[str]:
        notes: list[str] = []
        v = cls.get_impl_cls().vendor
        if v is not None:
            notes.extend(f"{v.name}: {r}" for r in v.unavailable_reasons(device, "auto"))
        elif cls.is_sparse:
            notes.append("no vendor sparse kernel wired (docs/mla.md)")
        if device.type == "cuda" and not _triton_available():
            notes.append("triton: not importable, decode runs on torch")
        elif device.type != "cuda":
            notes.append(f"triton: device={device.type}, the Triton MLA kernels need cuda")
        if cls.get_impl_cls().fp8_mma_default:
            from vllm.attention.ops.triton_mla_decode import FEW_HEADS_MAX

            notes.append(f"an E4M3 cache past {FEW_HEADS_MAX} heads: fp8 tensor cores on "
                         "sm_90, the query and the probabilities rounded to E4M3 as "
                         "upstream's FLASHMLA does (VLLM_MLA_FP8_MMA=0: exact dots; "
                         "docs/mla.md)")
        return notes
