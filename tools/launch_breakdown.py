"""Where the host time of one eager T=1 ``writer.write`` goes, on CUDA: the whole call,
then its parts one by one (the signature, signature + lookup, the bound launch alone,
Triton's raw launcher alone with the bound launch's arguments), each against
``t.add_(0)`` in the same process. A diagnostic for ``bench_launch.py``'s row 2a.

    python tools/launch_breakdown.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from _timing import host_us  # noqa: E402

from vllm.attention import KVQuant  # noqa: E402
from vllm.attention.ops import triton_writers as tw  # noqa: E402
from vllm.attention.types import KVCacheLayout  # noqa: E402
from vllm.attention.writers import SplitKVCacheWriter  # noqa: E402
from vllm.attention.writers.launch_cache import write_signature  # noqa: E402


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
    }
    base = None
    print(run.binding.source)
    for name, fn in parts.items():
        us = host_us(fn, dev, calls=2000, rounds=5)["loop_us"]
        base = base or us
        print(f"{name:40} {us:7.2f} us  {us / base:5.2f} x add_")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
