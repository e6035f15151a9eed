set -uo pipefail
export PYTHONUNBUFFERED=1
SAGE_CUDA_ARCHS=none python -m pip install --no-build-isolation --no-deps -q -e . > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
python -c "from sage_compile.kernels import sm90; print('sm90 ok')"
timeout 200 python -m pytest tests/gpu/test_prep_triton.py -q -p no:cacheprovider -x -k "v_one_launch or v_quantize or compiled_rotary" 2>&1 | tail -3
timeout 120 python tools/ab/v_one_launch.py --rev scratch/prep_triton_3launch.py 2>&1 | tail -6
timeout 200 python tools/ab/prep_kernels.py --rev scratch/prep_triton_3launch.py --tables bf16 --d 128 --n 4096,16384 --reps 3 --compiled 2>&1 | tail -22
cp $OUT/prep_kernels_ab.json $OUT/prep_kernels_ab_s21.json 2>/dev/null
timeout 150 python tools/determinism.py --reps 300 2>&1 | grep -E "runs differ|Error" | tail -12
timeout 150 python -m bench.e2e_bench --n 4096,8192,16384 --d 128 --causal 0 --no-accuracy 2>&1 | tail -8
