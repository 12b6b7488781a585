#!/usr/bin/env bash
# One batched session on the lent GPU machine: GPU tests, the conformance kit on
# CUDA, the registry table, and the benchmarks. Everything lands under $OUT.
# Usage (on the device machine, repo root): bash tools/gpu_session.sh [tests] [check] [bench] | all
set -u
what=" ${*:-all} "
FINAL=${OUT:-/tmp/out}
OUT=/tmp/gpu_logs
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d /tmp/fa4site ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4site
fi
python3 - <<'PY' | tee "$OUT/env.txt"
import site, os
if os.path.isdir("/tmp/fa4site"):
    site.addsitedir("/tmp/fa4site")
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
try:
    import flash_attn.cute as fa
    print("flash_attn.cute", getattr(fa, "__version__", "?"))
except Exception as e:
    print("flash_attn.cute not importable:", type(e).__name__, e)
PY
if [[ "$what" == *" tests "* || "$what" == *" all "* ]]; then
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests} --maxfail=30 2>&1 | tail -n 150 > "$OUT/gpu_tests.txt" ; echo "pytest rc=${PIPESTATUS[0]}" >> "$OUT/gpu_tests.txt"
  tail -n 5 "$OUT/gpu_tests.txt"
fi
if [[ "$what" == *" check "* || "$what" == *" all "* ]]; then
  timeout 300 python3 -m vllm.cli backends --device cuda > "$OUT/backends_cuda.txt" 2>&1
  timeout 240 python3 -m vllm.cli check --device cuda > "$OUT/check_cuda.txt" 2>&1; echo "check rc=$?" >> "$OUT/check_cuda.txt"
  tail -n 30 "$OUT/check_cuda.txt"
fi
if [[ "$what" == *" bench "* || "$what" == *" all "* ]]; then
  for b in benchmarks/bench_*.py; do
    name=$(basename "$b" .py)
    timeout ${BENCH_TIMEOUT:-150} python3 "$b" --out "$OUT" > "$OUT/$name.txt" 2>&1; echo "$name rc=$?" >> "$OUT/$name.txt"
    tail -n 25 "$OUT/$name.txt"
  done
fi
tar -czf "$FINAL/results.tgz" -C "$OUT" .
for f in env gpu_tests check_cuda backends_cuda; do [ -f "$OUT/$f.txt" ] && cp "$OUT/$f.txt" "$FINAL/"; done
ls "$FINAL" | head -n 8
