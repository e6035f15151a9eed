set -uo pipefail
export PYTHONUNBUFFERED=1
SAGE_CUDA_ARCHS=none python -m pip install --no-build-isolation --no-deps -q -e . > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
timeout 60 python -m bench.prep_profile --fused --n 4096 --d 128 2>&1 | grep -E "wall|_kernel |_kernel_|triton_" | cut -c1-60,150-185 | head -12
rm -f $OUT/prep_code.py
timeout 200 python -m bench.e2e_bench --n 4096,8192,16384 --d 64 --causal 0,1 --no-accuracy 2>&1 | tail -7
cp $OUT/e2e_bench.json $OUT/e2e_bench_d64.json
timeout 320 python -m pytest tests/gpu -q -p no:cacheprovider -n 8 2>&1 | tail -4
