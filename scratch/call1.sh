set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -q -e . > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"; cp sage_compile/_sm90*.so $OUT/
timeout 240 python tools/determinism.py --reps 300 2>&1 | grep -v Warning | tail -12
timeout 100 python tools/determinism.py --reps 200 --causal 1 2>&1 | grep -v Warning | tail -12
timeout 120 python -m bench.prep_profile --fused --n 4096 --d 128 2>&1 | tail -30
