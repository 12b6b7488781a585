#!/usr/bin/env bash
# One batched session on the lent GPU machine. Phases (any order, several per call):
#   tests  - every gpu-marked test, one pytest process per area (a CUDA fault in one
#            area cannot poison the next), full logs
#   check  - `vllm-attn backends` and `vllm-attn check` on CUDA
#   bench  - every benchmarks/bench_*.py with --out
# Logs and benchmark JSON are tarred into $OUT/results.tgz (the device returns at most
# 8 files); a few summaries are copied beside it.
# Usage (device machine, repo root): bash tools/gpu_session.sh tests [check] [bench]
# Durations seen on an H200 (2026-11-30), warm Triton cache excluded: writers 45 s, ops 55 s,
# property (SWEEP=40) 100 s, mla 45 s, runner 150 s (the every-backend file), speed 25 s;
# backends over 220 s (210 of about 265 tests by then, fifth session);
# bench_writers + bench_launch + bench_fused_rope together 90 s. One call may run 600 s:
# split the areas over two calls (AREAS=...) when running everything.
set -u
what=" $* "
FINAL=${OUT:-/tmp/out}
LOGS=/tmp/gpu_logs
mkdir -p "$LOGS" "$FINAL"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -d /tmp/fa4site ] && export PYTHONPATH=$PYTHONPATH:/tmp/fa4site
python3 - <<'PY' | tee "$LOGS/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
try:
    import flash_attn.cute as fa
    print("flash_attn.cute importable", getattr(fa, "__version__", "?"))
except Exception as e:
    print("flash_attn.cute not importable:", type(e).__name__, e)
PY
run_tests() {  # name, timeout, paths...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider "$@" > "$LOGS/test_$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$LOGS/summary.txt"
  grep -E "passed|failed" "$LOGS/test_$name.txt" | tail -n 1 | tee -a "$LOGS/summary.txt"
  grep -E "^FAILED|^ERROR" "$LOGS/test_$name.txt" | head -n 8 | tee -a "$LOGS/summary.txt"
}
# AREAS picks the test areas of the tests phase (default: all, in this order)
areas=" ${AREAS:-writers ops property mla runner speed} "
if [[ "$what" == *" tests "* ]]; then
  [[ "$areas" == *" writers "* ]] && run_tests writers ${T_WRITERS:-120} tests/writers
  [[ "$areas" == *" ops "* ]] && run_tests ops ${T_OPS:-90} tests/ops
  [[ "$areas" == *" property "* ]] && VLLM_KV_GPU_SWEEP=${SWEEP:-60} run_tests property ${T_PROP:-150} tests/property tests/test_fp8_edges.py
  [[ "$areas" == *" mla "* ]] && run_tests mla ${T_MLA:-120} tests/mla
  [[ "$areas" == *" runner "* ]] && VLLM_GPU_REPORT_DIR=$LOGS run_tests runner ${T_RUNNER:-240} tests/runner
  [[ "$areas" == *" speed "* ]] && run_tests speed ${T_SPEED:-90} tests/speed
fi
if [[ "$what" == *" backends "* ]]; then
  run_tests backends ${T_BACKENDS:-200} tests/backends
fi
if [[ "$what" == *" check "* ]]; then
  timeout 60 python3 -m vllm.cli backends --device cuda > "$LOGS/backends_cuda.txt" 2>&1
  timeout ${T_CHECK:-200} python3 -m vllm.cli check --device cuda > "$LOGS/check_cuda.txt" 2>&1
  echo "check rc=$?" | tee -a "$LOGS/summary.txt"; tail -n 25 "$LOGS/check_cuda.txt"
fi
if [[ "$what" == *" bench "* ]]; then
  mkdir -p "$LOGS/bench"
  for b in ${BENCHES:-benchmarks/bench_*.py}; do
    name=$(basename "$b" .py)
    timeout ${T_BENCH:-90} python3 "$b" --out "$LOGS/bench" > "$LOGS/bench/$name.txt" 2>&1
    echo "$name rc=$?" | tee -a "$LOGS/summary.txt"; tail -n 12 "$LOGS/bench/$name.txt"
  done
fi
tar -czf "$FINAL/results.tgz" -C "$LOGS" .
for f in summary env backends_cuda check_cuda gpu_every_backend; do [ -f "$LOGS/$f.txt" ] && cp "$LOGS/$f.txt" "$FINAL/"; done
cat "$LOGS/summary.txt" 2>/dev/null
