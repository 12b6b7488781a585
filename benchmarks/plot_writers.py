"""Plot write GB/s against tokens from a bench_writers.py JSON, with the copy ceiling
of the same run. Usage: python benchmarks/plot_writers.py RESULTS.json OUT.png"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(src: str, dst: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    ceiling = data["meta"]["copy_gbps"]
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in data["rows"]:
        if not row.get("error"):
            series[row["config"]].append((row["num_tokens"], row["call_gbps"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in sorted(series.items()):
        pts.sort()
        style = {"color": "grey", "ls": ":", "lw": 2.5} if name.startswith("baseline/") else {}
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name,
                **style)
    ax.axhline(ceiling, color="k", ls="--", label=f"eager copy_ ceiling {ceiling:.0f} GB/s")
    baseline = data["meta"].get("index_copy_gbps")
    if baseline and "baseline/index_copy_" not in series:
        ax.axhline(baseline, color="grey", ls=":", label=f"index_copy_ {baseline:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens written (random slots)")
    ax.set_ylabel("GB/s per write() call (bytes read + written)")
    ax.set_title(f"KV-cache writers on {data['meta']['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
