"""Paged-attention test cases: caches filled by indexing written out here, per
layout, and the float64 dense reference over the dequantised K/V.

The stored values are generated directly in the storage format (model dtype, fp8,
int8 + float32 scale), so the reference's dequantisation is
``float64(stored) * scale`` with no quantiser involved. Slots no request owns are
poisoned with NaN, so reading outside a request's positions shows up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from vllm.attention.batch import PagedBatch, make_paged_batch
from vllm.attention.layouts import empty_in_stride_order, kv_cache_shape, kv_cache_stride_order
from vllm.attention.ops.paged_attention import attend_masked, tree_visibility
from vllm.attention.ops.paged_kv import PagedKV
from vllm.attention.ops.reference import attend
from vllm.attention.types import KVCacheDType, KVCacheLayout, KVQuant

L = KVCacheLayout

TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}
"""Relative Frobenius error ``|out - ref| / |ref|`` allowed per query dtype."""

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

STORAGE: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8_per_token_head": torch.int8,
    "fp8_per_token_head": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class Case:
    """One configuration: layout, cache format, shapes, batch and options."""

    layout: KVCacheLayout = L.SPLIT_NHD
    cache_dtype: KVCacheDType = "auto"
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    num_kv_heads: int = 2
    group: int = 4
    head_size: int = 32
    head_size_v: int | None = None
    query_lens: tuple[int, ...] = (1, 7, 1, 19, 3)
    context_lens: tuple[int, ...] = (0, 26, 47, 13, 30)
    causal: bool = True
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    per_head_scale: bool = False
    tree: bool = False
    seed: int = 0
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def dv(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size)

    def id(self) -> str:
        parts = [self.layout.value, self.cache_dtype, DTYPE_IDS[self.dtype], f"bs{self.block_size}",
                 f"g{self.group}", f"d{self.head_size}"]
        if self.head_size_v is not None:
            parts.append(f"dv{self.head_size_v}")
        if self.sliding_window is not None:
            parts.append(f"win{self.sliding_window}")
        if self.logits_soft_cap is not None:
            parts.append(f"cap{self.logits_soft_cap:g}")
        if self.per_head_scale:
            parts.append("headscale")
        if self.tree:
            parts.append("tree")
        if not self.causal:
            parts.append("noncausal")
        return "-".join(parts)

    def with_(self, **changes: object) -> Case:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass
class Built:
    """A filled cache, the query, and the float64 reference output."""

    case: Case
    batch: PagedBatch
    query: torch.Tensor
    kv_cache: torch.Tensor
    quant: KVQuant
    kv: PagedKV
    tree_mask: torch.Tensor | None
    reference: torch.Tensor
    """``[num_tokens, num_heads, Dv]`` float64."""
    keys: list[torch.Tensor] = field(default_factory=list)
    """Per request, the dequantised K ``[seq_len, H, D]`` in float64."""
    values: list[torch.Tensor] = field(default_factory=list)

    def new_output(self) -> torch.Tensor:
        """An output buffer filled with NaN (every element must be overwritten)."""
        out = torch.empty(self.query.shape[0], self.case.num_heads, self.case.dv,
                          dtype=self.case.dtype, device=self.query.device)
        return out.fill_(float("nan"))


def _allocate(case: Case, num_blocks: int, device: torch.device) -> torch.Tensor:
    d_total = case.head_size + case.dv if case.layout is L.DIFFKV_PACKED else case.head_size
    shape = kv_cache_shape(case.layout, num_blocks, case.block_size, case.num_kv_heads, d_total)
    order = kv_cache_stride_order(case.layout)
    if case.layout is L.PER_TOKEN_HEAD_QUANT:
        storage = torch.uint8
    elif case.cache_dtype == "auto":
        storage = case.dtype
    else:
        storage = STORAGE[case.cache_dtype]
    cache = empty_in_stride_order(shape, order, dtype=storage, device=device)
    # Poison: NaN in every float format (0xFF is NaN as fp8 E4M3 and as float32).
    if storage == torch.uint8:
        cache.fill_(0xFF)
    elif storage == torch.float8_e5m2:
        cache.view(torch.uint8).fill_(0xFF)  # E5M2 0xFF is NaN
    elif storage == torch.float8_e4m3fn:
        cache.view(torch.uint8).fill_(0x7F)
    else:
        cache.fill_(float("nan"))
    return cache


def _random_stored(case: Case, n: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows ``[n, H, d]`` in the storage format, and per-(row, head) scales ``[n, H]``
    (ones unless per-token-head)."""
    h = case.num_kv_heads
    scales = torch.ones(n, h)
    if case.cache_dtype == "auto":
        return torch.randn(n, h, d, generator=g).to(case.dtype), scales
    storage = STORAGE[case.cache_dtype]
    if storage == torch.int8:
        vals = torch.randint(-127, 128, (n, h, d), generator=g, dtype=torch.int8)
        vals[vals == 0] = 1  # never zeros
        return vals, torch.rand(n, h, generator=g) * 0.02 + 0.005
    x = torch.randn(n, h, d, generator=g) * 3.0
    stored = x.to(storage)
    if case.layout is L.PER_TOKEN_HEAD_QUANT:
        scales = torch.rand(n, h, generator=g) * 0.5 + 0.25
    return stored, scales


