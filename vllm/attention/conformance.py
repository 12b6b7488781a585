"""The conformance kit: what every backend must satisfy, for tests and the CLI.

For each configuration derived from the backend's declarations:

1. **write exact**: the backend's writer (through an :class:`Attention` layer, so
   the adapter's bound writers are covered) leaves the cache byte-identical to the
   layout's torch reference writer applied to a copy -- which also proves nothing
   outside the named slots changed (the cache starts as random bytes);
2. **write vs TORCH_REF**: the stored rows equal those TORCH_REF's writer stores
   (for cache formats TORCH_REF has);
3. **compute**: a mixed prefill/decode batch whose contexts cross block
   boundaries is within the backend's tolerance of a float64 dense reference
   over the dequantised cached K/V, and every output element is written;
4. **compute is read-only**: the cache bytes are unchanged by ``impl.forward``.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.attention.backend import (
    AttentionBackend,
    allocate_kv_cache,
    block_axis,
    dtype_name,
)
from vllm.attention.batch import PagedBatch, make_paged_batch
from vllm.attention.errors import AttentionError
from vllm.attention.layer import Attention
from vllm.attention.ops.reference import attend
from vllm.attention.types import AttentionType, KVCacheDType, KVCacheLayout
from vllm.attention.writers.readback import read_slots, reference_write
from vllm.forward_context import set_forward_context

AnyBackend = type[AttentionBackend[Any]]

@dataclass
class Report:
    """Outcome of :func:`check_backend`. ``ok`` iff ``failures`` is empty."""

    backend: str
    device: str
    compute_path: str = ""
    writer_path: str = ""
    passed: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass(frozen=True)
class CheckConfig:
    """One point of a backend's conformance grid."""

    backend: str
    device: str
    dtype: torch.dtype
    cache_dtype: KVCacheDType
    block_size: int
    head_size: int
    head_size_v: int | None
    num_heads: int
    num_kv_heads: int
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    attn_type: AttentionType = AttentionType.DECODER
    per_head_scale: bool = False

    @property
    def id(self) -> str:
        parts = [self.backend, self.device, dtype_name(self.dtype), self.cache_dtype,
                 f"bs{self.block_size}", f"gqa{self.num_heads // self.num_kv_heads}"]
        if self.sliding_window is not None:
            parts.append(f"sw{self.sliding_window}")
        if self.logits_soft_cap is not None:
            parts.append("softcap")
        if self.attn_type is not AttentionType.DECODER:
            parts.append(self.attn_type.value)
        if self.per_head_scale:
            parts.append("scale_per_head")
        return "-".join(parts)


def _pick_head_size(backend: AnyBackend) -> int:
    for d in (64, 128, 32, 96, 256, 16, 8):
        if backend.head_sizes.admits(d):
            return d
    return min(backend.head_sizes.examples((8, 16, 32, 64, 128, 256, 512)) or (64,))


