"""The cost of checked mode: one layer's write path with ``checked`` off and on.

Times ``Attention.write_kv`` (the layer's write: in checked mode the slot-range and
duplicate check, then ``KVCacheWriter.write`` with its always-on metadata checks)
for a decode-like slot mapping (tokens scattered over the cache, ~1/8 padding),
per token count. Checked mode reads the slot values: on CUDA that is a device
synchronisation per layer call, which is the cost that matters; on CPU it is a few
extra tensor ops.

Run from the repository root::

    python benchmarks/bench_checked_mode.py                      # CPU
    python benchmarks/bench_checked_mode.py --device cuda --dtype bf16

Writes ``checked_mode_<device>.json`` and ``.md`` under ``--out``
(default ``benchmarks/results``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import timing_event  # noqa: E402
from vllm.attention import allocate_kv_cache, registry  # noqa: E402
from vllm.attention.layer import Attention  # noqa: E402
from vllm.attention.writers.validation import check_slots_in_range  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timer(device: torch.device) -> Callable[[Callable[[], None], int], float]:
    """Seconds per call of ``fn``, over ``n`` back-to-back calls."""
    def run(fn: Callable[[], None], n: int) -> float:
        if device.type == "cuda":
            start, end = timing_event(), timing_event()
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            return float(start.elapsed_time(end)) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n
    return run


def bench_one(backend_name: str, device: torch.device, dtype: torch.dtype, tokens: int,
              heads: int, head_size: int, block_size: int, repeats: int, calls: int,
              seed: int) -> dict[str, float | int]:
    backend = registry.get_backend(backend_name)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(4, 2 * -(-tokens // block_size))
    cache = allocate_kv_cache(backend, num_blocks=num_blocks, block_size=block_size,
                              num_kv_heads=heads, head_size=head_size, model_dtype=dtype,
                              device=device)
    cache.zero_()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.125] = -1  # padding / other ranks' tokens
    slots = slots.to(device)
    key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype).to(device)
    value = torch.randn(tokens, heads, head_size, generator=gen).to(dtype).to(device)
    layers = {}
    for checked in (False, True):
        layer = Attention(num_heads=heads, num_kv_heads=heads, head_size=head_size, scale=1.0,
                          backend=backend, layer_name="l0", checked=checked).to(device)
        layer.bind_kv_cache(cache, block_size)
        layers[checked] = layer
    run = timer(device)
    num_slots = layers[True].num_cache_slots()
    check_alone = min(run(lambda: check_slots_in_range(slots, num_slots), calls)
                      for _ in range(repeats))
    result: dict[str, list[float]] = {"off": [], "on": []}
    with set_forward_context(attn_metadata={}, slot_mapping={"l0": slots}) as ctx:
        for checked in (False, True):  # warm up (kernel compilation, allocator)
            for _ in range(3):
                layers[checked].write_kv(key, value, ctx)
        for _ in range(repeats):  # interleaved, so drift hits both alike
            for checked in (False, True):
                layer = layers[checked]
                t = run(lambda: layer.write_kv(key, value, ctx), calls)
                result["on" if checked else "off"].append(t)
    # The fastest round: on a shared machine the others measure the neighbours too.
    off, on = min(result["off"]), min(result["on"])
    spread = max((max(v) - min(v)) / statistics.median(v) for v in result.values())
    return {"tokens": tokens, "off_us": off * 1e6, "on_us": on * 1e6,
            "overhead_us": (on - off) * 1e6, "overhead_pct": 100.0 * (on - off) / off,
            "check_alone_us": check_alone * 1e6,
            "off_median_us": statistics.median(result["off"]) * 1e6,
            "on_median_us": statistics.median(result["on"]) * 1e6,
            "round_spread_pct": 100.0 * spread}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="TORCH_REF")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="model dtype (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--tokens", default="1,8,64,512,4096")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (fastest reported)")
    p.add_argument("--calls", type=int, default=50, help="calls per round")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        rows.append(bench_one(args.backend, device, dtype, n, args.heads, args.head_size,
                              args.block_size, args.repeats, args.calls, seed=n))
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{platform.processor() or platform.machine()}, {args.threads} torch thread(s)")
    writer = registry.get_backend(args.backend).get_kv_cache_writer()
    path = getattr(writer, "path", lambda d: "?")(device)
    meta = {"device": str(device), "where": where, "backend": args.backend,
            "writer_path": path, "dtype": str(dtype).removeprefix("torch."),
            "heads": args.heads, "head_size": args.head_size, "block_size": args.block_size,
            "repeats": args.repeats, "calls": args.calls, "torch": torch.__version__,
            "python": platform.python_version()}
    lines = [
        f"# Checked mode cost: {args.backend} write path on {where}",
        "",
        f"`python benchmarks/bench_checked_mode.py {' '.join(argv or sys.argv[1:])}`".replace(
            " `", "`") + " "
        f"(writer path `{path}`, {meta['dtype']}, {args.heads} kv heads x {args.head_size}, "
        f"block size {args.block_size}; fastest of {args.repeats} rounds of {args.calls} calls; "
        "~1/8 of the slots are padding).",
        "",
        "| tokens | unchecked (us) | checked (us) | overhead (us) | overhead "
        "| the check alone (us) | round spread |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['off_us']:.1f} | {r['on_us']:.1f} | "
                     f"{r['overhead_us']:.1f} | {r['overhead_pct']:.0f}% | "
                     f"{r['check_alone_us']:.1f} | {r['round_spread_pct']:.0f}% |")
    lines += ["", "The check alone: `check_slots_in_range` (range and duplicates) timed by "
              "itself, the part of the overhead that grows with the tokens.",
              "", "Round spread: (slowest - fastest) / median round, the worse of the two "
              "modes; a large spread means a busy machine, and an overhead smaller than the "
              "spread is noise."]
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"checked_mode_{device.type}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / f"checked_mode_{device.type}.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
