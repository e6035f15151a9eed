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
python -c "from sage_compile.kernels import sm90; print({(d, v): sm90.kernel_info(d, v) for d in sm90.HEAD_DIMS for v in (0, 1)})"
# Smoke test first: a hung kernel costs 30 s, not the whole call.
timeout 60 python - <<'PY' || { echo "SMOKE TEST FAILED OR HUNG"; exit 1; }
import torch
from sage_compile import spec
from sage_compile.kernels import KernelArgs, sm90
q, k, v = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
p = spec.prepare(q, k, v, 128 ** -0.5, spec.Quantization())
a = KernelArgs(p.q, p.q_scale, p.k, p.k_scale, p.v, p.v_scale, None, None, None, 128, 0, 128, torch.bfloat16)
out = torch.full((1, 2, 300, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
lse = torch.empty(1, 2, 300, device="cuda")
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
for variant in (0, 1):
    out.fill_(float("nan"))
    sm90.run(a, out, lse, variant); torch.cuda.synchronize()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()
    print(f"smoke variant {variant}: cos {cos:.6f}")
PY
if [ "$mode" = profile ]; then  # stall reasons and pipe use of one launch (D=128, N=16K)
  timeout 240 ncu -k regex:attention_kernel -c 1 --launch-skip 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
    python tools/sm90_one_launch.py 16384 128 0 > "$OUT/ncu.txt" 2>&1; tail -120 "$OUT/ncu.txt" | cut -c1-150
  xdist=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
  timeout 280 python -m pytest tests/gpu -q -p no:cacheprovider $xdist 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
  exit 0
fi
if [ "$mode" != bench ]; then
  timeout ${TEST_TIMEOUT:-150} python -m pytest tests/gpu/test_sm90_kernel.py -x -q -p no:cacheprovider -s 2>&1 | tee "$OUT/sm90_tests.log" | grep -E "accuracy|passed|failed|Error|error|assert" | tail -25
fi
if [ "$mode" != test ]; then
  timeout ${BENCH_TIMEOUT:-300} python -m bench.kernel_bench "$@" 2>&1 | tee "$OUT/kernel_bench.log" | tail -30
fi
if [ "$mode" = all ] && [ -n "${E2E_N:-}" ]; then  # end to end, sm90 vs Triton kernels behind the same fused prep
  mkdir -p "$OUT/sm90" "$OUT/triton"
  OUT=$OUT/sm90 timeout 200 python -m bench.e2e_bench --n "$E2E_N" --d 128 --causal 0,1 2>&1 | tail -8
  OUT=$OUT/triton SAGE_KERNELS=triton,cpu,reference timeout 200 python -m bench.e2e_bench --n "$E2E_N" --d 128 --causal 0,1 2>&1 | tail -8
fi
