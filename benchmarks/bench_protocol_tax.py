"""Protocol tax: one layer's decode step through ``Attention`` against the same kernels
called directly, and a legacy backend through the adapter against calling it directly.

Decode step: batch 64, 2048-token contexts (2047 cached + 1 new), Hq=32, Hkv=8, D=128,
bf16, block 16, TRITON_ATTN (split NHD cache):

* ``layer``: ``Attention.forward(q, k, v, out)`` in a ForwardContext (writer + impl);
* ``direct``: the write kernel's launch and ``paged_attention_triton`` called by hand on
  the same tensors (what the layer ends up running, with no protocol around it);
* ``adapter (fused|flagged)``: two legacy backends defined here (a *fused* one whose
  ``forward`` writes from ``attn_metadata.slot_mapping``, and a *flagged* one with
  ``do_kv_cache_update``), both writing with the same Triton scatter and computing with
  ``paged_attention_triton``, run through ``shim.adapt_legacy_backend`` + ``Attention``;
* ``legacy direct``: the same legacy impls called directly with their own metadata.

Each step is captured in a CUDA graph and timed by CUDA events over 50 replays (device
time: the host-side protocol costs nothing there); eager wall time per step is
reported too. Targets: layer / direct <= 1.02; adapter / legacy direct <= 1.10 (the
adapted fused backend also writes through the layer's writer, as the adapter does).
Outputs of the paired paths are checked to be identical.

    python benchmarks/bench_protocol_tax.py --out DIR      # writes DIR/protocol_tax.json

Without CUDA: a small CPU run (torch paths, eager times only) as a smoke check.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import capture, device_info, host_us, print_table, replay_us, write_json  # noqa: E402

from shim import adapt_legacy_backend  # noqa: E402
from vllm.attention import KVQuant, allocate_kv_cache  # noqa: E402
from vllm.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from vllm.attention.batch import make_paged_batch  # noqa: E402
from vllm.attention.layer import Attention  # noqa: E402
from vllm.attention.layouts import split_kv_views  # noqa: E402
from vllm.attention.ops.paged_attention import paged_attention  # noqa: E402
from vllm.attention.ops.paged_kv import PagedKV  # noqa: E402
from vllm.attention.types import KVCacheLayout  # noqa: E402
from vllm.attention.writers import kernels as tw  # noqa: E402
from vllm.attention.writers import reference_write  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
LAYER_TARGET, ADAPTER_TARGET = 1.02, 1.10
L = KVCacheLayout


# -- two legacy backends, written the way backends were before the split --------------------

@dataclasses.dataclass
class LegacyMeta:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    causal: bool
    slot_mapping: torch.Tensor


class LegacyBuilder:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build(self, common_prefix_len: int, common: Any) -> LegacyMeta:
        return LegacyMeta(**{f.name: getattr(common, f.name)
                             for f in dataclasses.fields(LegacyMeta)})


_UNSCALED: dict[torch.device, KVQuant] = {}


def _unscaled(device: torch.device) -> KVQuant:
    """One set of unit scales per device (made before capture, not inside a graph)."""
    if device not in _UNSCALED:
        _UNSCALED[device] = KVQuant.unscaled(device=device)
    return _UNSCALED[device]


def _legacy_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slots: torch.Tensor) -> None:
    quant = _unscaled(kv_cache.device)
    if kv_cache.device.type != "cuda":
        reference_write(L.SPLIT_NHD, key, value, kv_cache, slots, quant)
        return
    k_view, v_view = split_kv_views(kv_cache, L.SPLIT_NHD)
    tw.scatter_kv(key, value, tw.ScatterTarget.token_major(k_view),
                  tw.ScatterTarget.token_major(v_view), slots, 0, quant.k_scale, quant.v_scale)


class LegacyFusedImpl:
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Any, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = "decoder",
                 kv_sharing_target_layer_name: str | None = None) -> None:
        self.scale, self.num_kv_heads, self.head_size = scale, num_kv_heads, head_size

    def compute(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: LegacyMeta,
                output: torch.Tensor) -> torch.Tensor:
        kv = PagedKV.from_cache(kv_cache, L.SPLIT_NHD, _unscaled(kv_cache.device),
                                block_size=meta.block_size, num_kv_heads=self.num_kv_heads,
                                head_size=self.head_size)
        return paged_attention(query, kv, meta, scale=self.scale, output=output, causal=True)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: LegacyMeta,
                output: torch.Tensor) -> torch.Tensor:
        _legacy_write(key, value, kv_cache, attn_metadata.slot_mapping)  # the old fused write
        return self.compute(query, kv_cache, attn_metadata, output)


class LegacyFlaggedImpl(LegacyFusedImpl):
    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        _legacy_write(key, value, kv_cache, slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: LegacyMeta,
                output: torch.Tensor) -> torch.Tensor:
        return self.compute(query, kv_cache, attn_metadata, output)


class BenchLegacyFused:
    @staticmethod
    def get_name() -> str:
        return "BENCH_LEGACY_FUSED"

    @staticmethod
    def get_impl_cls() -> type[LegacyFusedImpl]:
        return LegacyFusedImpl

    @staticmethod
    def get_metadata_cls() -> type[LegacyMeta]:
        return LegacyMeta

    @staticmethod
    def get_builder_cls() -> type[LegacyBuilder]:
        return LegacyBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_dtypes() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]


class BenchLegacyFlagged(BenchLegacyFused):
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "BENCH_LEGACY_FLAGGED"

    @staticmethod
    def get_impl_cls() -> type[LegacyFlaggedImpl]:
        return LegacyFlaggedImpl


# -- the measurement ------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/local"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--replays", type=int, default=50)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda" and tw.triton_importable()
    if not cuda:
        args.batch, args.context = 4, 64
    dtype = torch.bfloat16 if cuda else torch.float32
    batch = make_paged_batch([1] * args.batch, [args.context - 1] * args.batch, block_size=BS,
                             device=device, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(args.batch, HQ, D, generator=g).to(dtype).to(device)
    k = torch.randn(args.batch, HKV, D, generator=g).to(dtype).to(device)
    v = torch.randn(args.batch, HKV, D, generator=g).to(dtype).to(device)
    slots = batch.new_slots

    def cache_for(backend: Any) -> torch.Tensor:
        c = allocate_kv_cache(backend, num_blocks=batch.num_blocks, block_size=BS,
                              num_kv_heads=HKV, head_size=D, model_dtype=dtype, device=device)
        c.normal_(generator=None)
        return c

    def layer_for(backend: Any, name: str, cache: torch.Tensor) -> tuple[Attention, Any]:
        layer = Attention(num_heads=HQ, num_kv_heads=HKV, head_size=D, scale=D ** -0.5,
                          backend=backend, layer_name=name)
        layer.bind_kv_cache(cache, BS)
        meta = backend.get_builder_cls()(layer.spec, device).build(batch.common)
        return layer, meta

    def measure(fn: Any) -> dict[str, float | None]:
        graph = replay_us(capture(fn), replays=args.replays) if cuda else None
        eager = host_us(fn, device, calls=50 if cuda else 5, rounds=3)["with_sync_us"]
        return {"graph_us": graph, "eager_us": eager}

    results: dict[str, dict[str, float | None]] = {}
    outputs: dict[str, torch.Tensor] = {}
    cache = cache_for(TritonAttentionBackend)
    start = cache.clone()

    # new-style: through the layer, and the same kernels by hand
    layer, meta = layer_for(TritonAttentionBackend, "tax.0", cache)
    out_layer = torch.empty(args.batch, HQ, D, dtype=dtype, device=device)
    with set_forward_context(attn_metadata={"tax.0": meta}, slot_mapping={"tax.0": slots}):
        results["layer"] = measure(lambda: layer(q, k, v, out_layer))
    outputs["layer"] = out_layer.clone()
    cache.copy_(start)
    quant = _unscaled(device)
    kv = PagedKV.from_cache(cache, L.SPLIT_NHD, quant, block_size=BS, num_kv_heads=HKV,
                            head_size=D)
    out_direct = torch.empty_like(out_layer)
    if cuda:
        k_view, v_view = split_kv_views(cache, L.SPLIT_NHD)
        write = tw.scatter_kv_launch(k, v, tw.ScatterTarget.token_major(k_view),
                                     tw.ScatterTarget.token_major(v_view), slots, 0,
                                     quant.k_scale, quant.v_scale)
        from vllm.attention.ops.triton_paged_attention import paged_attention_triton

        def direct() -> None:
            write.run()
            paged_attention_triton(q, kv, meta, scale=D ** -0.5, output=out_direct, causal=True)
    else:
        def direct() -> None:
            reference_write(L.SPLIT_NHD, k, v, cache, slots, quant)
            paged_attention(q, kv, meta, scale=D ** -0.5, output=out_direct, causal=True)
    results["direct"] = measure(direct)
    outputs["direct"] = out_direct.clone()

    # legacy backends: through the adapter, and called directly
    for legacy_cls, tag in ((BenchLegacyFused, "fused"), (BenchLegacyFlagged, "flagged")):
        cache.copy_(start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the adapter's migration notice
            adapted = adapt_legacy_backend(legacy_cls)
        alayer, ameta = layer_for(adapted, f"tax.{tag}", cache)
        out_a = torch.empty_like(out_layer)
        with set_forward_context(attn_metadata={f"tax.{tag}": ameta},
                                 slot_mapping={f"tax.{tag}": slots}):
            results[f"adapter {tag}"] = measure(lambda: alayer(q, k, v, out_a))
        outputs[f"adapter {tag}"] = out_a.clone()
        cache.copy_(start)
        impl = legacy_cls.get_impl_cls()(HQ, D, D ** -0.5, HKV, None, None, "auto")
        lmeta = LegacyMeta(**{f.name: getattr(batch.common, f.name)
                              for f in dataclasses.fields(LegacyMeta)
                              if f.name != "slot_mapping"}, slot_mapping=slots)
        out_l = torch.empty_like(out_layer)
        if tag == "flagged":
            def legacy_direct(impl: Any = impl, lmeta: LegacyMeta = lmeta,
                              out_l: torch.Tensor = out_l) -> None:
                impl.do_kv_cache_update(None, k, v, cache, lmeta.slot_mapping)
                impl.forward(None, q, k, v, cache, lmeta, out_l)
        else:
            def legacy_direct(impl: Any = impl, lmeta: LegacyMeta = lmeta,
                              out_l: torch.Tensor = out_l) -> None:
                impl.forward(None, q, k, v, cache, lmeta, out_l)
        results[f"legacy {tag} direct"] = measure(legacy_direct)
        outputs[f"legacy {tag} direct"] = out_l.clone()

    key = "graph_us" if cuda else "eager_us"
    pairs = [("layer", "direct", LAYER_TARGET),
             ("adapter fused", "legacy fused direct", ADAPTER_TARGET),
             ("adapter flagged", "legacy flagged direct", ADAPTER_TARGET)]
    rows: list[dict[str, Any]] = []
    for a, b, target in pairs:
        ra, rb = results[a], results[b]
        ratio = (ra[key] or 0.0) / (rb[key] or 1.0)
        eager_ratio = (ra["eager_us"] or 0.0) / (rb["eager_us"] or 1.0)
        same = bool(torch.equal(outputs[a], outputs[b]))
        rows.append({"path": a, "baseline": b, "path_us": ra[key], "baseline_us": rb[key],
                     "ratio": ratio, "eager_path_us": ra["eager_us"],
                     "eager_baseline_us": rb["eager_us"], "eager_ratio": eager_ratio,
                     "same_output": same, "target": target if cuda else None,
                     "ok": (ratio <= target) if cuda else None})
    info = device_info(device)
    print(f"device: {info['device']}; torch {info['torch']}; triton {info['triton']}; decode "
          f"batch {args.batch}, context {args.context}, Hq={HQ} Hkv={HKV} D={D} "
          f"{str(dtype).replace('torch.', '')}, block {BS}; "
          f"{'CUDA-graph replay times' if cuda else 'CPU eager times (smoke)'}")
    print_table(rows, [("path", "path", ""), ("baseline", "baseline", ""),
                       ("path_us", "path us", ".2f"), ("baseline_us", "baseline us", ".2f"),
                       ("ratio", "ratio", ".3f"), ("eager_ratio", "eager ratio", ".3f"),
                       ("same_output", "same out", ""), ("target", "target", ".2f"),
                       ("ok", "ok", "")])
    write_json(args.out, "protocol_tax.json", {
        "meta": {**info, "batch": args.batch, "context": args.context, "Hq": HQ, "Hkv": HKV,
                 "D": D, "block_size": BS, "dtype": str(dtype), "replays": args.replays},
        "paths": results, "rows": rows})
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
