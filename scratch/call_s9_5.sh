set -uo pipefail
export PYTHONUNBUFFERED=1
cp csrc/sm90/attention.cu /tmp/new.cu
bash bench/sm90_check.sh none > $OUT/check.log 2>&1; grep -E "build|FAIL|smoke" $OUT/check.log | tail -3
cp sage_compile/_sm90*.so /tmp/new_sm90.so; so=$(ls sage_compile/_sm90*.so)
cp scratch/attention_orig.cu csrc/sm90/attention.cu
MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -e . > $OUT/install_base.log 2>&1 || tail -5 $OUT/install_base.log
cp sage_compile/_sm90*.so /tmp/base_sm90.so; cp /tmp/new.cu csrc/sm90/attention.cu; cp /tmp/new_sm90.so "$so"
timeout 200 python scratch/ab_prologue.py 2>&1 | tail -8
timeout 150 python -m pytest tests/gpu/test_sm90_kernel.py -x -q -p no:cacheprovider 2>&1 | tail -2
