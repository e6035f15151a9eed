#!/usr/bin/env bash
# One device call: build, then GPU tests + demo + benchmark. Full logs under $OUT; a short table last.
#   bash bench/gpu_run.sh quick   tests, demo, e2e bench at N ∈ {4K, 16K}, D=128
#   bash bench/gpu_run.sh full    tests, demo, full e2e bench
#   bash bench/gpu_run.sh bench   full e2e bench only
#   bash bench/gpu_run.sh prep    fused rope prep: its GPU tests, its profile and the generic one, e2e at 4K/16K D=128
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mode=${1:-quick}
MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
python -m sage_compile doctor 2>&1 | tee "$OUT/doctor.log"
if [ "$mode" = prep ]; then
  timeout 200 python -m pytest tests/gpu/test_prep_triton.py -x -q -p no:cacheprovider -s 2>&1 | tee "$OUT/prep_tests.log" | grep -E "cos vs|passed|failed|Error" | tail -6
  for a in --fused ""; do timeout 150 python -m bench.prep_profile --n 16384 $a 2>&1 | grep "wall"; done
  timeout 300 python -m bench.e2e_bench --n 4096,16384 --d 128 --causal 0,1 2>&1 | tee "$OUT/e2e.log" | tail -12
  exit 0
fi
if [ "$mode" != bench ]; then
  xdist=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
  python -m pytest tests/gpu -q -p no:cacheprovider $xdist 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
  python -m sage_compile demo --seq-len 1024 2>&1 | tee "$OUT/demo.log" | tail -4
fi
if [ "$mode" = quick ]; then
  python -m bench.e2e_bench --n 4096,16384 --d 128 2>&1 | tee "$OUT/e2e.log" | tail -12
else
  python -m bench.e2e_bench 2>&1 | tee "$OUT/e2e.log" | tail -40
fi
