"""KV-cache writers: bandwidth of every layout's write against an eager copy.

For each layout / cache dtype and each token count (1 to 65536), times
``writer.write(...)`` (validation + launch, what a layer pays) with CUDA events over
back-to-back calls, and the prebuilt kernel launch alone replayed from a CUDA graph
(device time), and reports GB/s (bytes read + written: the K/V rows, the slot mapping
and the stored entries) and the ratio to an eager device-to-device ``copy_`` of a
>= 2 GiB bf16 tensor timed with events in the same run (not in a CUDA graph); the
``/same`` column divides the time of an eager ``copy_`` moving the same bytes (half read,
half written) by the write call's time, since a short transfer loses a larger share to
ramp-up and tail than the 2 GiB copy does. Each configuration is also checked once
against the torch reference (byte-identical cache). ``--slots``: random slots over the
whole cache (the default), a prefill's (whole pages, shuffled) or contiguous.

Run from the repository root on a CUDA machine::

    python benchmarks/bench_writers.py --out benchmarks/results/h200/<date>-<commit>

Writes ``writers.json`` under ``--out`` and prints a table. Without CUDA it runs a
tiny CPU smoke configuration (torch reference only) so the script stays runnable.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import traceback
from collections.abc import Callable
from typing import Protocol, cast
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (  # noqa: E402
    capture,
    copy_bytes,
    copy_ceiling_gbps,
    copy_us,
    event_us,
    replay_us,
)

from vllm.attention.layouts import (  # noqa: E402
    FP8_DS_MLA_ENTRY_BYTES,
    aiter_shuffled_views,
    empty_in_stride_order,
    kv_cache_shape,
    kv_cache_stride_order,
    legacy_paged_views,
    split_kv_views,
)
from vllm.attention.writers.kernels import (  # noqa: E402
    Launch,
    ScatterTarget,
    fp8_ds_mla_launch,
    per_token_head_launch,
    scatter_kv_launch,
    triton_importable,
)
from vllm.attention.types import (  # noqa: E402
    KVCacheDType,
    KVCacheLayout,
    KVQuant,
    cache_storage_dtype,
)
from vllm.attention.writer import KVCacheWriter, MLAKVCacheWriter  # noqa: E402
from vllm.attention.writers.dispatch import WritePath  # noqa: E402
from vllm.attention.writers import mla_writer_for_layout, writer_for_layout  # noqa: E402
from vllm.attention.writers.split import scatter_mode  # noqa: E402

L = KVCacheLayout
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Config:
    layout: KVCacheLayout
    cache_dtype: KVCacheDType

    @property
    def name(self) -> str:
        return f"{self.layout.value}/{self.cache_dtype}"

    @property
    def mla(self) -> bool:
        return self.layout in (L.MLA_LATENT, L.MLA_FP8_DS)


CONFIGS = [
    Config(L.SPLIT_NHD, "auto"), Config(L.SPLIT_NHD, "fp8_e4m3"), Config(L.SPLIT_NHD, "fp8_e5m2"),
    Config(L.SPLIT_HND, "auto"), Config(L.SPLIT_HND, "fp8_e4m3"),
    Config(L.SPLIT_KV_FIRST, "auto"), Config(L.SPLIT_BLOCK_INTERLEAVED, "auto"),
    Config(L.LEGACY_PAGED, "auto"), Config(L.LEGACY_PAGED, "fp8_e4m3"),
    Config(L.AITER_SHUFFLED, "auto"), Config(L.AITER_SHUFFLED, "fp8_e4m3"),
    Config(L.DIFFKV_PACKED, "auto"),
    Config(L.PER_TOKEN_HEAD_QUANT, "int8_per_token_head"),
    Config(L.PER_TOKEN_HEAD_QUANT, "fp8_per_token_head"),
    Config(L.MLA_LATENT, "auto"), Config(L.MLA_LATENT, "fp8_e4m3"),
    Config(L.MLA_FP8_DS, "fp8_ds_mla"),
]


@dataclass
class Row:
    config: str
    path: str
    num_tokens: int
    bytes_moved: int
    call_us: float | None = None
    call_gbps: float | None = None
    call_vs_copy: float | None = None
    kernel_us: float | None = None
    kernel_gbps: float | None = None
    kernel_vs_copy: float | None = None
    same_copy_us: float | None = None
    """An eager ``copy_`` moving the write's bytes (half read, half written), per call."""
    call_vs_same_copy: float | None = None
    matches_reference: bool | None = None
    error: str = ""


