#!/usr/bin/env bash
# Final device call: build main (this tree) and pre (scratch/pre: main before the special-value rule); the whole GPU
# suite on this tree; then e2e before/after the special-value rule.
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
T0=$(date +%s)
(cd scratch/pre && SAGE_CUDA_ARCHS=90a MAX_JOBS=6 python setup.py build_ext --inplace > "$OUT/pre_build.log" 2>&1; echo "pre build rc=$?") &
MAX_JOBS=10 python -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/install.log" 2>&1; echo "new build rc=$?"
wait
echo "builds: $(( $(date +%s) - T0 )) s"
python -m sage_compile doctor > "$OUT/doctor.log" 2>&1
timeout 330 python -m pytest tests/gpu -q -p no:cacheprovider -n 8 > "$OUT/gpu_tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -15
for round in 1 2; do
  for t in pre new; do
    tree=$ROOT; [ $t = pre ] && tree=$ROOT/scratch/pre
    timeout 120 python scratch/ab_refactor.py "$tree" "$t" e2e > "$OUT/ab_${t}_${round}.log" 2>&1 || echo "ab $t $round failed"
  done
done
python - <<'PY'
import json, glob, os, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
dev = ""
for path in sorted(glob.glob(os.path.join(os.environ["OUT"], "ab_*_*.log"))):
    for line in open(path):
        if line.startswith("JSON"):
            d = json.loads(line[4:]); dev = d["device"]
            for r in d["rows"]:
                rows[r["what"]][d["label"]].append(r["ms"])
print(dev)
for what, by in rows.items():
    o, n = by.get("pre"), by.get("new")
    if o and n:
        print(f"{what:45s} pre {min(o):8.3f} new {min(n):8.3f} ms (best of rounds)  new/pre {min(n) / min(o):.3f}  {[round(x, 3) for x in o]} {[round(x, 3) for x in n]}")
PY