def lay_first_two(layout: KVCacheLayout) -> bool:
    return layout in (L.SPLIT_KV_FIRST, L.AITER_SHUFFLED, L.LEGACY_PAGED)


def _place(case: Case, cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> None:
    """Write stored rows ``[N, H, D]`` at (block, offset), by each layout's definition."""
    nb = cache.shape[1] if lay_first_two(case.layout) else cache.shape[0]
    h, d, dv, bs = case.num_kv_heads, case.head_size, case.dv, case.block_size
    n = k.shape[0]
    lay = case.layout
    if lay in (L.SPLIT_NHD, L.SPLIT_HND, L.SPLIT_BLOCK_INTERLEAVED):
        cache[blk, 0, off] = k
        cache[blk, 1, off] = v
    elif lay is L.SPLIT_KV_FIRST:
        cache[0, blk, off] = k
        cache[1, blk, off] = v
    elif lay is L.DIFFKV_PACKED:
        cache[blk, off, :, :d] = k
        cache[blk, off, :, d:] = v
    elif lay is L.LEGACY_PAGED:
        x = 16 // cache.element_size()
        k5 = cache[0].view(nb, h, d // x, bs, x)
        k5[blk, :, :, off, :] = k.reshape(n, h, d // x, x)
        v4 = cache[1].view(nb, h, dv, bs)
        v4[blk, :, :, off] = v
    elif lay is L.AITER_SHUFFLED:
        x = 16 // cache.element_size()
        flat_k = cache[0].reshape(-1)
        flat_v = cache[1].reshape(-1)
        # element (b, t, h, d) of K at b*bs*H*D + h*(D/x)*bs*x + (d//x)*bs*x + t*x + d%x
        dd = torch.arange(d)
        hh = torch.arange(h)
        base = (blk * bs * h * d)[:, None, None] + (hh * d * bs)[None, :, None]
        k_idx = base + ((dd // x) * bs * x)[None, None, :] + (off * x)[:, None, None] + (dd % x)[None, None, :]
        flat_k[k_idx.reshape(-1)] = k.reshape(-1)
        # V (b, t, h, d) at b*bs*H*D + h*bs*D + (t//x)*D*x + d*x + t%x
        dd = torch.arange(dv)
        v_idx = ((blk * bs * h * dv)[:, None, None] + (hh * bs * dv)[None, :, None]
                 + ((off // x) * dv * x + off % x)[:, None, None] + (dd * x)[None, None, :])
        flat_v[v_idx.reshape(-1)] = v.reshape(-1)
    elif lay is L.PER_TOKEN_HEAD_QUANT:
        for i, (rows, sc) in enumerate(((k, ks), (v, vs))):
            cache[blk, i, off, :, :d] = rows.contiguous().view(torch.uint8)
            cache[blk, i, off, :, d:] = sc.to(torch.float32).contiguous().view(torch.uint8).view(n, h, 4)
    else:
        raise AssertionError(lay)


def build(case: Case, device: torch.device | str = "cpu") -> Built:
    """Fill a cache for ``case`` and compute the float64 reference."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(case.seed)
    batch = make_paged_batch(case.query_lens, case.context_lens, block_size=case.block_size,
                             generator=g, causal=case.causal)
    cache = _allocate(case, batch.num_blocks, torch.device("cpu"))
    table = batch.common.block_table
    lens = [q + c for q, c in zip(case.query_lens, case.context_lens)]
    h = case.num_kv_heads
    if case.cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        n_sc = h if case.per_head_scale else 1
        k_scale = torch.rand(n_sc, generator=g) * 0.5 + 0.5
        v_scale = torch.rand(n_sc, generator=g) * 0.5 + 0.5
    else:
        k_scale = torch.ones(1)
        v_scale = torch.ones(1)
    quant = KVQuant(case.cache_dtype, k_scale, v_scale)

    q = torch.randn(sum(case.query_lens), case.num_heads, case.head_size, generator=g).to(case.dtype)
    masks: list[torch.Tensor | None] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    ref = torch.empty(q.shape[0], case.num_heads, case.dv, dtype=torch.float64)
    qs = 0
    for i, length in enumerate(lens):
        pos = torch.arange(length)
        blk = table[i, pos // case.block_size].long()
        off = pos % case.block_size
        k, ks = _random_stored(case, length, case.head_size, g)
        v, vs = _random_stored(case, length, case.dv, g)
        _place(case, cache, blk, off, k, v, ks, vs)
        k64 = k.double() * ks.double().unsqueeze(-1) * k_scale.double().view(1, -1, 1)
        v64 = v.double() * vs.double().unsqueeze(-1) * v_scale.double().view(1, -1, 1)
        keys.append(k64)
        values.append(v64)
        ql = case.query_lens[i]
        q64 = q[qs: qs + ql].double()
        if case.tree and ql <= TREE_MAX:
            mask = _random_tree(ql, g)
            masks.append(mask)
            ref[qs: qs + ql] = attend_masked(q64, k64, v64, tree_visibility(mask, length),
                                             scale=case.scale, logits_soft_cap=case.logits_soft_cap)
        else:
            masks.append(None)
            ref[qs: qs + ql] = attend(q64, k64, v64, scale=case.scale, causal=case.causal,
                                      sliding_window=case.sliding_window,
                                      logits_soft_cap=case.logits_soft_cap)
        qs += ql
    tree_mask = None
    if case.tree:
        from vllm.attention.ops.paged_attention import pack_tree_masks

        tree_mask = pack_tree_masks(masks, case.query_lens, device=dev)
    cache = cache.to(dev)
    if dev.type != "cpu":
        batch = make_paged_batch(case.query_lens, case.context_lens, block_size=case.block_size,
                                 generator=torch.Generator().manual_seed(case.seed),
                                 causal=case.causal, device=dev)
        assert torch.equal(batch.common.block_table.cpu(), table)
    quant = KVQuant(case.cache_dtype, k_scale.to(dev), v_scale.to(dev))
    kv = PagedKV.from_cache(cache, case.layout, quant, block_size=case.block_size,
                            num_kv_heads=h, head_size=case.head_size, head_size_v=case.head_size_v)
    return Built(case, batch, q.to(dev), cache, quant, kv, tree_mask, ref, keys, values)


TREE_MAX = 8
"""Tree cases give requests with at most this many queries a draft tree, others causal."""


def layout_cases() -> list[Case]:
    """Each layout with each cache format it stores (fp32 queries, GQA 4, bs 16)."""
    fp8 = ("fp8_e4m3", "fp8_e5m2")
    cases = [Case(L.SPLIT_NHD, "auto")]
    cases += [Case(L.SPLIT_NHD, dt) for dt in fp8]
    cases += [Case(L.SPLIT_NHD, dt, per_head_scale=True) for dt in fp8]
    for lay in (L.SPLIT_HND, L.SPLIT_KV_FIRST, L.SPLIT_BLOCK_INTERLEAVED, L.LEGACY_PAGED,
                L.AITER_SHUFFLED):
        cases += [Case(lay, "auto"), Case(lay, "fp8_e4m3", per_head_scale=True),
                  Case(lay, "fp8_e5m2")]
    cases += [Case(L.DIFFKV_PACKED, "auto", head_size=32, head_size_v=16),
              Case(L.DIFFKV_PACKED, "auto", head_size=16, head_size_v=48),
              Case(L.DIFFKV_PACKED, "fp8_e4m3", head_size=32, head_size_v=16)]
    cases += [Case(L.PER_TOKEN_HEAD_QUANT, "int8_per_token_head"),
              Case(L.PER_TOKEN_HEAD_QUANT, "fp8_per_token_head")]
    return cases


def shape_cases() -> list[Case]:
    """GQA ratios 1, 4, 8 x block sizes 16, 32, 64, on a plain and an x-split layout."""
    return [Case(lay, "auto", group=g, block_size=bs, num_kv_heads=2 if g < 8 else 1,
                 context_lens=(0, 26, 47, 70, 30), seed=g * 100 + bs)
            for lay in (L.SPLIT_NHD, L.LEGACY_PAGED) for g in (1, 4, 8) for bs in (16, 32, 64)]


def option_cases() -> list[Case]:
    """Sliding window, soft cap, 16-bit dtypes, non-causal and tree masks."""
    cases: list[Case] = []
    for lay in (L.SPLIT_NHD, L.SPLIT_HND, L.LEGACY_PAGED, L.AITER_SHUFFLED,
                L.PER_TOKEN_HEAD_QUANT):
        dt: KVCacheDType = "int8_per_token_head" if lay is L.PER_TOKEN_HEAD_QUANT else "auto"
        cases += [Case(lay, dt, sliding_window=8), Case(lay, dt, sliding_window=20, block_size=32),
                  Case(lay, dt, logits_soft_cap=5.0),
                  Case(lay, dt, sliding_window=17, logits_soft_cap=2.0, group=8, num_kv_heads=1)]
    for dtype in (torch.float16, torch.bfloat16):
        cases += [Case(L.SPLIT_NHD, "auto", dtype=dtype), Case(L.SPLIT_NHD, "fp8_e4m3", dtype=dtype),
                  Case(L.LEGACY_PAGED, "auto", dtype=dtype), Case(L.AITER_SHUFFLED, "fp8_e4m3", dtype=dtype),
                  Case(L.PER_TOKEN_HEAD_QUANT, "fp8_per_token_head", dtype=dtype),
                  Case(L.DIFFKV_PACKED, "auto", dtype=dtype, head_size=32, head_size_v=16),
                  Case(L.SPLIT_KV_FIRST, "auto", dtype=dtype, sliding_window=12, logits_soft_cap=4.0)]
    cases += [Case(L.SPLIT_NHD, "auto", causal=False), Case(L.SPLIT_BLOCK_INTERLEAVED, "auto", causal=False)]
    tree = Case(L.SPLIT_KV_FIRST, "auto", tree=True, query_lens=(4, 1, 7, 12, 5),
                context_lens=(20, 33, 0, 9, 16))
    cases += [tree, tree.with_(dtype=torch.bfloat16),
              tree.with_(layout=L.LEGACY_PAGED, cache_dtype="fp8_e4m3", logits_soft_cap=3.0)]
    return cases


def _random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    """``[n, n]`` ancestor mask of a random tree whose parents precede children."""
    from vllm.attention.ops.paged_attention import tree_ancestor_mask

    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return tree_ancestor_mask(parents)


@dataclass(frozen=True)
class CrossBatch:
    """A batch whose queries are not the keys' last positions (cross-attention):
    ``seq_lens`` may be shorter than the query lengths. Satisfies ``PagedBatchLike``."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    max_query_len: int
    max_seq_len: int


def cross_attention_case(
    device: torch.device | str = "cpu",
    query_lens: tuple[int, ...] = (9, 3, 1),
    layout: KVCacheLayout = L.SPLIT_NHD,
) -> tuple[Built, CrossBatch, torch.Tensor, torch.Tensor]:
    """Encoder K/V of lengths 5, 17, 40 in the cache, decoder queries of ``query_lens``.
    Returns the built cache, the batch, the queries and the float64 reference."""
    b = build(Case(layout, causal=False, query_lens=(1, 1, 1), context_lens=(4, 16, 39)), device)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(sum(query_lens), b.case.num_heads, b.case.head_size, generator=g)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    common = b.batch.common
    batch = CrossBatch(qsl.to(device), common.seq_lens, common.block_table, qsl, common.seq_lens_cpu,
                       len(query_lens), max(query_lens), common.max_seq_len)
    ref = torch.cat([attend(q[int(qsl[i]):int(qsl[i + 1])].double(), b.keys[i], b.values[i],
                            scale=b.case.scale, causal=False) for i in range(len(query_lens))])
    return b, batch, q.to(device), ref


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())
