set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
t0=$(date +%s)
SAGE_CUDA_ARCHS=none MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail -20 $OUT/install.log
echo install $(( $(date +%s)-t0 ))s
git worktree add -f /tmp/old ${REV:-HEAD} 2>&1 | tail -2; git log --oneline -3 | cat
cp sage_compile/*.so /tmp/old/sage_compile/; cp tools/host_overhead.py /tmp/old/tools/
(cd /tmp/old && python -c "import sage_compile; print('old tree:', sage_compile.__file__)" && timeout 200 python tools/host_overhead.py --n ${N:-1024,4096} --layers --calls 500 > $OUT/host_old.txt 2>&1; grep -E "^N=" $OUT/host_old.txt | sed 's/^/old /')
python -c "import sage_compile; print('new tree:', sage_compile.__file__)"
timeout 200 python tools/host_overhead.py --n ${N:-1024,4096} --layers --calls 500 > $OUT/host_new.txt 2>&1; grep -E "^N=" $OUT/host_new.txt | sed 's/^/new /'
echo total $(( $(date +%s)-t0 ))s
