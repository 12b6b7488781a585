"""Run ``vllm-attn`` under ``torchrun`` with a watchdog: after ``TP_PROBE_TIMEOUT``
seconds (default 60) every rank prints the Python stack of each of its threads and
exits, so a hung collective shows where each rank waits.

    torchrun --nproc-per-node 2 tools/tp_probe.py generate --model random-mla \\
        --backend TRITON_MLA --device cuda --prompt-token-ids 5,6,7
"""

from __future__ import annotations

import faulthandler
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    faulthandler.dump_traceback_later(float(os.environ.get("TP_PROBE_TIMEOUT", "60")),
                                      exit=True)
    from vllm.cli import main

    code = main(sys.argv[1:])
    print(f"rank {os.environ.get('RANK')}: exit {code}", file=sys.stderr)
    sys.exit(code)
