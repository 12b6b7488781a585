"""Where the host time of one eager T=1 ``writer.write`` goes, on CUDA: the whole call,
then its parts one by one (the signature, signature + lookup, the bound launch alone,
Triton's raw launcher alone with the bound launch's arguments), each against
``t.add_(0)`` in the same process. A diagnostic for ``bench_launch.py``'s row 2a.

    python tools/launch_breakdown.py
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from _timing import host_us  # noqa: E402

from vllm.attention import KVQuant  # noqa: E402
from vllm.attention.types import KVCacheLayout  # noqa: E402
from vllm.attention.writers import SplitKVCacheWriter  # noqa: E402
from vllm.attention.writers import kernels as tw  # noqa: E402
from vllm.attention.writers.kernels import cached  # noqa: E402
from vllm.attention.writers.launch_cache import write_signature  # noqa: E402


def _raw_floor(dev: torch.device) -> dict[str, Callable[[], object]]:
    """Triton's raw launcher on two stand-in kernels with prebuilt argument tuples: one
    pointer, and one pointer + 44 ints (the writer's argument count), so the driver's
    launch floor and the per-argument parsing cost are read apart."""
    import triton
    import triton.language as tl

    @triton.jit
    def one(p):
        tl.store(p, 1.0)

    @triton.jit
    def many(p, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
             a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30,
             a31, a32, a33, a34, a35, a36, a37, a38, a39, a40, a41, a42, a43):
        tl.store(p, (a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13
                     + a14 + a15 + a16 + a17 + a18 + a19 + a20 + a21 + a22 + a23 + a24 + a25
                     + a26 + a27 + a28 + a29 + a30 + a31 + a32 + a33 + a34 + a35 + a36 + a37
                     + a38 + a39 + a40 + a41 + a42 + a43).to(tl.float32))

    x = torch.zeros(16, device=dev)
    ints = tuple(range(3, 47))
    out: dict[str, Callable[[], object]] = {}
    for name, kern, args in (("raw launch, 1 pointer", one, (x,)),
                             ("raw launch, 1 pointer + 44 ints", many, (x, *ints))):
        compiled: Any = kern[(1,)](*args)
        run = compiled.run
        full = (1, 1, 1, torch._C._cuda_getCurrentRawStream(dev.index or 0), compiled.function,
                run.launch_cooperative_grid, run.launch_pdl, None, None,
                compiled.packed_metadata, None, None, None, x.data_ptr(), *args[1:])
        raw = run.launch
        out[name] = functools.partial(raw, *full)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("launch_breakdown: needs CUDA")
        return 0
    dev = torch.device("cuda")
    key = torch.randn(1, 8, 128, device=dev).to(torch.bfloat16)
    cache = torch.zeros(1024, 2, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    slots = torch.zeros(1, dtype=torch.int64, device=dev)
    quant = KVQuant.unscaled(device=dev)
    w = SplitKVCacheWriter(KVCacheLayout.SPLIT_NHD)
    for _ in range(3):
        w.write(key, key, cache, slots, quant)
    torch.cuda.synchronize()
    sig = write_signature(key, key, cache, slots, quant, None)
    run = w._runners.get(sig)
    assert isinstance(run, tw.CachedLaunch) and run.binding is not None
    live = (key, key, cache, slots, quant.k_scale, quant.v_scale)
    bound = run.binding.call
    t = torch.zeros(1, device=dev)
    parts = {
        "t.add_(0)": lambda: t.add_(0),
        "writer.write": lambda: w.write(key, key, cache, slots, quant),
        "write_signature": lambda: write_signature(key, key, cache, slots, quant, None),
        "signature + lookup": lambda: w._runners.get(
            write_signature(key, key, cache, slots, quant, None)),
        "CachedLaunch(live)": lambda: run(live),
        "bound launch(live)": lambda: bound(live),
        "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "Triton's launch hooks read": lambda: (cached._runtime_knobs().launch_enter_hook,
                                               cached._runtime_knobs().launch_exit_hook),
        "key.data_ptr()": key.data_ptr,
        "(shape, stride(), dtype, device) of key": lambda: (key.shape, key.stride(), key.dtype,
                                                           key.device),
        "(shape, stride(), dtype, get_device()) of key": lambda: (
            key.shape, key.stride(), key.dtype, key.get_device()),
    }
    src = run.binding.source
    glob = run.binding.call.__globals__
    call_line = next(ln for ln in src.splitlines() if ln.strip().startswith("raw("))
    prebuilt = eval("(" + call_line.strip()[4:-1] + ",)",
                    dict(glob, b0=key.data_ptr(), b1=key.data_ptr(), b2=cache.data_ptr(),
                         b3=slots.data_ptr(), get_stream=glob["get_stream"]))
    parts["raw launch, the writer's prebuilt arguments"] = functools.partial(glob["raw"], *prebuilt)
    # the bound call's Python side: its source with the raw launcher swapped for a no-op,
    # without the hook check, and with the stream fetched but everything else prebuilt
    lines = src.splitlines()
    variants = {
        "bound call, raw -> no-op": src.replace("    raw(", "    noop("),
        "bound call without the hook check": "\n".join(
            [lines[0]] + lines[next(i for i, ln in enumerate(lines) if ln.startswith("    b")):]),
    }
    for name, code in variants.items():
        ns = dict(glob, noop=lambda *a: None)
        exec(compile(code, name, "exec"), ns)  # noqa: S102
        parts[name] = functools.partial(ns["call"], live)
    rest = prebuilt[4:]
    raw = glob["raw"]
    get_stream = glob["get_stream"]
    parts["raw, stream fetched, rest prebuilt"] = lambda: raw(1, 1, 1, get_stream(0), *rest)
    parts.update(_raw_floor(dev))
    base = None
    print(run.binding.source)
    for name, fn in parts.items():
        us = host_us(fn, dev, calls=2000, rounds=5)["loop_us"]
        base = base or us
        print(f"{name:40} {us:7.2f} us  {us / base:5.2f} x add_")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
