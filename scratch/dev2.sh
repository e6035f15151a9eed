#!/usr/bin/env bash
# Device call: build pre (scratch/pre: main before the special-value rule) and new, then e2e before/after.
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
T0=$(date +%s)
(cd scratch/pre && SAGE_CUDA_ARCHS=90a MAX_JOBS=8 python setup.py build_ext --inplace > "$OUT/pre_build.log" 2>&1; echo "pre build rc=$?") &
MAX_JOBS=8 python -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/install.log" 2>&1; echo "new build rc=$?"
wait
echo "builds: $(( $(date +%s) - T0 )) s"
for round in 1 2; do
  for t in pre new; do
    tree=$ROOT; [ $t = pre ] && tree=$ROOT/scratch/pre
    timeout 150 python scratch/ab_refactor.py "$tree" "$t" e2e > "$OUT/ab_${t}_${round}.log" 2>&1 || echo "ab $t $round failed"
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
med = lambda xs: sorted(xs)[len(xs) // 2]
for what, by in rows.items():
    o, n = by.get("pre"), by.get("new")
    if o and n:
        print(f"{what:45s} pre {med(o):8.3f} new {med(n):8.3f} ms  new/pre {med(n) / med(o):.3f}  {[round(x, 3) for x in o]} {[round(x, 3) for x in n]}")
PY
