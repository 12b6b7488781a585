"""What an fp8 score MMA would cost the MLA decode in accuracy, emulated in float64 on
the CPU: with an E4M3 cache the scores could run as fp8 MMAs (twice the 16-bit rate,
no widening of the keys) if the absorbed query were quantised to E4M3 too (a power of
two a head putting its largest magnitude at the format's largest), and P could go to
E4M3 for fp8 value MMAs. Each line: the relative Frobenius error of one token's
output (128 heads, 576-wide query rows, 4096 cached rows of E4M3 times 0.37) against
the exact float64 attention over the same (dequantised) cache, for P in bfloat16 (what
the kernels do), the query in E4M3, and both in E4M3; on random rows and on rows where
eight keys line up with the queries (a peaked softmax).

    python benchmarks/mla_fp8_query_error.py
"""

from __future__ import annotations

import sys

import torch

L, R, HEADS, ROWS, K_SCALE = 512, 64, 128, 4096, 0.37
SCALE = (128 + 64) ** -0.5
TOLERANCE_BF16 = 2e-2
"""The MLA backends' bfloat16 tolerance (relative Frobenius error against float64)."""


def as_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to E4M3 a row at a time, scaled by the power of two that puts the
    row's largest magnitude at or below 448 (E4M3's largest), and scaled back."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    up = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return (x * up).to(torch.float8_e4m3fn).to(torch.float64) / up


def attend(q: torch.Tensor, cache: torch.Tensor, p_dtype: torch.dtype | None) -> torch.Tensor:
    """Softmax attention of ``q`` over ``cache``'s rows (values: the first ``L``
    columns), in float64 but for P rounded to ``p_dtype`` (relative to its row maximum,
    as the kernels hold it) when given."""
    p = torch.softmax(q @ cache.T * SCALE, -1)
    if p_dtype is not None:
        top = p.amax(-1, keepdim=True)
        p = (p / top).to(p_dtype).to(torch.float64) * top
    return (p @ cache[:, :L]) / p.sum(-1, keepdim=True)


def main() -> int:
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for peaked in (False, True):
        q = torch.randn(HEADS, L + R, generator=g, dtype=torch.float64)
        q = q.to(torch.bfloat16).to(torch.float64)
        stored = (torch.randn(ROWS, L + R, generator=g, dtype=torch.float64) * 0.5)
        if peaked:  # eight keys along the heads' mean query
            stored[:8] = q.mean(0) * 0.4
        cache = stored.to(torch.float8_e4m3fn).to(torch.float64) * K_SCALE
        exact = attend(q, cache, None)

        def error(out: torch.Tensor) -> float:
            return float((out - exact).norm() / exact.norm())

        rows = {"P bf16 (the kernels)": error(attend(q, cache, torch.bfloat16)),
                "query E4M3, P bf16": error(attend(as_e4m3(q), cache, torch.bfloat16)),
                "query E4M3, P E4M3": error(attend(as_e4m3(q), cache, torch.float8_e4m3fn))}
        print(f"{'peaked' if peaked else 'random'} rows:")
        for name, err in rows.items():
            print(f"  {name:22s} {err:.2e}")
        worst = max(worst, rows["query E4M3, P bf16"])
    print(f"bf16 tolerance {TOLERANCE_BF16:.0e}; the E4M3 query's worst: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
