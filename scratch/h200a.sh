set -uo pipefail
export PYTHONUNBUFFERED=1
SAGE_CUDA_ARCHS=none python -m pip install --no-build-isolation --no-deps -q -e . > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 540 python -m bench.e2e_bench --n 2048,4096,8192,16384 --d 128 --causal 0,1 --no-accuracy 2>&1 | tail -12
