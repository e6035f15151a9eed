set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
t0=$(date +%s)
SAGE_CUDA_ARCHS=none MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -e . > /tmp/install.log 2>&1 || tail -20 /tmp/install.log
git worktree add -f /tmp/old $REV 2>&1 | tail -1
cp sage_compile/*.so /tmp/old/sage_compile/; cp tools/host_overhead.py /tmp/old/tools/
run() { timeout 150 python tools/host_overhead.py --n ${N:-1024,4096} --layers --calls 500 > $OUT/host_$1.txt 2>&1; grep -E "^N=" $OUT/host_$1.txt | grep -v "layer dispatch.choose\|torch.empty\|sm90.run " | sed "s/^/$1 /"; }
run new1
(cd /tmp/old && python -c "import sage_compile; print('old tree:', sage_compile.__file__)" && run old)
run new2
echo total $(( $(date +%s)-t0 ))s
