#!/usr/bin/env bash
# One device call for the fused rope prep's Triton kernels: build, their GPU tests, the side-by-side A/B against
# another revision (tools/ab/prep_kernels.py), optionally an ncu summary of each prep kernel and the end-to-end bench.
#   REV=<git rev> [AB_ARGS="--n 4096,16384 --d 128"] [NCU=1] [E2E_N=4096,16384] bash bench/prep_check.sh
# TEST_ARGS is evaluated, so quoted pytest arguments survive: TEST_ARGS="-k 'mean or compiled'"
# SAGE_CUDA_ARCHS=none skips the sm90 build (the prep kernels are Triton; attention then runs on Triton too).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
t0=$(date +%s)
MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
rm -f "$OUT/install.log"
echo "build+install: $(( $(date +%s) - t0 )) s"
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0 skips them
  eval timeout ${TEST_TIMEOUT:-240} python -m pytest tests/gpu/test_prep_triton.py -q -p no:cacheprovider "${TEST_ARGS:-}" 2>&1 \
    | tee "$OUT/prep_tests.log" | grep -E "passed|failed|Error|error|assert" | tail -15
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
if [ -n "${REV:-}" ]; then
  timeout ${AB_TIMEOUT:-300} python tools/ab/prep_kernels.py --rev "$REV" ${AB_ARGS:-} 2>&1 | tail -60
  echo "A/B: $(( $(date +%s) - t0 )) s"
fi
if [ -n "${NCU:-}" ]; then  # one launch of each prep kernel at 16K tokens, D=128 (the A/B tool's inputs, fp32 tables)
  timeout 200 ncu -k regex:"_rope_quantize_kernel|_rope_sum_kernel|_absmax_sum_kernel|_v_quantize_kernel" -c 4 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section LaunchStats python -c "
import torch
from tools.ab.prep_kernels import inputs
from sage_compile import prep, spec
x, v, tables = inputs(16384, 128, torch.float32)
prep.rope_prepare(x, x, v, tables, tables, 128 ** -0.5, spec.Quantization()); torch.cuda.synchronize()
" > "$OUT/ncu_prep.txt" 2>&1
  grep -E "^  [a-z_]+_kernel|Duration|Memory Throughput|DRAM Throughput|L2 Hit|Achieved Occupancy|Registers Per|Theoretical Occ|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|Block Size|Grid Size" "$OUT/ncu_prep.txt" | head -80
fi
if [ -n "${E2E_N:-}" ]; then
  timeout ${E2E_TIMEOUT:-240} python -m bench.e2e_bench --n "$E2E_N" --d ${E2E_D:-128} --causal ${E2E_CAUSAL:-0} --no-accuracy 2>&1 | tail -14
fi
echo "total: $(( $(date +%s) - t0 )) s"
