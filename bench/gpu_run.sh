#!/usr/bin/env bash
# One call on a GPU machine: build, then what it is told; full logs under $OUT, a short table last.
#   bash bench/gpu_run.sh quick    GPU tests, demo, e2e bench at N ∈ {4K, 16K}, D=128
#   bash bench/gpu_run.sh full     GPU tests, demo, the full e2e bench
#   bash bench/gpu_run.sh bench    the full e2e bench only
#   bash bench/gpu_run.sh tests [pytest args]   GPU tests only (default tests/gpu); the whole suite runs ~8 min with
#                                            -n 8, so within one 10-minute device call run it in halves, e.g.
#                                            tests/gpu/test_[a-p]*.py, then tests/gpu/test_[r-z]*.py; cut after
#                                            GPU_TESTS_SECONDS (480), it lists the unfinished tests, and each
#                                            failure's traceback is in $OUT/failures.log as it happens
#   bash bench/gpu_run.sh <name> [options]   one benchmark (kernel, int4, eager, e2e, models, accuracy, spec, backward, train,
#                                            context_parallel, varlen), e.g. `kernel --quick`
#   bash bench/gpu_run.sh sweep <variant>...  the shipped config vs inductor (bench e2e --default-only --rounds 3
#                                            --record, N 1K-64K, D 128/64, causal 0/1) per variant: a --producer
#                                            (half, interleaved, qknorm_half, qknorm_interleaved, none),
#                                            key_padding (--mask) or gqa4 (--gqa 4)
#   bash bench/gpu_run.sh static_sweep <variant>...  the same at N 1K-8K (where the thresholds choose), both compiled
#                                            per shape (--static, 3 rounds)
# Add --record to a benchmark's options to replace its device's (and variant's) entry of docs/results/<bench>.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
mode=${1:-quick}
[ $# -gt 0 ] && shift
MAX_JOBS=16 python -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
python -m sage_compile doctor 2>&1 | tee "$OUT/doctor.log"
gpu_tests() {
  xdist=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
  # the tests' own result files (accuracy_*.json, minilm.json) go into one archive: few files come back from a device
  mkdir -p "$OUT/tests"
  # -v: each test's result is logged as it ends, so a run cut by the time limit (GPU_TESTS_SECONDS, default 480:
  # a device call's 10 minutes less the build) still says what passed and failed, and what had not finished
  # (SAGE_TEST_FAILURES first: a prefix assignment sees the ones before it, and OUT changes)
  SAGE_TEST_FAILURES="$OUT/failures.log" OUT="$OUT/tests" timeout "${GPU_TESTS_SECONDS:-480}" \
    python -m pytest -v -p no:cacheprovider $xdist "$@" > "$OUT/gpu_tests.log" 2>&1
  if [ $? -eq 124 ]; then
    log="$OUT/gpu_tests.log"
    echo "CUT after ${GPU_TESTS_SECONDS:-480} s: $(grep -c " PASSED " "$log") passed, $(grep -cE " (FAILED|ERROR) " "$log")" \
      "failed so far; unfinished:"
    comm -23 <(grep -E "^tests/[^ ]+ *$" "$log" | sed 's/ *$//' | sort -u) \
      <(grep -oE "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) tests/[^ ]+" "$log" | awk '{print $2}' | sort -u) | head -20
  fi
  grep -E " (FAILED|ERROR) |passed|failed" "$OUT/gpu_tests.log" | sed 's/^\[gw[0-9]*\] //' | tail -20
  [ -s "$OUT/failures.log" ] && grep -E "^====|^E  " "$OUT/failures.log" | head -30
  tar czf "$OUT/test_results.tgz" -C "$OUT" tests && rm -rf "$OUT/tests"
}
case "$mode" in
  quick|full)
    gpu_tests tests/gpu
    python -m sage_compile demo --seq-len 1024 2>&1 | tee "$OUT/demo.log" | tail -4 ;;
  tests) gpu_tests "${@:-tests/gpu}"; exit ;;
esac
case "$mode" in
  quick) python -m sage_compile bench e2e --n 4096,16384 --d 128 "$@" 2>&1 | tee "$OUT/e2e.log" | tail -12 ;;
  full|bench) python -m sage_compile bench e2e "$@" 2>&1 | tee "$OUT/e2e.log" | tail -40 ;;
  kernel|int4|eager|e2e|models|accuracy|spec|backward|train|context_parallel|varlen) python -m sage_compile bench "$mode" "$@" 2>&1 | tee "$OUT/$mode.log" | tail -40 ;;
  sweep|static_sweep)
    if [ "$mode" = sweep ]; then grid="--rounds 3 --n 1024,2048,4096,8192,16384,32768,65536"
    else grid="--static --rounds 3 --n 1024,2048,4096,8192"; fi
    for variant in "$@"; do
      case "$variant" in
        key_padding) extra="--mask key_padding" ;;
        gqa4) extra="--gqa 4" ;;
        *) extra="--producer $variant" ;;
      esac
      python -m sage_compile bench e2e --default-only --record $grid $extra 2>&1 | tee "$OUT/${mode}_$variant.log" | tail -30
    done ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
