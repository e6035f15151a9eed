#!/usr/bin/env bash
# One device call for the native sm90 kernel: build (ptxas report), SASS mix, its GPU tests, kernel bench.
#   bash bench/sm90_check.sh [test|bench|all] [kernel_bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mode=${1:-all}; shift || true
t0=$(date +%s)
MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
echo "build+install: $(( $(date +%s) - t0 )) s"
grep -E "nvcc|WARNING" "$OUT/install.log" | grep -v "^ *$" | cut -c1-300 | tail -3
so=$(ls sage_compile/_sm90*.so 2>/dev/null) || { echo "no _sm90 extension built"; exit 1; }
cuobjdump --dump-sass "$so" > "$OUT/sm90.sass" 2>&1
echo "SASS mix:"; grep -oE "(IGMMA|QGMMA|HGMMA|LDL|STL|MUFU\.EX2|F2FP\.SATFINITE\.E4M3)" "$OUT/sm90.sass" | sort | uniq -c
python -c "from sage_compile.kernels import sm90; print({d: sm90.kernel_info(d) for d in sm90.HEAD_DIMS})"
if [ "$mode" != bench ]; then
  timeout 300 python -m pytest tests/gpu/test_sm90_kernel.py -x -q -p no:cacheprovider -s 2>&1 | tee "$OUT/sm90_tests.log" | grep -E "accuracy|passed|failed|Error|error|assert" | tail -25
fi
if [ "$mode" != test ]; then
  timeout 400 python -m bench.kernel_bench "$@" 2>&1 | tee "$OUT/kernel_bench.log" | tail -30
fi
