set -uo pipefail
export PYTHONUNBUFFERED=1
SAGE_CUDA_ARCHS=none python -m pip install --no-build-isolation --no-deps -q -e . > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
timeout 250 python -m pytest tests/gpu/test_prep_triton.py -q -p no:cacheprovider -x -n 4 2>&1 | tail -3
timeout 200 python tools/ab/prep_kernels.py --rev scratch/prep_triton_3launch.py --tables bf16 --d 128,64 --n 4096,16384 --reps 3 --compiled 2>&1 | grep -E "whole|compiled|Error" | tail -14
cp $OUT/prep_kernels_ab.json $OUT/prep_kernels_ab_reduce_s21.json 2>/dev/null; rm -f $OUT/prep_kernels_ab.json
timeout 100 python -m bench.prep_profile --fused --n 4096 --d 128 2>&1 | grep -E "wall|_kernel|triton_" | cut -c1-60,150-185 | head -12
rm -f $OUT/prep_code.py
timeout 150 python -m bench.e2e_bench --n 4096,8192,16384 --d 128 --causal 0 --no-accuracy 2>&1 | tail -5
