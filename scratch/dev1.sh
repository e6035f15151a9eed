#!/usr/bin/env bash
# Device call 1: build old (scratch/old, the tree before the refactor) and new side by side, then before/after.
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
T0=$(date +%s)
(cd scratch/old && SAGE_CUDA_ARCHS=90a MAX_JOBS=8 python setup.py build_ext --inplace > "$OUT/old_build.log" 2>&1; echo "old build rc=$?") &
MAX_JOBS=8 python -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/install.log" 2>&1; echo "new build rc=$?"
wait
echo "builds: $(( $(date +%s) - T0 )) s"
tail -3 "$OUT/install.log"
mkdir -p "$OUT/so" && cp sage_compile/_sm90*.so sage_compile/_C*.so "$OUT/so/" 2>/dev/null
python -m sage_compile doctor 2>&1 | tee "$OUT/doctor.log" | tail -8
for round in 1 2; do
  for t in old new; do
    tree=$ROOT; [ $t = old ] && tree=$ROOT/scratch/old
    timeout 200 python scratch/ab_refactor.py "$tree" "$t" > "$OUT/ab_${t}_${round}.log" 2>&1 || echo "ab $t $round failed"
    tail -2 "$OUT/ab_${t}_${round}.log" | head -1
  done
done
python - <<'EOF'
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
    o, n = by.get("old"), by.get("new")
    if o and n:
        print(f"{what:45s} old {med(o):8.3f} new {med(n):8.3f} ms  new/old {med(n) / med(o):.3f}  {o} {n}")
EOF
