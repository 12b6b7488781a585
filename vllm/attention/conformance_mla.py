"""The conformance kit for MLA backends (``conformance.check_backend`` calls it).

For each configuration derived from the backend's declarations (every model
dtype, cache dtype and allowed block size):

1. **write exact**: the backend's writer leaves the cache byte-identical to this
   module's reference MLA writer applied to a copy; the cache starts as random
   bytes, so this also proves nothing outside the named slots changed;
2. **compute**: a mixed prefill/decode batch whose contexts cross block
   boundaries, run through :class:`~vllm.attention.layer.MLAAttention` (write,
   then compute), is within tolerance of a float64 reference that expands the
   latent explicitly (:func:`expand_latent`) over the
   dequantised cached rows; sparse backends are checked against the dense
   reference restricted to the same top-k positions;
3. **compute is read-only**: the cache bytes after the layer's forward equal those
   a KV connector saw right after the write, before compute;
4. **no slot_mapping**: the metadata class has no ``slot_mapping`` field.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.backend import AttentionBackend, allocate_kv_cache, dtype_name
from vllm.attention.backends.mla.common import (
    MLACommonImpl,
    MLAMetadata,
    MLAProjection,
    MLALayerSpec,
    MLASparseMetadata,
)
from vllm.attention.batch import make_paged_batch
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.layer import MLAAttention
from vllm.attention.layouts import FP8_DS_MLA_LATENT, FP8_DS_MLA_TILE
from vllm.attention.ops.reference import attend
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant
from vllm.attention.writers.readback import reference_write
from vllm.forward_context import set_forward_context

AnyBackend = type[AttentionBackend[Any]]

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class MLACheckConfig:
    """One point of an MLA backend's conformance grid."""

    backend: str
    device: str
    dtype: torch.dtype
    cache_dtype: KVCacheDType
    block_size: int
    num_heads: int = 2
    kv_lora_rank: int = 512
    rope_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64

    @property
    def id(self) -> str:
        return "-".join([self.backend, self.device, dtype_name(self.dtype), self.cache_dtype,
                         f"bs{self.block_size}"])


def mla_conformance_grid(backend: AnyBackend, device: str | torch.device = "cpu", *,
                         thorough: bool = False) -> list[MLACheckConfig]:
    """Every cache dtype x allowed block size in the first model dtype (bfloat16 when
    declared), and every cache dtype at the smallest block size in the other model
    dtypes; ``thorough``: the full product."""
    dev = torch.device(device)
    dtypes = [d for d in (torch.bfloat16, torch.float16, torch.float32)
              if d in backend.supported_dtypes]
    if dev.type == "cuda":
        dtypes = [d for d in dtypes if d != torch.float32] or dtypes
    head = 512 + 64
    if not backend.head_sizes.admits(head):
        raise InvalidArgumentError(
            f"{backend.name}.head_sizes", backend.head_sizes.describe(),
            f"sizes admitting the kit's kv_lora_rank + rope_dim = {head}")
    cache_dtypes = sorted(backend.supported_kv_cache_dtypes, key=lambda c: (c != "auto", c))
    block_sizes = backend.block_sizes.examples((1, 16, 32, 64, 128))
    # on a GPU, DeepSeek-V3's per-GPU shape, so the vendor kernels' shape checks pass;
    # on the CPU, a small one (the torch path is shape-generic)
    dims = (dict(num_heads=128, qk_nope_head_dim=128, v_head_dim=128) if dev.type == "cuda"
            else dict(num_heads=2, qk_nope_head_dim=64, v_head_dim=64))
    return [MLACheckConfig(backend.name, dev.type, dt, cd, bs, **dims)
            for i, dt in enumerate(dtypes) for cd in cache_dtypes
            for bs in (block_sizes if thorough or i == 0 else block_sizes[:1])]


# -- the reference writer and decoder (the oracle: short and obviously right) ----------
def reference_mla_write(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, quant: KVQuant) -> None:
    """The writers' torch reference for the MLA layout of ``quant.kv_cache_dtype``
    (one reference for the kit and the writer tests; on CUDA it divides exactly
    as the kernels do, where a hand-rolled ``x / 448.0`` would not)."""
    layout = (KVCacheLayout.MLA_FP8_DS if quant.kv_cache_dtype == "fp8_ds_mla"
              else KVCacheLayout.MLA_LATENT)
    reference_write(layout, kv_c, k_pe, kv_cache, slot_mapping, quant)


