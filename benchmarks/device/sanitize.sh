#!/bin/bash
# compute-sanitizer over every CUDA GoogleTest (issue 16): memcheck, racecheck and synccheck, one test at a time, then
# the CUDA variants of the Python reliability tests (threads, Ctrl-C, non-finite logits, close(), 100 load/generate/
# close cycles with device memory flat). Run from the repo root on the device, with .devcarry carried:
#   source .devcarry/setup.sh && bash benchmarks/device/sanitize.sh
# Knobs (environment):
#   TOOLS          sanitizer tools, default "memcheck racecheck synccheck"
#   GTEST_FILTER   which GoogleTests, default '*' (every test of test_cuda_kernels)
#   SHARD          "i/n": only every n-th test from the i-th (0-based), to split the work over calls of 10 minutes
#   TEST_TIMEOUT   seconds per test and tool (default 240; racecheck is the slowest)
#   MEMCHECK_FLAGS extra memcheck flags (e.g. "--leak-check full")
#   PYTEST         1 (default): also run tests/python/test_reliability.py -k cuda; 0: skip (and the pip build)
# Prints one line per test and tool and a summary table; logs land in $OUT (or ./device-out).
# A device call lasts at most 10 minutes: split the work, e.g.
#   TOOLS=memcheck bash benchmarks/device/sanitize.sh                  (+ the Python reliability tests)
#   TOOLS=racecheck SHARD=0/3 PYTEST=0 bash benchmarks/device/sanitize.sh   (then 1/3, 2/3)
#   TOOLS=synccheck PYTEST=0 bash benchmarks/device/sanitize.sh
set -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
t0=$(date +%s)
TOOLS=${TOOLS:-"memcheck racecheck synccheck"}
GTEST_FILTER=${GTEST_FILTER:-'*'}
SHARD=${SHARD:-0/1}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
PYTEST=${PYTEST:-1}
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$CS" ] || { echo "compute-sanitizer not found (looked on PATH and in /usr/local/cuda/bin)"; exit 2; }

# The CUDA sources build with -lineinfo (CMakeLists.txt), so the sanitizer names the source line of a bad access.
( cmake -S . -B /tmp/bsan -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/san_build.log" 2>&1 \
  && cmake --build /tmp/bsan -j"$(nproc)" --target test_cuda_kernels >> "$OUT/san_build.log" 2>&1 ) &
build_pid=$!
pip_rc=0
if [ "$PYTEST" = 1 ]; then
  python3 -m pip install -q --upgrade --no-build-isolation --no-deps --target /tmp/site . > "$OUT/san_pip.log" 2>&1
  pip_rc=$?
fi
wait $build_pid
build_rc=$?
echo "builds: $(( $(date +%s) - t0 )) s (gtest build rc $build_rc, pip rc $pip_rc)"
if [ $build_rc -ne 0 ]; then
  grep -E "error|FAILED" "$OUT/san_build.log" | head -30
  exit 1
fi
BIN=/tmp/bsan/test_cuda_kernels

# Test names: "Suite." lines followed by indented "Test" lines (a "  # GetParam() = ..." comment may follow).
mapfile -t ALL < <("$BIN" --gtest_list_tests --gtest_filter="$GTEST_FILTER" | awk '
  /^[^ ]/ { suite = $1; next }
  /^  / { print suite $1 }')
IFS=/ read -r shard_i shard_n <<< "$SHARD"
TESTS=()
for k in "${!ALL[@]}"; do
  [ $(( k % shard_n )) -eq "$shard_i" ] && TESTS+=("${ALL[$k]}")
done
echo "== ${#TESTS[@]} of ${#ALL[@]} CUDA GoogleTests (shard $SHARD) x tools: $TOOLS"

declare -A RESULT
clean=0; dirty=0
for tool in $TOOLS; do
  flags=""
  [ "$tool" = memcheck ] && flags="$MEMCHECK_FLAGS"
  [ "$tool" = racecheck ] && flags="--racecheck-report hazard"
  for t in "${TESTS[@]}"; do
    log="$OUT/san_${tool}_${t//[^A-Za-z0-9_.]/_}.log"
    s=$(date +%s)
    # --error-exitcode tells sanitizer findings (86) from a failing test (1) and a timeout (124).
    timeout "$TEST_TIMEOUT" "$CS" --tool "$tool" $flags --error-exitcode 86 --print-limit 20 \
      "$BIN" --gtest_filter="$t" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
    case $rc in
      0) verdict=clean ;;
      86) verdict="SANITIZER ERRORS" ;;
      124) verdict=TIMEOUT ;;
      *) verdict="TEST FAILED (rc $rc)" ;;
    esac
    [ $rc -eq 0 ] && clean=$((clean + 1)) || dirty=$((dirty + 1))
    RESULT["$tool $t"]="$verdict"
    printf '%-10s %-60s %-18s %4ss  %s\n' "$tool" "$t" "$verdict" "$(( $(date +%s) - s ))" "$summary"
    if [ $rc -ne 0 ] && [ $rc -ne 124 ]; then
      grep -E "^========= (Invalid|Error|Race|Barrier|Uninitialized|Program hit|  at |    at )|Failure$" "$log" \
        | head -12 | sed 's/^/    /'
    fi
  done
done

py_rc=0
if [ "$PYTEST" = 1 ]; then
  if [ $pip_rc -eq 0 ]; then
    timeout "${PYTEST_TIMEOUT:-500}" python3 -m pytest -q -p no:cacheprovider -k cuda tests/python/test_reliability.py \
      > "$OUT/san_pytest_reliability.log" 2>&1
    py_rc=$?
    echo "== pytest tests/python/test_reliability.py -k cuda: rc $py_rc"
    grep -E "passed|failed|error|^FAILED|^ERROR" "$OUT/san_pytest_reliability.log" | tail -15
    [ $py_rc -eq 0 ] || grep -E "^E " "$OUT/san_pytest_reliability.log" | head -30
  else
    py_rc=1
    echo "== pip build failed"; tail -20 "$OUT/san_pip.log"
  fi
fi

echo "== summary ($(( $(date +%s) - t0 )) s): $clean clean, $dirty not clean of $(( clean + dirty )) test x tool runs;" \
     "python reliability $([ $py_rc -eq 0 ] && echo PASS || echo FAIL)"
printf '| %-10s | %6s | %6s | %8s | %6s |\n' tool clean errors timeouts failed
for tool in $TOOLS; do
  c=0; e=0; to=0; f=0
  for t in "${TESTS[@]}"; do
    case "${RESULT["$tool $t"]}" in
      clean) c=$((c + 1)) ;;
      "SANITIZER ERRORS") e=$((e + 1)) ;;
      TIMEOUT) to=$((to + 1)) ;;
      *) f=$((f + 1)) ;;
    esac
  done
  printf '| %-10s | %6d | %6d | %8d | %6d |\n' "$tool" $c $e $to $f
done
[ $dirty -eq 0 ] && [ $py_rc -eq 0 ]
