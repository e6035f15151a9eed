#!/usr/bin/env bash
# One device call for the native sm90 kernel: build (ptxas report), SASS mix, its GPU tests, kernel bench.
#   bash bench/sm90_check.sh [test|bench|all|none] [kernel_bench args...]
# PROFILE_VARIANT="v ..." adds an ncu profile (full set, per-instruction stall samples) of launch variant v at
# D=128, N=16K (PROFILE_ARGS="N D causal" to change); GPU_SUITE=1 then runs the whole tests/gpu suite.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mode=${1:-all}; shift || true
t0=$(date +%s)
MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
echo "build+install: $(( $(date +%s) - t0 )) s"
grep -E "nvcc|WARNING" "$OUT/install.log" | grep -v "^ *$" | cut -c1-300 | tail -3
so=$(ls sage_compile/_sm90*.so 2>/dev/null) || { echo "no _sm90 extension built"; exit 1; }
cuobjdump --dump-sass "$so" > "$OUT/sm90.sass" 2>&1
echo "SASS mix:"; grep -oE "(IGMMA|QGMMA|HGMMA|LDL|STL|MUFU\.EX2|F2FP\.SATFINITE\.E4M3|F2FP\.F16)" "$OUT/sm90.sass" | sort | uniq -c
python -c "from sage_compile.kernels import sm90; print({(d, v, pt, bias): sm90.kernel_info(d, v, pt, bias) for d in sm90.HEAD_DIMS for v in range(len(sm90.VARIANTS)) for pt in (False, True) for bias in (False, True) if (v or not bias) and sm90.variant_covers(v, d)})"
# Smoke test first: a hung kernel costs 30 s, not the whole call.
timeout 60 python - <<'PY' || { echo "SMOKE TEST FAILED OR HUNG"; exit 1; }
import torch
from sage_compile import spec
from sage_compile.kernels import KernelArgs, sm90
q, k, v = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = torch.full((1, 2, 300, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
lse = torch.empty(1, 2, 300, device="cuda")
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
for k_granularity in ("per_token", "per_thread"):
    p = spec.prepare(q, k, v, 128 ** -0.5, spec.Quantization(k_granularity=k_granularity))
    a = KernelArgs.from_prepared(p, None, 0, 128, torch.bfloat16)
    for variant in (v for v in range(len(sm90.VARIANTS)) if sm90.variant_covers(v, 128)):
        out.fill_(float("nan"))
        sm90.run(a, out, lse, variant); torch.cuda.synchronize()
        cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()
        print(f"smoke K {k_granularity} variant {variant}: cos {cos:.6f}")
keep = torch.rand(1, 1, 300, 300, device="cuda") > 0.2  # a bool mask through the biased instantiation
p = spec.prepare(q, k, v, 128 ** -0.5, spec.Quantization(smooth_q=True))
a = KernelArgs.from_prepared(p, None, 0, 128, torch.bfloat16, keep)
out.fill_(float("nan"))
sm90.run(a, out, lse, 2); torch.cuda.synchronize()
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()
print(f"smoke bool mask + ΔS variant 2: cos {cos:.6f}")
PY
# The fp16-PV kernels, D=128 and 64, tensor maps (Nk=1024) and cp.async (Nk=301), plain and with a key-padding
# mask; a failure here is reported, the rest still runs.
timeout 60 python - <<'PY' || echo "PV16 SMOKE TEST FAILED OR HUNG"
import torch
from sage_compile import spec
from sage_compile.kernels import KernelArgs, sm90
print({(d, v, b): sm90.kernel_info(d, v, biased=b, pv16=True) for d, vs in sm90.PV16_VARIANTS.items() for v in vs
       for b in (False, True)})
for d in (128, 64):
    for n_k in (1024, 301):
        q = torch.randn(1, 2, 300, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, n_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pad = (torch.arange(n_k, device="cuda") < n_k - 37).view(1, 1, 1, n_k)
        for mask in (None, pad):
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
            out = torch.full((1, 2, 300, d), float("nan"), device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(1, 2, 300, device="cuda")
            for pv in ("fp8", "fp16"):
                p = spec.prepare(q, k, v, d ** -0.5, spec.Quantization(pv=pv))
                a = KernelArgs.from_prepared(p, None, 0, d, torch.bfloat16, spec.mask_operand(mask, q, k))
                out.fill_(float("nan"))
                sm90.run(a, out, lse); torch.cuda.synchronize()
                err = ((out.float() - ref).abs().sum() / ref.abs().sum()).item()
                print(f"smoke pv {pv:4s} D{d} Nk {n_k} mask {mask is not None}: relL1 vs fp32 {err:.4f}")
PY
if [ "$mode" = test ] || [ "$mode" = all ]; then
  timeout ${TEST_TIMEOUT:-240} python -m pytest tests/gpu/test_sm90_kernel.py -x -q -p no:cacheprovider -s ${TEST_ARGS:-} 2>&1 | tee "$OUT/sm90_tests.log" | grep -E "accuracy|passed|failed|Error|error|assert" | tail -25
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  timeout ${BENCH_TIMEOUT:-300} python -m bench.kernel_bench "$@" 2>&1 | tee "$OUT/kernel_bench.log" | tail -30
fi
if [ "$mode" = all ] && [ -n "${E2E_N:-}" ]; then  # end to end, sm90 vs Triton kernels behind the same fused prep
  mkdir -p "$OUT/sm90" "$OUT/triton"
  OUT=$OUT/sm90 timeout 200 python -m bench.e2e_bench --n "$E2E_N" --d 128 --causal 0,1 2>&1 | tail -8
  OUT=$OUT/triton SAGE_KERNELS=triton,cpu,reference timeout 200 python -m bench.e2e_bench --n "$E2E_N" --d 128 --causal 0,1 2>&1 | tail -8
fi
for pv in ${PROFILE_VARIANT:-}; do  # e.g. PROFILE_VARIANT="1 3"
  SAGE_SM90_VARIANT=$pv timeout 300 ncu -k regex:attention_kernel -c 1 --launch-skip 1 --set full \
    --import-source yes -o "$OUT/sm90_v$pv" python tools/sm90_one_launch.py ${PROFILE_ARGS:-16384 128 0} \
    > "$OUT/ncu_run_v$pv.log" 2>&1 || tail -5 "$OUT/ncu_run_v$pv.log"
  rep="$OUT/sm90_v$pv.ncu-rep"
  ncu --import "$rep" --print-summary none > "$OUT/ncu_details_v$pv.txt" 2>&1
  ncu --import "$rep" --page source --csv --print-source sass > "$OUT/ncu_source_v$pv.csv" 2>&1
  rm -f "$rep"
  echo "== ncu, variant $pv"
  python tools/ncu_hotspots.py "$OUT/ncu_details_v$pv.txt" "$OUT/ncu_source_v$pv.csv" > "$OUT/ncu_hotspots_v$pv.txt" 2>&1
  head -${PROFILE_LINES:-40} "$OUT/ncu_hotspots_v$pv.txt"; rm -f "$OUT/ncu_source_v$pv.csv" "$OUT/ncu_run_v$pv.log"
done
if [ -n "${GPU_SUITE:-}" ]; then  # the whole GPU test suite (all kernels, the pipeline, CUDA graphs)
  xdist=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
  timeout ${SUITE_TIMEOUT:-480} python -m pytest tests/gpu -q -p no:cacheprovider $xdist --durations=12 2>&1 | tee "$OUT/gpu_tests.log" | tail -20
fi