@dataclass
class Setup:
    """One configuration's cache, inputs and writer at a token count."""

    write: Callable[[], None]
    launch: Launch | None
    cache: torch.Tensor
    bytes_moved: int
    args: tuple[torch.Tensor, ...] = field(default_factory=tuple)


def _kernel_us(launch: Launch, args: argparse.Namespace, device: torch.device) -> float:
    """Device time of the prebuilt kernel launch alone: replayed from a CUDA graph of 10
    launches (Triton's Python launcher costs more host time than a small write takes on
    the GPU, so timing eager launches would measure the host); CUDA events around eager
    launches where capture fails."""
    if device.type == "cuda":
        try:
            return replay_us(capture(launch.run, reps=10), replays=max(5, args.iters // 5)) / 10
        except Exception as exc:  # capture is not possible here: time eagerly instead
            print(f"  (graph capture failed, eager timing: {type(exc).__name__}: {exc})")
    return event_us(launch.run, iters=args.iters, warmup=args.warmup, rounds=1, device=device)


class _PathWriter(Protocol):
    """A writer's ``write`` with the ``path`` every writer here takes beside the
    protocol's arguments (``"triton"`` or ``"torch"``: the one to time)."""

    def write(self, a: torch.Tensor, b: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, quant: KVQuant, *, path: WritePath | None = None
              ) -> None: ...


def _with_path(writer: KVCacheWriter | MLAKVCacheWriter) -> _PathWriter:
    return cast(_PathWriter, writer)


def _alloc_cache(cfg: Config, nb: int, bs: int, h: int, d: int, model: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    width = 2 * d if cfg.layout is L.DIFFKV_PACKED else d
    if cfg.mla:
        shape = kv_cache_shape(cfg.layout, nb, bs, 1, width)
    else:
        shape = kv_cache_shape(cfg.layout, nb, bs, h, width)
    storage = cache_storage_dtype(cfg.cache_dtype, model)
    cache = empty_in_stride_order(shape, kv_cache_stride_order(cfg.layout), dtype=storage,
                                  device=device)
    # (fp8 zeroed as bytes)
    (cache.view(torch.uint8) if storage.itemsize == 1 else cache).zero_()
    return cache


def build(cfg: Config, n: int, args: argparse.Namespace, device: torch.device,
          gen: torch.Generator) -> Setup:
    bs, h, d = args.block_size, args.heads, args.head_size
    model = DTYPES[args.dtype]
    nb = -(-max(n, 1) // bs) + 1
    if cfg.layout is L.MLA_FP8_DS:
        nb = -(-max(n, 1) // 64) + 1
        bs = 64
    if cfg.mla:
        d = args.kv_lora_rank + args.rope_dim
    cache = _alloc_cache(cfg, nb, bs, h, d, model, device)
    if args.slots == "random":
        slots = torch.randperm(nb * bs, generator=gen)[:n]
    elif args.slots == "pages":  # a prefill's: whole pages in a shuffled order
        pages = torch.randperm(nb, generator=gen)
        slots = (pages[:, None] * bs + torch.arange(bs)).flatten()[:n]
    else:
        slots = torch.arange(n)
    slots = slots.to(device)
    scale = torch.full((1,), args.scale, device=device)
    quant = KVQuant(cfg.cache_dtype, scale, scale)
    elem_in = model.itemsize
    stored = cache.element_size()
    if cfg.mla:
        kv_c = torch.randn(n, args.kv_lora_rank, generator=gen).to(model).to(device)
        k_pe = torch.randn(n, args.rope_dim, generator=gen).to(model).to(device)
        mla = _with_path(mla_writer_for_layout(cfg.layout))
        path = args.path

        def write_mla() -> None:
            mla.write(kv_c, k_pe, cache, slots, quant, path=path)

        read = n * (args.kv_lora_rank + args.rope_dim) * elem_in + 8 * n
        if cfg.layout is L.MLA_FP8_DS:
            written = n * FP8_DS_MLA_ENTRY_BYTES
            mla_launch = fp8_ds_mla_launch(kv_c, k_pe, cache, slots)
        else:
            written = n * d * stored
            lat, rope = cache[..., :args.kv_lora_rank], cache[..., args.kv_lora_rank:]
            mla_launch = scatter_kv_launch(
                kv_c.unsqueeze(1), k_pe.unsqueeze(1), ScatterTarget.token_major(lat.unsqueeze(2)),
                ScatterTarget.token_major(rope.unsqueeze(2)), slots,
                scatter_mode(cfg.cache_dtype), scale, scale, same_scale=True)  # as the writer
        return Setup(write_mla, mla_launch, cache, read + written, (kv_c, k_pe, slots))
    key = torch.randn(n, h, d, generator=gen).to(model).to(device)
    value = torch.randn(n, h, d, generator=gen).to(model).to(device)
    writer = _with_path(writer_for_layout(cfg.layout))
    path = args.path

    def write_kv() -> None:
        writer.write(key, value, cache, slots, quant, path=path)

    read = 2 * n * h * d * elem_in + 8 * n
    lay = cfg.layout
    if lay is L.PER_TOKEN_HEAD_QUANT:
        written = 2 * n * h * (d + 4)
        kv, vv = split_kv_views(cache, lay)
        launch: Launch | None = per_token_head_launch(
            key, value, kv, vv, slots, cfg.cache_dtype == "int8_per_token_head")
    else:
        written = 2 * n * h * d * stored
        mode = scatter_mode(cfg.cache_dtype)
        if lay is L.LEGACY_PAGED:
            k5, v4 = legacy_paged_views(cache, h, d)
            kt, vt = ScatterTarget.x_split_key(k5), ScatterTarget.head_major_value(v4)
        elif lay is L.AITER_SHUFFLED:
            k5, v5 = aiter_shuffled_views(cache)
            kt, vt = ScatterTarget.x_split_key(k5), ScatterTarget.x_split_value(v5)
        elif lay is L.DIFFKV_PACKED:
            kt = ScatterTarget.token_major(cache[..., :d])
            vt = ScatterTarget.token_major(cache[..., d:])
        else:
            kv, vv = split_kv_views(cache, lay)
            kt, vt = ScatterTarget.token_major(kv), ScatterTarget.token_major(vv)
        launch = scatter_kv_launch(key, value, kt, vt, slots, mode, scale, scale)
    return Setup(write_kv, launch, cache, read + written, (key, value, slots))


INDEX_COPY = "baseline/index_copy_"


def _index_copy_rows(args: argparse.Namespace, device: torch.device, gen: torch.Generator,
                     copy_gbps: float) -> list[Row]:
    """The ``index_copy_`` baseline of the issue: K and V rows put at their slots of a
    split_kv_first bf16 cache (K and V each ``[slots, H, D]`` flat) by two ``index_copy_``
    calls (no padding support, no checks)."""
    rows = []
    for n in args.tokens:
        row = Row(INDEX_COPY, "torch", n, 0)
        setup = build(Config(L.SPLIT_KV_FIRST, "auto"), n, args, device, gen)
        key, value, slots = setup.args
        k_view, v_view = split_kv_views(setup.cache, L.SPLIT_KV_FIRST)
        k_flat = k_view.reshape(-1, *k_view.shape[2:])
        v_flat = v_view.reshape(-1, *v_view.shape[2:])
        if k_flat.data_ptr() != k_view.data_ptr() or not k_flat._is_view():
            row.error = "split_nhd view is not flat-able"
        else:
            def put() -> None:
                k_flat.index_copy_(0, slots, key)
                v_flat.index_copy_(0, slots, value)

            row.bytes_moved = setup.bytes_moved
            row.call_us = event_us(put, iters=args.iters, warmup=args.warmup, rounds=1,
                                   device=device)
            row.call_gbps = setup.bytes_moved / (row.call_us * 1e-6) / 1e9
            row.call_vs_copy = row.call_gbps / copy_gbps
        rows.append(row)
        _print_row(row)
    return rows


def _matches_reference(cfg: Config, setup: Setup, path: WritePath, scale_value: float
                       ) -> bool:
    """A write by the timed path equals the torch reference's, byte for byte."""
    from vllm.attention.writers import reference_write

    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[setup.cache.element_size()]
    got, ref = setup.cache.clone(), setup.cache.clone()  # same strides
    got.view(bits).zero_()
    ref.view(bits).zero_()
    a, b, slots = setup.args
    scale = torch.full((1,), scale_value, device=got.device)
    quant = KVQuant(cfg.cache_dtype, scale, scale)
    writer = mla_writer_for_layout(cfg.layout) if cfg.mla else writer_for_layout(cfg.layout)
    _with_path(writer).write(a, b, got, slots, quant, path=path)
    reference_write(cfg.layout, a, b, ref, slots, quant)
    return bool(torch.equal(got.view(bits), ref.view(bits)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/local"))
    p.add_argument("--tokens", type=int, nargs="+",
                   default=[1, 4, 16, 64, 256, 1024, 4096, 16384, 65536])
    p.add_argument("--mla-extra-tokens", type=int, nargs="*", default=[262144],
                   help="more token counts for the MLA latent rows: a 576-value MLA row is "
                        "3.6x smaller than a split row, so equal bytes need more tokens")
    p.add_argument("--layouts", nargs="*", default=None,
                   help="config names (layout/cache_dtype) or layout values to run; default all")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--slots", choices=["random", "pages", "contiguous"], default="random",
                   help="random: every slot anywhere in the cache; pages: as a prefill "
                        "writes them (consecutive slots of pages taken in a shuffled "
                        "order); contiguous: slots 0..T-1")
    p.add_argument("--scale", type=float, default=1.0,
                   help="the fp8 caches' k/v scale: 1.0 (uncalibrated, a power of two: the "
                        "quantiser multiplies) or any other value (it divides)")
    p.add_argument("--path", choices=["triton", "torch"], default=None,
                   help="force the writers' path (default: triton on CUDA, torch elsewhere)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--copy-gib", type=float, default=2.0)
    p.add_argument("--smoke", action="store_true", help="tiny run (what a CPU-only host does)")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" or args.smoke:
        args.smoke = True
        args.tokens = [t for t in args.tokens if t <= 64][:3] or [1, 16]
        args.iters, args.warmup, args.copy_gib = min(args.iters, 3), 1, min(args.copy_gib, 0.01)
        args.heads, args.head_size = min(args.heads, 2), min(args.head_size, 64)
    configs = CONFIGS
    if args.layouts:
        wanted = set(args.layouts)
        configs = [c for c in CONFIGS if c.name in wanted or c.layout.value in wanted]
    path: WritePath = args.path or ("triton" if device.type == "cuda" and triton_importable()
                                    else "torch")
    if path == "triton" and not triton_importable():
        print("triton is not importable: --path triton cannot run", file=sys.stderr)
        return 2
    args.path = path

    copy_gbps = copy_ceiling_gbps(device, args.copy_gib, max(5, args.iters // 5), warmup=3,
                                  rounds=1)
    copied = copy_bytes(args.copy_gib)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"eager copy_ of {copied / 2**30:.2f} GiB bf16: {copy_gbps:.0f} GB/s "
          f"(read + written); writer path: {path}")

    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    index_copy = _index_copy_rows(args, device, gen, copy_gbps)
    for cfg in configs:
        checked = False
        tokens = list(args.tokens)
        if cfg.layout is L.MLA_LATENT and not args.smoke:
            tokens += [t for t in args.mla_extra_tokens if t not in tokens]
        for n in tokens:
            row = Row(cfg.name, path, n, 0)
            try:
                setup = build(cfg, n, args, device, gen)
                row.bytes_moved = setup.bytes_moved
                row.call_us = event_us(setup.write, iters=args.iters, warmup=args.warmup,
                                       rounds=1, device=device)
                row.call_gbps = setup.bytes_moved / (row.call_us * 1e-6) / 1e9
                row.call_vs_copy = row.call_gbps / copy_gbps
                row.same_copy_us = _same_bytes_copy_us(setup.bytes_moved, args, device)
                row.call_vs_same_copy = row.same_copy_us / row.call_us
                if path == "triton" and setup.launch is not None:
                    row.kernel_us = _kernel_us(setup.launch, args, device)
                    row.kernel_gbps = setup.bytes_moved / (row.kernel_us * 1e-6) / 1e9
                    row.kernel_vs_copy = row.kernel_gbps / copy_gbps
                if not checked and (n >= 256 or n == tokens[-1]):
                    row.matches_reference = _matches_reference(cfg, setup, path, args.scale)
                    checked = True
                del setup
            except Exception as exc:  # one broken configuration must not end the run
                row.error = f"{type(exc).__name__}: {exc}"
                traceback.print_exc(limit=3)
            rows.append(row)
            _print_row(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "writers.json"
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "copy_gbps": copy_gbps,
        "copy_bytes": copied,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "bytes_moved": "K/V (or latent/rope) rows read + slot_mapping read + cache bytes written",
    }
    if index_copy:
        meta["index_copy_gbps"] = index_copy[-1].call_gbps
        meta["index_copy"] = ("baseline: torch index_copy_ of K and V rows into a "
                              "split_kv_first cache viewed as [slots, H, D] (same bytes as "
                              "the split bf16 writes)")
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows + index_copy]},
                              indent=1))
    print(f"wrote {out}")
    bad = [r for r in rows if r.error or r.matches_reference is False]
    return 1 if bad else 0


_SAME_COPY: dict[int, float] = {}


def _same_bytes_copy_us(moved: int, args: argparse.Namespace, device: torch.device) -> float:
    """Per-call time of an eager bf16 ``dst.copy_(src)`` that reads and writes ``moved``
    bytes in all, timed as a write call is: the ceiling for a transfer of that size (a
    short one loses a larger share to the kernel's ramp and tail than the 2 GiB copy)."""
    each_way = moved // 2
    if each_way not in _SAME_COPY:
        _SAME_COPY[each_way] = copy_us(device, each_way, args.iters, warmup=args.warmup,
                                       rounds=1)
    return _SAME_COPY[each_way]


def _triton_version() -> str | None:
    if not triton_importable():
        return None
    import triton

    return str(triton.__version__)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


_HEADER_DONE: list[bool] = []


def _print_row(r: Row) -> None:
    if not _HEADER_DONE:
        print(f"{'config':42} {'tokens':>6} {'call us':>9} {'GB/s':>7} {'/copy':>6} "
              f"{'kern us':>9} {'GB/s':>7} {'/copy':>6} {'/same':>6}  ref")
        _HEADER_DONE.append(True)
    ref = {None: "", True: "ok", False: "MISMATCH"}[r.matches_reference]
    print(f"{r.config:42} {r.num_tokens:>6} {_fmt(r.call_us, '9.1f')} {_fmt(r.call_gbps, '7.1f')} "
          f"{_fmt(r.call_vs_copy, '6.2f')} {_fmt(r.kernel_us, '9.1f')} "
          f"{_fmt(r.kernel_gbps, '7.1f')} {_fmt(r.kernel_vs_copy, '6.2f')} "
          f"{_fmt(r.call_vs_same_copy, '6.2f')}  {ref}"
          + (f"  ERROR {r.error}" if r.error else ""))


if __name__ == "__main__":
    raise SystemExit(main())
