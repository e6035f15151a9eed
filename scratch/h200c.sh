set -uo pipefail
export PYTHONUNBUFFERED=1
SAGE_CUDA_ARCHS=none python -m pip install --no-build-isolation --no-deps -q -e . > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
timeout 330 python tools/ab/prep_kernels.py --rev HEAD --tables bf16 --d 128 --n 4096,16384 --reps 1 --sweep > $OUT/sweep.log 2>&1
mv $OUT/prep_kernels_ab.json $OUT/prep_sweep_h200.json
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/prep_sweep_h200.json"))
for sh in d["shapes"]:
    print("N", sh["n"], "D", sh["d"])
    for r in sorted(sh.get("quantize_sweep", []), key=lambda r: (r["per_thread"], r["ms"]))[:20]:
        print("  quantize pt=%d block %d warps %d: %.1f us (%.2fx)" % (r["per_thread"], r["block"], r["warps"], r["ms"]*1e3, r["ms"]/r["floor_ms"]))
    for r in sorted(sh.get("v_sweep", []), key=lambda r: r["ms"])[:5]:
        print("  v quantize block %d warps %d: %.1f us (%.2fx)" % (r["block"], r["warps"], r["ms"]*1e3, r["ms"]/r["floor_ms"]))
    for r in sorted(sh.get("sum_sweep", []), key=lambda r: r["amax_ms"])[:5]:
        print("  amax block %d tiles %d warps %d: %.1f us (%.2fx)" % (r["block"], r["tiles"], r["warps"], r["amax_ms"]*1e3, r["amax_ms"]/r["floor_ms"]))
PY
grep -E "^  (Q|K|V)" $OUT/sweep.log | head -12