def conformance_grid(backend: AnyBackend, device: str = "cpu", *,
                     thorough: bool = False) -> list[CheckConfig]:
    """The configurations the kit runs, derived from the backend's declarations."""
    dev = torch.device(device)
    head = _pick_head_size(backend)
    head_v = head // 2 if getattr(backend, "distinct_v_head_size", False) else None
    dtypes = [d for d in (torch.float32, torch.bfloat16, torch.float16)
              if d in backend.supported_dtypes]
    if dev.type == "cuda":
        dtypes = [d for d in dtypes if d != torch.float32] or dtypes
    block_sizes = backend.block_sizes.examples((16, 32, 64, 128, 1))
    if not thorough:
        block_sizes = block_sizes[:1] + block_sizes[-1:] if len(block_sizes) > 1 else block_sizes
    cache_dtypes = sorted(backend.supported_kv_cache_dtypes,
                          key=lambda c: (c != "auto", c))
    base: list[CheckConfig] = []
    for dt in dtypes:
        for cd in cache_dtypes:
            for bs in block_sizes:
                base.append(CheckConfig(backend.name, dev.type, dt, cd, bs, head, head_v,
                                        num_heads=8, num_kv_heads=2,
                                        per_head_scale=cd != "auto"))
    first = base[0]
    extra = [CheckConfig(backend.name, dev.type, first.dtype, "auto", first.block_size, head,
                         head_v, num_heads=h, num_kv_heads=kv)
             for h, kv in ((4, 4), (8, 1)) if thorough or h != 4]
    if backend.supports_sliding_window:
        extra.append(CheckConfig(backend.name, dev.type, first.dtype, "auto", first.block_size,
                                 head, head_v, 8, 2, sliding_window=21))
    if backend.supports_logits_soft_cap:
        extra.append(CheckConfig(backend.name, dev.type, first.dtype, "auto", first.block_size,
                                 head, head_v, 8, 2, logits_soft_cap=7.5))
    if AttentionType.ENCODER in backend.attention_types:
        extra.append(CheckConfig(backend.name, dev.type, first.dtype, "auto", first.block_size,
                                 head, head_v, 8, 2, attn_type=AttentionType.ENCODER))
    return base + extra


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage as a 1-D uint8 tensor (shares memory)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _random_cache(backend: AnyBackend, cfg: CheckConfig, num_blocks: int,
                  gen: torch.Generator) -> torch.Tensor:
    head = cfg.head_size + (cfg.head_size_v or 0)
    cache = allocate_kv_cache(
        backend, num_blocks=num_blocks, block_size=cfg.block_size,
        num_kv_heads=cfg.num_kv_heads, head_size=head, cache_dtype=cfg.cache_dtype,
        model_dtype=cfg.dtype, device=cfg.device,
    )
    raw = raw_bytes(cache)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    null_block(backend, cache).zero_()
    return cache


def null_block(backend: AnyBackend, cache: torch.Tensor) -> torch.Tensor:
    """Block 0 of ``cache`` (a view): the null block, zeroed and never in a block table,
    as vLLM reserves it (legacy backends may read it for padded block-table entries)."""
    return cache.select(block_axis(backend), 0)


def _same_layout_copy(cache: torch.Tensor) -> torch.Tensor:
    clone = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype,
                                device=cache.device)
    raw_bytes(clone).copy_(raw_bytes(cache))
    return clone


