set -uo pipefail
export PYTHONUNBUFFERED=1
MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -q -e . > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
timeout 150 python tools/determinism.py --reps 30 2>&1 | grep -E "runs differ|Error|Traceback" | tail -10
timeout 100 python tools/ab/amax_in_flight.py 2>&1 | grep -E "^N=4096|Error|Traceback" | head -12
timeout 200 python tools/ab/prep_kernels.py --rev HEAD --tables bf16 --d 128 --n 4096 --reps 1 --cold-sweep 2>&1 | grep -E "sampled sums|amax|Error|Traceback" | head -8