def reference_rows(kv_cache: torch.Tensor, slots: torch.Tensor, quant: KVQuant,
                   kv_lora_rank: int, rope_dtype: torch.dtype) -> torch.Tensor:
    """Cached rows at ``slots`` dequantised to float64 ``[n, L + R]`` (on the cache's
    device: float64 is exact enough and keeps a 128-head GPU grid fast)."""
    bs = kv_cache.shape[1]
    rows = kv_cache[slots // bs, slots % bs]
    cd = quant.kv_cache_dtype
    if cd == "fp8_ds_mla":
        lat = rows[:, :FP8_DS_MLA_LATENT].contiguous().view(torch.float8_e4m3fn).double()
        n_tiles = FP8_DS_MLA_LATENT // FP8_DS_MLA_TILE
        scales = rows[:, FP8_DS_MLA_LATENT:FP8_DS_MLA_LATENT + 4 * n_tiles].contiguous()
        scales = scales.view(torch.float32).double()
        lat = (lat.view(-1, n_tiles, FP8_DS_MLA_TILE) * scales[..., None]).flatten(1)
        rope = rows[:, FP8_DS_MLA_LATENT + 4 * n_tiles:].contiguous().view(rope_dtype).double()
        return torch.cat([lat, rope], dim=1)
    if cd in _FP8:
        return rows.double() * float(quant.k_scale[0])
    return rows.double()


def expand_latent(rows: torch.Tensor, spec: MLALayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 K ``[S, N, P + R]`` and V ``[S, N, V]`` expanded from latent rows ``[S, L + R]``:
    ``k = [kv_c W_UK^T, k_pe]``, ``v = kv_c W_UV``."""
    L = spec.kv_lora_rank
    w_uk = spec.projection.w_uk.double().to(rows.device)
    w_uv = spec.projection.w_uv.double().to(rows.device)
    kv_c, k_pe = rows[:, :L], rows[:, L:]
    k_nope = torch.einsum("sl,npl->snp", kv_c, w_uk)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, spec.num_heads, -1)], dim=-1)
    return k, torch.einsum("sl,nlv->snv", kv_c, w_uv)


# -- the checks ---------------------------------------------------------------------------
def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: str,
           gen: torch.Generator, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std).to(dtype).to(device)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def make_mla_layer(backend: AnyBackend, cfg: MLACheckConfig, gen: torch.Generator,
                   name: str = "conformance.mla") -> MLAAttention:
    """An :class:`MLAAttention` with random up-projections (output of order one)."""
    n, L, P, V = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    proj = MLAProjection(
        w_uk=_randn((n, P, L), cfg.dtype, cfg.device, gen, L ** -0.5),
        w_uv=_randn((n, L, V), cfg.dtype, cfg.device, gen, L ** -0.5),
    )
    spec = MLALayerSpec.create(num_heads=n, kv_lora_rank=L, qk_nope_head_dim=P,
                               qk_rope_head_dim=cfg.rope_dim, v_head_dim=V, projection=proj,
                               kv_cache_dtype=cfg.cache_dtype)
    k_scale = float(torch.rand(1, generator=gen)) * 0.5 + 0.5 if cfg.cache_dtype in _FP8 else None
    return MLAAttention(spec=spec, backend=backend, layer_name=name, k_scale=k_scale,
                        checked=True).to(cfg.device)


def _random_cache(backend: AnyBackend, cfg: MLACheckConfig, num_blocks: int,
                  gen: torch.Generator) -> torch.Tensor:
    cache = allocate_kv_cache(backend, num_blocks=num_blocks, block_size=cfg.block_size,
                              num_kv_heads=1, head_size=cfg.kv_lora_rank + cfg.rope_dim,
                              cache_dtype=cfg.cache_dtype, model_dtype=cfg.dtype,
                              device=cfg.device)
    raw = cache.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    # random bytes include NaN / inf patterns: a path that lets an unwritten row
    # leak into a result shows up as a NaN
    return cache


def check_mla_write(backend: AnyBackend, cfg: MLACheckConfig, gen: torch.Generator) -> list[str]:
    """Writer bytes == reference writer bytes; untouched rows unchanged."""
    failures: list[str] = []
    layer = make_mla_layer(backend, cfg, gen)
    num_blocks = 5 if cfg.block_size > 1 else 40
    cache = _random_cache(backend, cfg, num_blocks, gen)
    num_slots = num_blocks * cfg.block_size
    n = min(num_slots - 1, 23)
    slots = torch.randperm(num_slots, generator=gen)[:n].to(torch.int64)
    slots[torch.rand(n, generator=gen) < 0.2] = -1
    slots = slots.to(cfg.device)
    kv_c = _randn((n + 3, cfg.kv_lora_rank), cfg.dtype, cfg.device, gen)
    k_pe = _randn((n + 3, cfg.rope_dim), cfg.dtype, cfg.device, gen)
    before = cache.clone()
    expected = cache.clone()
    layer.kv_cache_writer.write(kv_c, k_pe, cache, slots, layer.kv_quant)
    reference_mla_write(kv_c, k_pe, expected, slots, layer.kv_quant)
    got, want = _raw(cache), _raw(expected)
    if not torch.equal(got, want):
        diff = int((got != want).sum().item())
        failures.append(f"{cfg.id} write: {diff} byte(s) differ from the reference MLA writer")
    bs = cfg.block_size
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat_now = cache.view(num_slots, -1)[untouched.to(cfg.device)]
    flat_before = before.view(num_slots, -1)[untouched.to(cfg.device)]
    if not torch.equal(_raw(flat_now), _raw(flat_before)):
        failures.append(f"{cfg.id} write: rows outside the named slots changed (bs={bs})")
    return failures


def _sparse_topk(positions: torch.Tensor, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Per token: up to ``topk`` distinct positions in ``[0, pos]`` (some ``-1`` pads)."""
    rows = []
    for p in positions.tolist():
        k = min(topk, p + 1)
        chosen = torch.randperm(p + 1, generator=gen)[:k]
        row = torch.full((topk,), -1, dtype=torch.int32)
        row[:k] = chosen.to(torch.int32)
        if k > 2:
            row[k - 1] = -1  # an explicit pad among real indices
        rows.append(row[torch.randperm(topk, generator=gen)])
    return torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.int32)


class _Snapshot:
    """A KV connector that keeps the cache bytes as they are right after the write,
    before compute runs."""

    def __init__(self) -> None:
        self.bytes: torch.Tensor | None = None

    def on_kv_written(self, layer_name: str, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        self.bytes = _raw(kv_cache).clone()


def check_mla_compute(backend: AnyBackend, cfg: MLACheckConfig,
                      gen: torch.Generator) -> list[str]:
    """Layer forward vs the float64 expanded reference; compute is read-only."""
    failures: list[str] = []
    bs = cfg.block_size
    query_lens = [bs + 3, 1, 7, 1, 2] if bs > 1 else [5, 1, 3, 1]
    context_lens = [0, 2 * bs + 1, bs, bs - 1, 3 * bs + 5] if bs > 1 else [0, 9, 2, 1]
    batch = make_paged_batch(query_lens, context_lens, block_size=bs, device=cfg.device,
                             generator=gen)
    layer = make_mla_layer(backend, cfg, gen)
    spec = layer.spec
    if not isinstance(spec, MLALayerSpec):  # make_mla_layer built it
        raise TypeError(type(spec).__name__)
    cache = _random_cache(backend, cfg, batch.num_blocks, gen)
    layer.bind_kv_cache(cache, bs)
    n_ctx, n_new = int(batch.context_slots.numel()), int(batch.new_slots.numel())
    L, R = cfg.kv_lora_rank, cfg.rope_dim
    kv_c_ctx = _randn((n_ctx, L), cfg.dtype, cfg.device, gen)
    k_pe_ctx = _randn((n_ctx, R), cfg.dtype, cfg.device, gen)
    kv_c_new = _randn((n_new, L), cfg.dtype, cfg.device, gen)
    k_pe_new = _randn((n_new, R), cfg.dtype, cfg.device, gen)
    q = _randn((n_new, cfg.num_heads, spec.qk_head_dim), cfg.dtype, cfg.device, gen)
    builder = backend.get_builder_cls()(spec, torch.device(cfg.device))
    meta: Any = builder.build(batch.common)
    if not isinstance(meta, MLAMetadata):
        return [f"{cfg.id} compute: builder returned {type(meta).__name__}, not MLAMetadata"]
    topk: torch.Tensor | None = None
    if backend.is_sparse:
        if not isinstance(meta, MLASparseMetadata):
            return [f"{cfg.id} compute: sparse builder returned {type(meta).__name__}"]
        topk = _sparse_topk(batch.positions.cpu(), 12, gen).to(cfg.device)
        meta = meta.with_topk_indices(topk)
    if n_ctx:
        layer.kv_cache_writer.write(kv_c_ctx, k_pe_ctx, cache, batch.context_slots,
                                    layer.kv_quant)
    name = layer.layer_name
    out = torch.full((n_new, cfg.num_heads * cfg.v_head_dim), math.nan, dtype=cfg.dtype,
                     device=cfg.device)
    snapshot = _Snapshot()
    with set_forward_context(attn_metadata={name: meta}, slot_mapping={name: batch.new_slots},
                             kv_connector=snapshot):
        result = layer(q, kv_c_new, k_pe_new, out)
    path = getattr(layer.impl, "last_path", None)
    tag = f"{cfg.id}[{path}]"
    if snapshot.bytes is None:
        failures.append(f"{tag} compute: the layer did not write (no connector call)")
    elif not torch.equal(_raw(cache), snapshot.bytes):
        failures.append(f"{tag} compute: impl.forward changed the cache bytes")
    if bool(torch.isnan(result).any()):
        failures.append(f"{tag} compute: output has NaN (rows unwritten or masked wrongly)")
        return failures
    ref = _reference_output(cfg, spec, cache, batch, q, layer.kv_quant, topk)
    tol = backend.tolerances[cfg.dtype]
    if isinstance(layer.impl, MLACommonImpl):  # E4M3 query and probabilities, if it uses them
        tol = layer.impl.compute_tolerance(tol)
    got = result.view(n_new, cfg.num_heads, cfg.v_head_dim).double()
    err = float((got - ref).norm()) / max(float(ref.norm()), 1e-30)
    if not err <= tol:
        failures.append(f"{tag} compute: relative error {err:.2e} > tolerance {tol:.0e}; "
                        + mla_exercised_features(cfg, sparse=topk is not None))
    return failures


def mla_exercised_features(cfg: MLACheckConfig, *, sparse: bool) -> str:
    """What an MLA configuration exercises, each with the declaration that opts out."""
    parts: list[str] = []
    if cfg.cache_dtype == "fp8_ds_mla":
        parts.append("kv_cache_dtype='fp8_ds_mla': 656-byte entries, per-tile scales (a "
                     "backend without it leaves 'fp8_ds_mla' out of supported_kv_cache_dtypes)")
    elif cfg.cache_dtype != "auto":
        parts.append(f"kv_cache_dtype={cfg.cache_dtype!r} scaled by k_scale (a backend without "
                     f"it leaves {cfg.cache_dtype!r} out of supported_kv_cache_dtypes)")
    if sparse:
        parts.append("sparse top-k positions per query (is_sparse = True)")
    parts.append(f"dtype={dtype_name(cfg.dtype)}, block_size={cfg.block_size}, "
                 f"num_heads={cfg.num_heads}, kv_lora_rank={cfg.kv_lora_rank}, "
                 f"rope_dim={cfg.rope_dim}, a batch of prefill, chunked prefill and decode "
                 "requests whose contexts cross block boundaries")
    return "the configuration exercises " + "; ".join(parts)


def _reference_output(cfg: MLACheckConfig, spec: MLALayerSpec, cache: torch.Tensor,
                      batch: Any, q: torch.Tensor, quant: KVQuant,
                      topk: torch.Tensor | None) -> torch.Tensor:
    rope_dtype = torch.float16 if cfg.dtype == torch.float16 else torch.bfloat16
    ref = torch.empty(q.shape[0], cfg.num_heads, cfg.v_head_dim, dtype=torch.float64,
                      device=q.device)
    ctx_at = new_at = 0
    for c, qn in zip(batch.context_lens, batch.query_lens):
        slots = torch.cat([batch.context_slots[ctx_at: ctx_at + c],
                           batch.new_slots[new_at: new_at + qn]])
        rows = reference_rows(cache, slots, quant, cfg.kv_lora_rank, rope_dtype)
        k, v = expand_latent(rows, spec)
        q64 = q[new_at: new_at + qn].double()
        if topk is None:
            ref[new_at: new_at + qn] = attend(q64, k, v, scale=spec.scale, causal=True)
        else:
            for j in range(qn):
                pos = c + j
                idx = [int(i) for i in topk[new_at + j].tolist() if 0 <= i <= pos]
                ref[new_at + j] = attend(q64[j: j + 1], k[idx], v[idx], scale=spec.scale,
                                         causal=False)[0]
        ctx_at += c
        new_at += qn
    return ref


def check_no_slot_mapping(backend: AnyBackend) -> list[str]:
    meta_cls = backend.get_metadata_cls()
    names = {f.name for f in dataclasses.fields(meta_cls)} if dataclasses.is_dataclass(meta_cls) \
        else set(vars(meta_cls))
    if "slot_mapping" in names or hasattr(meta_cls, "slot_mapping"):
        return [f"{backend.name}: {meta_cls.__name__} has a slot_mapping field"]
    return []


def check_mla_config(backend: AnyBackend, cfg: MLACheckConfig, *, seed: int = 0) -> list[str]:
    """Failures of one configuration (empty: it conforms)."""
    gen = torch.Generator().manual_seed(seed)
    try:
        return check_mla_write(backend, cfg, gen) + check_mla_compute(backend, cfg, gen)
    except Exception as exc:  # a crash is a failure of this config, reported with its cause
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return [f"{cfg.id}: raised {tb}"]


def check_mla_backend(backend: AnyBackend, device: str | torch.device = "cpu", *,
                      seed: int = 0, thorough: bool = False) -> list[str]:
    """Every failure of ``backend`` on ``device`` over its grid (empty: it conforms)."""
    if not backend.is_mla:
        return [f"{backend.name}: is_mla=False, not an MLA backend"]
    failures = check_no_slot_mapping(backend)
    for i, cfg in enumerate(mla_conformance_grid(backend, device, thorough=thorough)):
        failures.extend(check_mla_config(backend, cfg, seed=seed + i))
    return failures
