"""Where FlexAttention's decode time goes: the same page_table decode (batch 64 x 4096
context, 32 q / 8 kv heads, D=128, bf16, page 16) with the K/V tensors Inductor's decode
kernel reads laid out differently, same values, same block mask.

``flex_paged._slots`` (the op's ``[1, H, slots, D]`` view of the cache) is swapped for
copies made once, outside the timing: head-major (each head's slots contiguous, a
page's 16 keys one 4 KiB run) and three token-major ones (a slot's heads side by side,
a page's keys 16 runs of 256 bytes): K and V in tensors of their own, in one buffer,
interleaved a token at a time as FLEX_ATTENTION's cache is. Each line: device time per
call with the queue filled (``_timing.queued_us``), the largest difference from the
first variant's output, and the two longest kernels.

    python benchmarks/flex_decode_layouts.py > DIR/flex_decode_layouts.txt
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tune_prefill  # noqa: E402
from _timing import cuda_or_skip, kernel_us, queued_us  # noqa: E402

from vllm.attention.ops import flex_paged  # noqa: E402
from vllm.attention.ops.paged_kv import PagedOperand  # noqa: E402


def main() -> int:
    dev = cuda_or_skip("flex_decode_layouts.py", "it times Inductor's kernels")
    if dev is None:
        return 0
    q, kv, meta, scale = tune_prefill.flex_decode_case(dev)
    out = torch.empty_like(q)
    shipped = flex_paged._slots
    first: list[torch.Tensor] = []

    def run() -> object:
        return flex_paged.flex_paged_attention(q, kv, meta, scale=scale, output=out,
                                               mode="page_table", compiled=True)

    def variant(name: str, slots: Callable[[PagedOperand], torch.Tensor | None]) -> None:
        setattr(flex_paged, "_slots", slots)  # a stand-in for the op's own view
        try:
            run()
            torch.cuda.synchronize()
            t, _ = queued_us(run, iters=20, warmup=2, rounds=3, device=dev)
            kernels = kernel_us(run, dev)[:2]
        finally:
            flex_paged._slots = shipped
        if not first:
            first.append(out.clone())
        diff = float((out.float() - first[0].float()).abs().max())
        print(f"{name:48s} {t:8.1f} us  max diff {diff:.1e}  "
              + ", ".join(f"{n[:32]} {u:.1f} us" for n, u in kernels), flush=True)

    def pair(k: torch.Tensor, v: torch.Tensor) -> Callable[[PagedOperand], torch.Tensor]:
        return lambda op: k if op is kv.key else v

    k4, v4 = shipped(kv.key), shipped(kv.value)
    assert k4 is not None and v4 is not None
    variant("the cache (block-interleaved, as shipped)", shipped)
    variant("head-major copies [1, H, S, D]", pair(k4.contiguous(), v4.contiguous()))
    k_t, v_t = k4[0].transpose(0, 1).contiguous(), v4[0].transpose(0, 1).contiguous()
    variant("token-major copies [S, H, D], K and V apart",
            pair(k_t.transpose(0, 1).unsqueeze(0), v_t.transpose(0, 1).unsqueeze(0)))
    both = torch.stack([k_t, v_t])
    variant("token-major, one buffer, K then V",
            pair(both[0].transpose(0, 1).unsqueeze(0), both[1].transpose(0, 1).unsqueeze(0)))
    del both
    inter = torch.stack([k_t, v_t], dim=1)                               # [S, 2, H, D]
    variant("token-major, interleaved a token at a time",
            pair(inter[:, 0].transpose(0, 1).unsqueeze(0), inter[:, 1].transpose(0, 1).unsqueeze(0)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