def _quant(cfg: CheckConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = cfg.num_kv_heads if cfg.per_head_scale else 1
    k = (torch.rand(n, generator=gen) * 0.5 + 0.5).to(torch.float32)
    v = (torch.rand(n, generator=gen) * 0.5 + 0.5).to(torch.float32)
    return k, v


def _make_layer(backend: AnyBackend, cfg: CheckConfig, gen: torch.Generator) -> Attention:
    k_scale, v_scale = _quant(cfg, gen)
    layer = Attention(
        num_heads=cfg.num_heads, head_size=cfg.head_size, num_kv_heads=cfg.num_kv_heads,
        head_size_v=cfg.head_size_v, scale=cfg.head_size ** -0.5, backend=backend,
        layer_name="conformance.attn", kv_cache_dtype=cfg.cache_dtype,
        sliding_window=cfg.sliding_window, logits_soft_cap=cfg.logits_soft_cap,
        attn_type=cfg.attn_type, k_scale=k_scale, v_scale=v_scale,
    )
    return layer.to(cfg.device)


def _randn(shape: tuple[int, ...], cfg: CheckConfig, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(cfg.dtype).to(cfg.device)


def _check_write(backend: AnyBackend, cfg: CheckConfig, gen: torch.Generator) -> list[str]:
    failures: list[str] = []
    num_blocks = 5
    cache = _random_cache(backend, cfg, num_blocks, gen)
    layer = _make_layer(backend, cfg, gen)
    layer.bind_kv_cache(cache, cfg.block_size)
    num_slots = num_blocks * cfg.block_size
    n = min(num_slots - 1, 23)
    slots = padded_slots(torch.randperm(num_slots, generator=gen)[:n].to(torch.int64), gen,
                         cfg.device)
    dv = cfg.head_size_v or cfg.head_size
    key = _randn((slots.shape[0] + 3, cfg.num_kv_heads, cfg.head_size), cfg, gen)
    value = _randn((slots.shape[0] + 3, cfg.num_kv_heads, dv), cfg, gen)
    expected = _same_layout_copy(cache)
    layer.kv_cache_writer.write(key, value, cache, slots, layer.kv_quant)
    layout = backend.kv_cache_layout_for(cfg.cache_dtype)
    reference_write(layout, key, value, expected, slots, layer.kv_quant)
    if not torch.equal(raw_bytes(cache), raw_bytes(expected)):
        diff = int((raw_bytes(cache) != raw_bytes(expected)).sum().item())
        failures.append(f"{cfg.id} write: {diff} byte(s) differ from the "
                        f"{layout.value} reference writer")
    ref_backend = _torch_ref()
    if (cfg.cache_dtype in ref_backend.supported_kv_cache_dtypes and cfg.head_size_v is None
            and cfg.cache_dtype != "fp8"):
        ref_cache = _random_cache(ref_backend, cfg, num_blocks, gen)
        ref_backend.get_kv_cache_writer(cfg.cache_dtype).write(
            key, value, ref_cache, slots, layer.kv_quant)
        valid = slots[slots >= 0]
        got = read_slots(layout, cache, valid, num_kv_heads=cfg.num_kv_heads,
                         head_size=cfg.head_size)
        want = read_slots(ref_backend.kv_cache_layout, ref_cache, valid)
        for name, g, w in zip(("K", "V"), got, want):
            if not torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
                failures.append(f"{cfg.id} write: stored {name} rows differ from TORCH_REF's")
    return failures


PAD_ROWS = 3
"""Slots of -1 past the real tokens: vLLM pads a CUDA-graph step's slot mapping so."""


def padded_slots(slots: torch.Tensor, gen: torch.Generator, device: str) -> torch.Tensor:
    """``slots`` (int64 ``[T]``) with about a fifth of the tokens set to -1 (skipped:
    DCP, rejected drafts) and :data:`PAD_ROWS` -1 entries appended (padding)."""
    slots = slots.clone()
    slots[torch.rand(slots.shape[0], generator=gen) < 0.2] = -1
    return torch.cat([slots, torch.full((PAD_ROWS,), -1, dtype=torch.int64)]).to(device)


def _diff_slots(layout: KVCacheLayout, got: torch.Tensor, want: torch.Tensor, num_slots: int,
                cfg: CheckConfig) -> list[int]:
    """The slots whose stored rows differ between two caches of one layout."""
    every = torch.arange(num_slots, dtype=torch.int64, device=got.device)
    kw: dict[str, Any] = dict(num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size,
                              head_size_v=cfg.head_size_v)
    differ = torch.zeros(num_slots, dtype=torch.bool)
    for g, w in zip(read_slots(layout, got, every, **kw), read_slots(layout, want, every, **kw)):
        g8 = g.contiguous().view(torch.uint8).reshape(num_slots, -1).cpu()
        w8 = w.contiguous().view(torch.uint8).reshape(num_slots, -1).cpu()
        differ |= (g8 != w8).any(dim=1)
    return [int(i) for i in differ.nonzero().flatten()]


def _check_legacy_write(backend: AnyBackend, cfg: CheckConfig,
                        gen: torch.Generator) -> list[str]:
    """What a fused legacy backend's own ``forward`` writes, against the reference writer,
    for a prefill + decode step whose slot mapping holds -1 among the real tokens and
    -1 padding past them. A -1 slot written anywhere is named."""
    bs = cfg.block_size
    batch = make_paged_batch([bs + 3, 1, 2], [0, bs + 1, 3], block_size=bs,
                             device=cfg.device, generator=gen)
    # one block past the batch's: a -1 slot that wraps lands in a block no request owns
    num_blocks = batch.num_blocks + 1
    cache = _random_cache(backend, cfg, num_blocks, gen)
    layer = _make_layer(backend, cfg, gen)
    layer.bind_kv_cache(cache, bs)
    slots = padded_slots(batch.new_slots.cpu(), gen, cfg.device)
    rows = slots.shape[0]
    dv = cfg.head_size_v or cfg.head_size
    key = _randn((rows, cfg.num_kv_heads, cfg.head_size), cfg, gen)
    value = _randn((rows, cfg.num_kv_heads, dv), cfg, gen)
    q = _randn((rows, cfg.num_heads, cfg.head_size), cfg, gen)
    meta = backend.get_builder_cls()(layer.spec, torch.device(cfg.device)).build(batch.common)
    expected = _same_layout_copy(cache)
    layout = backend.kv_cache_layout_for(cfg.cache_dtype)
    reference_write(layout, key, value, expected, slots, layer.kv_quant)
    out = torch.zeros((rows, cfg.num_heads, dv), dtype=cfg.dtype, device=cfg.device)
    name = layer.layer_name
    with set_forward_context(attn_metadata={name: meta}, slot_mapping={name: slots}):
        layer.impl.forward(layer, q, key, value, cache, meta, out)
    if torch.equal(raw_bytes(cache), raw_bytes(expected)):
        return []
    num_slots = num_blocks * bs
    valid = set(int(s) for s in slots.tolist() if s >= 0)
    failures = []
    for slot in _diff_slots(layout, cache, expected, num_slots, cfg):
        where = f"slot {slot} (block {slot // bs}, offset {slot % bs})"
        if slot in valid:
            failures.append(f"{cfg.id} legacy write: {where} differs from what the reference "
                            "writer stores for its token")
        else:
            failures.append(f"{cfg.id} legacy write: forward() wrote {where}, which no token "
                            "maps to: a -1 (padding or skipped) slot written there?")
    return failures or [f"{cfg.id} legacy write: the cache bytes differ from the reference "
                        "writer's outside every slot's rows"]


def exercised_features(cfg: CheckConfig) -> str:
    """What a configuration exercises beyond the plainest case, each with the declaration
    by which a backend without it opts out (so a failure points at its cause)."""
    parts: list[str] = []
    if cfg.sliding_window is not None:
        parts.append(f"sliding_window={cfg.sliding_window} (a backend without it declares "
                     "supports_sliding_window = False)")
    if cfg.logits_soft_cap is not None:
        parts.append(f"logits_soft_cap={cfg.logits_soft_cap} (a backend without it declares "
                     "supports_logits_soft_cap = False)")
    if cfg.attn_type is not AttentionType.DECODER:
        parts.append(f"attn_type={cfg.attn_type.value}, bidirectional (a backend without it "
                     f"leaves AttentionType.{cfg.attn_type.name} out of attention_types)")
    if cfg.cache_dtype != "auto":
        scales = "per-kv-head" if cfg.per_head_scale else "per-tensor"
        parts.append(f"kv_cache_dtype={cfg.cache_dtype!r} with {scales} scales (a backend "
                     f"without it leaves {cfg.cache_dtype!r} out of supported_kv_cache_dtypes)")
    group = cfg.num_heads // cfg.num_kv_heads
    if group > 1:
        kind = "MQA" if cfg.num_kv_heads == 1 else "GQA"
        parts.append(f"{kind}: {group} query heads per kv head (num_heads={cfg.num_heads}, "
                     f"num_kv_heads={cfg.num_kv_heads}; every backend must support it)")
    if cfg.head_size_v is not None:
        parts.append(f"head_size_v={cfg.head_size_v} != head_size={cfg.head_size} "
                     "(distinct_v_head_size = True)")
    batch = ("encoder sequences of several blocks" if cfg.attn_type is AttentionType.ENCODER
             else "prefill, chunked prefill and decode requests")
    parts.append(f"dtype={dtype_name(cfg.dtype)}, block_size={cfg.block_size}, a batch of "
                 f"{batch} whose contexts cross block boundaries")
    return "the configuration exercises " + "; ".join(parts)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    denom = float(ref.norm())
    return float((out.double() - ref).norm()) / (denom if denom > 0 else 1.0)


def _compute_batch(backend: AnyBackend, cfg: CheckConfig, gen: torch.Generator
                   ) -> tuple[PagedBatch, torch.Tensor, Attention]:
    """The compute check's batch (decoder: requests with and without cached context,
    prefill and decode rows; encoder: whole sequences at once), a random cache for it and
    a layer bound to that cache."""
    bs = cfg.block_size
    causal = cfg.attn_type is AttentionType.DECODER
    query_lens, context_lens = ([bs + 3, 1, 7, 1, 2], [0, 2 * bs + 1, bs, bs - 1, 3 * bs + 5]) \
        if causal else ([bs + 3, 5, 2 * bs + 1], [0, 0, 0])
    batch = make_paged_batch(query_lens, context_lens, block_size=bs, device=cfg.device,
                             generator=gen, causal=causal)
    cache = _random_cache(backend, cfg, batch.num_blocks, gen)
    layer = _make_layer(backend, cfg, gen)
    layer.bind_kv_cache(cache, bs)
    return batch, cache, layer


def _check_compute(backend: AnyBackend, cfg: CheckConfig, gen: torch.Generator) -> list[str]:
    failures: list[str] = []
    batch, cache, layer = _compute_batch(backend, cfg, gen)
    causal = cfg.attn_type is AttentionType.DECODER
    dv = cfg.head_size_v or cfg.head_size
    n_ctx, n_new = int(batch.context_slots.numel()), int(batch.new_slots.numel())
    k_ctx = _randn((n_ctx, cfg.num_kv_heads, cfg.head_size), cfg, gen)
    v_ctx = _randn((n_ctx, cfg.num_kv_heads, dv), cfg, gen)
    k_new = _randn((n_new, cfg.num_kv_heads, cfg.head_size), cfg, gen)
    v_new = _randn((n_new, cfg.num_kv_heads, dv), cfg, gen)
    q = _randn((n_new, cfg.num_heads, cfg.head_size), cfg, gen)
    builder = backend.get_builder_cls()(layer.spec, torch.device(cfg.device))
    meta = builder.build(batch.common)
    name = layer.layer_name
    writer = layer.kv_cache_writer
    if n_ctx:
        writer.write(k_ctx, v_ctx, cache, batch.context_slots, layer.kv_quant)
    writer.write(k_new, v_new, cache, batch.new_slots, layer.kv_quant)
    before = raw_bytes(cache).clone()
    out = torch.full((n_new, cfg.num_heads, dv), math.nan, dtype=cfg.dtype, device=cfg.device)
    with set_forward_context(attn_metadata={name: meta}, slot_mapping={name: batch.new_slots}):
        result = layer.impl.forward(layer, q, k_new, v_new, cache, meta, out)
    if not torch.equal(raw_bytes(cache), before):
        failures.append(f"{cfg.id} compute: impl.forward changed the cache bytes")
    if bool(torch.isnan(result).any()):
        failures.append(f"{cfg.id} compute: output has NaN (unwritten or masked wrongly); "
                        + exercised_features(cfg))
        return failures
    # float64 reference over the dequantised cached K/V of each request
    kv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per request: q, k, v
    ctx_at = new_at = 0
    for c, qn in zip(batch.context_lens, batch.query_lens):
        slots = torch.cat([batch.context_slots[ctx_at: ctx_at + c],
                           batch.new_slots[new_at: new_at + qn]])
        k, v = read_slots(backend.kv_cache_layout_for(cfg.cache_dtype), cache, slots,
                          quant=layer.kv_quant, num_kv_heads=cfg.num_kv_heads,
                          head_size=cfg.head_size, head_size_v=cfg.head_size_v,
                          dequantize=True)
        kv.append((q[new_at: new_at + qn].double().cpu(), k.double().cpu(), v.double().cpu()))
        ctx_at += c
        new_at += qn

    def reference(causal: bool, sliding_window: int | None,
                  logits_soft_cap: float | None) -> torch.Tensor:
        return torch.cat([attend(qr, k, v, scale=layer.spec.scale, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
                          for qr, k, v in kv])

    tol = backend.tolerances[cfg.dtype]
    got = result.cpu()
    err = _rel_err(got, reference(causal, cfg.sliding_window, cfg.logits_soft_cap))
    if not err <= tol:
        message = (f"{cfg.id} compute: relative error {err:.2e} > tolerance {tol:.0e}; "
                   + exercised_features(cfg))
        # An impl that ignores an option matches the reference without it: say which.
        without: list[tuple[str, bool, int | None, float | None]] = []
        if cfg.sliding_window is not None:
            without.append((f"sliding_window={cfg.sliding_window}", causal, None,
                            cfg.logits_soft_cap))
        if cfg.logits_soft_cap is not None:
            without.append((f"logits_soft_cap={cfg.logits_soft_cap}", causal,
                            cfg.sliding_window, None))
        if not causal:
            without.append((f"attn_type={cfg.attn_type.value} (bidirectional)", True,
                            cfg.sliding_window, cfg.logits_soft_cap))
        for feature, causal_w, window_w, cap_w in without:
            err_without = _rel_err(got, reference(causal_w, window_w, cap_w))
            if err_without <= tol:
                message += (f"; the output matches attention without {feature} (relative "
                            f"error {err_without:.2e}): the impl ignores it")
        failures.append(message)
    return failures


@dataclass(frozen=True)
class StepResult:
    """What one configuration's layer step leaves behind, to compare two backends."""

    cache: torch.Tensor
    """Every byte of the cache after the step: uint8, on the host."""
    output: torch.Tensor
    """The layer's output ``[num_tokens, num_heads, head_size_v]``, on the host."""


def run_layer_step(backend: AnyBackend, cfg: CheckConfig, *, seed: int = 0) -> StepResult:
    """The compute check's batch as a runner drives it: the context written through the
    layer's writer, then one :class:`Attention` call (write, then compute) for the new
    tokens. The inputs and the starting cache bytes depend only on ``cfg``, ``seed`` and
    the backend's cache shape, so two backends of one layout get identical steps (the
    adapted original and its migration, for ``vllm-attn migrate --check``)."""
    gen = torch.Generator().manual_seed(seed)
    batch, cache, layer = _compute_batch(backend, cfg, gen)
    dv = cfg.head_size_v or cfg.head_size
    n_ctx, n_new = int(batch.context_slots.numel()), int(batch.new_slots.numel())
    if n_ctx:
        layer.kv_cache_writer.write(_randn((n_ctx, cfg.num_kv_heads, cfg.head_size), cfg, gen),
                                    _randn((n_ctx, cfg.num_kv_heads, dv), cfg, gen), cache,
                                    batch.context_slots, layer.kv_quant)
    q = _randn((n_new, cfg.num_heads, cfg.head_size), cfg, gen)
    k = _randn((n_new, cfg.num_kv_heads, cfg.head_size), cfg, gen)
    v = _randn((n_new, cfg.num_kv_heads, dv), cfg, gen)
    meta = backend.get_builder_cls()(layer.spec, torch.device(cfg.device)).build(batch.common)
    name = layer.layer_name
    with set_forward_context(attn_metadata={name: meta}, slot_mapping={name: batch.new_slots}):
        out = layer(q, k, v)
    return StepResult(cache=raw_bytes(cache).cpu().clone(), output=out.cpu())


def _torch_ref() -> AnyBackend:
    from vllm.attention.backends.torch_ref import TorchRefBackend

    return TorchRefBackend


def check_config(backend: AnyBackend, cfg: CheckConfig, *, seed: int = 0) -> list[str]:
    """Failures of one configuration (empty: it conforms)."""
    gen = torch.Generator().manual_seed(seed)
    fused_legacy = getattr(getattr(backend, "legacy_generation", None), "value", None) == "fused"
    try:
        failures = _check_write(backend, cfg, gen) + _check_compute(backend, cfg, gen)
        if fused_legacy and cfg.attn_type is AttentionType.DECODER:
            failures += _check_legacy_write(backend, cfg, gen)
        return failures
    except Exception as exc:  # a crash is a failure of this config, reported with its cause
        return [f"{cfg.id}: raised {_one_line(exc)}"]


def _one_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def check_backend(backend: AnyBackend | str, device: str | torch.device = "cpu", *,
                  seed: int = 0, thorough: bool = False,
                  max_configs: int | None = None) -> Report:
    """Run the kit on ``backend`` (a class, registered name or ``module:Class``).

    ``max_configs`` runs only the first configurations of the grid (quick checks).
    """
    from vllm.attention.registry import get_backend

    cls = get_backend(backend) if isinstance(backend, str) else backend
    dev = torch.device(device)
    declared_name = getattr(cls, "name", None)
    name = declared_name if isinstance(declared_name, str) else cls.__qualname__
    report = Report(backend=name, device=str(dev))
    problems = cls.declaration_problems()
    if problems:  # nothing below can be trusted to run on such a class
        report.failures.extend(f"{name} is declared wrongly: {p}" for p in problems)
        return report
    try:
        report.compute_path = cls.compute_path(dev)
        blockers = cls.device_unsupported_reasons(dev)
        if blockers:
            report.skipped.append(f"{cls.name} on {dev}: " + "; ".join(blockers))
            return report
        writer = cls.get_kv_cache_writer("auto")
    except Exception as exc:  # a plugin's own hook failing is that backend's failure
        report.failures.append(f"{name}: raised {_one_line(exc)}")
        return report
    path = getattr(writer, "path", None)
    report.writer_path = str(path(dev)) if callable(path) else "torch"
    if cls.is_mla:
        from vllm.attention.conformance_mla import (
            check_mla_config,
            check_no_slot_mapping,
            mla_conformance_grid,
        )

        report.failures.extend(check_no_slot_mapping(cls))
        try:
            mla_grid = mla_conformance_grid(cls, dev, thorough=thorough)
        except AttentionError as exc:  # declarations the kit cannot build a grid from
            report.failures.append(str(exc))
            return report
        for i, mla_cfg in enumerate(mla_grid[:max_configs]):
            failures = check_mla_config(cls, mla_cfg, seed=seed + i)
            report.failures.extend(failures)
            if not failures:
                report.passed.append(mla_cfg.id)
        return report
    if cls.kv_cache_layout in (KVCacheLayout.MLA_LATENT, KVCacheLayout.MLA_FP8_DS):
        report.failures.append(f"{cls.name}: MLA layout but is_mla=False")
        return report
    grid = conformance_grid(cls, str(dev), thorough=thorough)
    for i, cfg in enumerate(grid[:max_configs]):
        refused = cls.unsupported_reasons(
            dtype=cfg.dtype, head_size=cfg.head_size, block_size=cfg.block_size,
            kv_cache_dtype=cfg.cache_dtype, attn_type=cfg.attn_type,
            sliding_window=cfg.sliding_window, logits_soft_cap=cfg.logits_soft_cap, device=dev)
        if refused:  # declared (or, for a legacy backend, raised by its impl) as unsupported
            report.skipped.append(f"{cfg.id}: " + "; ".join(refused))
            continue
        failures = check_config(cls, cfg, seed=seed + i)
        if failures:
            report.failures.extend(failures)
        else:
            report.passed.append(cfg.id)
    return report
