#!/bin/bash
# compute-sanitizer over every CUDA test (issue 16): memcheck, racecheck and synccheck over each CUDA GoogleTest of
# test_cuda_kernels (one sanitizer process per test and tool) and over the CUDA variants of the Python reliability
# tests (threads, Ctrl-C, non-finite logits, close(), 100 load/generate/close cycles with device memory flat).
# Under racecheck the tests run their quick mode (METALATTN_TEST_QUICK=1): the whole pass of 165 jobs took five
# 10-minute calls on the H100 (RESULTS, "CUDA, session 16"). Run from the repo root on the device, with .devcarry
# carried:
#   source .devcarry/setup.sh && JOBS=8 DEADLINE=540 TEST_TIMEOUT=540 bash benchmarks/device/sanitize.sh
# then, if the 10-minute call cut it short, once more with JOBLIST=<the san_rerun.txt it wrote> (on a warm machine
# the builds are reused). BIN and PY_WHEEL (built elsewhere from the same tree) save the builds (~3.5 min) per call.
# Knobs (environment):
#   TOOLS          sanitizer tools, default "memcheck racecheck synccheck" (initcheck works too)
#   GTEST_FILTER   which GoogleTests, default '*' (every test of test_cuda_kernels)
#   SHARD          "i/n": only every n-th test from the i-th (0-based)
#   JOBS           sanitizer processes at once (default 1). The jobs (tool x test) start slowest-first (ORDER_FIRST);
#                  the SOLO ones run alone, since they read device-wide free memory: the GoogleTests before the pool,
#                  the Python ones (which wait for the package build) after it. The processes share the GPU by
#                  time slicing: JOBS=8 ran 94 short jobs in 64 s on the H100, but a long test gains nothing (memcheck
#                  of DecodeMatchesReferenceForEachLayerTypeAndOddCapacity: under 45 s alone, 497 s beside 11 others).
#                  Run the short tests wide and the long ones (ORDER_FIRST's head) with JOBS of 1-2.
#   JOBLIST        a file of "tool test" lines to run instead of TOOLS x tests (e.g. the NOT RUN lines of a cut call)
#   TOOL_ORDER     which tool's jobs start first among tests of the same rank (default "racecheck memcheck synccheck")
#   TEST_TIMEOUT   seconds per test and tool (default 240); TIMEOUTS="Suite.Test=600 ..." overrides it per test
#   DEADLINE       seconds after the script starts (builds included) by which every sanitizer run ends (default 0:
#                  none). A run cut by it is CUT, one never started NOT RUN; both leave the exit status non-zero.
#   MEMCHECK_FLAGS extra memcheck flags (e.g. "--leak-check full")
#   RACECHECK_FLAGS racecheck flags (default "--racecheck-report hazard")
#   PY_WHEEL       a prebuilt metalattn wheel (cp312) to install instead of building the package here
#   PYTEST         1 (default): also run tests/python/test_reliability.py -k cuda under each tool (two jobs a tool:
#                  the cycles test alone, as SOLO, the rest in the pool); 0: skip them and the pip build
#   BIN            a prebuilt test_cuda_kernels to use (skips the GoogleTest build)
#   EXPECT_API_OOM tests that provoke out-of-memory on purpose (default: RejectsBadInputsAndOutOfMemoryWithoutLeaking)
# Verdicts: clean; "no CUDA work" (a host-only test: the tool reports "terminated before first instrumented API call"
# and the test passed); "expected OOM" (a test of EXPECT_API_OOM passed and every error the tool reported is a
# cudaErrorMemoryAllocation returned by a CUDA API call, which the test asked for); SANITIZER ERRORS; HAZARD WARNINGS
# (racecheck warnings with exit 0); TIMEOUT; CUT; NOT RUN; SKIPPED (the test skipped itself); TEST FAILED.
# Only the first three count as clean. Prints a line per finished job, the non-clean jobs' key log lines, and a table
# per tool; logs land in $OUT/san_logs.tgz (one file: the device tool returns at most 8), the summary in
# $OUT/san_summary.txt.
set -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
LOGS="$OUT/san_logs"
mkdir -p "$LOGS"
t0=$(date +%s)
TOOLS=${TOOLS:-"memcheck racecheck synccheck"}
GTEST_FILTER=${GTEST_FILTER:-'*'}
SHARD=${SHARD:-0/1}
JOBS=${JOBS:-1}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
DEADLINE=${DEADLINE:-0}
PYTEST=${PYTEST:-1}
EXPECT_API_OOM=${EXPECT_API_OOM:-"CudaBackend.RejectsBadInputsAndOutOfMemoryWithoutLeaking"}
SOLO=${SOLO:-"CudaBackend.RejectsBadInputsAndOutOfMemoryWithoutLeaking py.reliability_cuda_cycles"}
# Slowest first (native times on the H100, 2026-11-24, and memcheck's 45 s timeout on the first): the pool's makespan
# is then close to the longest job rather than the longest job started last.
ORDER_FIRST=${ORDER_FIRST:-"Lengths/CudaBackendPrompt.MatchesTokenByTokenDecode/n2048 Lengths/CudaBackendPrompt.MatchesTokenByTokenDecode/n512 CudaQuant.BackendOnMixedTypeModelsMatchesReference
  CudaBackend.DecodeMatchesReferenceForEachLayerTypeAndOddCapacity CudaQuant.MatvecNormAndResidualAtRealShapes
  CudaQuant.FusedQkvFfnAndLmHeadAtRealShapes CudaMatvec.PlainFusedNormAndResidualAtEveryShape
  CudaBackend.DecodeAcrossTheShortToLongAttentionSwitchOver CudaArch.GeneralPathOnPlainLlamaMatchesFusedPath
  CudaArch.AttentionPromptCausalWindowAndOperandOutput CudaQuant.PromptMmaProjectionsAtRealShapes
  CudaPrompt.MmaProjectionsMatchReferenceAtEveryShape CudaArch.WholeModelsMatchCpuBackend CudaFused.FinalNormLmHeadArgmax
  CudaBackend.DecodeMatchesReferenceFullSmolLM2Shape CudaArch.AttentionDecodeWithFusedQkvFinish py.reliability_cuda"}
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$CS" ] || { echo "compute-sanitizer not found (looked on PATH and in /usr/local/cuda/bin)"; exit 2; }
"$CS" --version | tail -1

# ------------------------------------------------------------------------------------------------------------ builds
# The CUDA sources build with -lineinfo (CMakeLists.txt), so the sanitizer names the source line of a bad access.
build_pid=""
if [ -n "$BIN" ] && [ -x "$BIN" ] && "$BIN" --gtest_list_tests > /dev/null 2>&1; then
  echo "prebuilt $BIN ($(md5sum < "$BIN" | cut -c1-12))"
else
  BIN=/tmp/bsan/test_cuda_kernels
  ( cmake -S . -B /tmp/bsan -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/san_build.log" 2>&1 \
    && cmake --build /tmp/bsan -j"$(nproc)" --target test_cuda_kernels >> "$OUT/san_build.log" 2>&1 ) &
  build_pid=$!
fi
# The Python package builds in the background while the GoogleTest jobs run; the Python jobs wait for it
# (PIP_RC holds its exit status once it is done).
PIP_RC="$OUT/.san_pip_rc"
rm -f "$PIP_RC"
[ "$PYTEST" = 1 ] || echo "1 (PYTEST=0: not built)" > "$PIP_RC"
if [ "$PYTEST" = 1 ]; then
  # A warm machine keeps /tmp/site: skip the build when the sources it was built from are the same.
  src_sha=$(find cpp python shaders CMakeLists.txt pyproject.toml -type f | LC_ALL=C sort | xargs cat | sha1sum)
  if [ -n "$PY_WHEEL" ]; then
    python3 -m pip install -q --upgrade --no-deps --no-compile --target /tmp/site "$PY_WHEEL" > "$OUT/san_pip.log" 2>&1
    rc=$?; echo "python package: $(basename "$PY_WHEEL") installed, rc $rc"; echo $rc > "$PIP_RC"
    rm -f /tmp/site/.metalattn_src
  elif [ -f /tmp/site/.metalattn_src ] && [ "$(cat /tmp/site/.metalattn_src)" = "$src_sha" ]; then
    echo "python package: already built from these sources"; echo 0 > "$PIP_RC"
  else
    ( s=$(date +%s)
      python3 -m pip install -q --upgrade --no-build-isolation --no-deps --target /tmp/site . > "$OUT/san_pip.log" 2>&1
      rc=$?
      [ $rc -eq 0 ] && echo "$src_sha" > /tmp/site/.metalattn_src
      echo "  python package built: rc $rc, $(( $(date +%s) - s )) s"
      [ $rc -eq 0 ] || tail -20 "$OUT/san_pip.log"
      echo $rc > "$PIP_RC" ) &
  fi
fi
build_rc=0
if [ -n "$build_pid" ]; then wait "$build_pid"; build_rc=$?; fi
echo "gtest build: $(( $(date +%s) - t0 )) s (rc $build_rc)"
if [ $build_rc -ne 0 ]; then
  grep -E "error|FAILED" "$OUT/san_build.log" | head -30
  exit 1
fi

# -------------------------------------------------------------------------------------------------------- the jobs
# Test names: "Suite." lines followed by indented "Test" lines (a "  # GetParam() = ..." comment may follow).
mapfile -t ALL < <("$BIN" --gtest_list_tests --gtest_filter="$GTEST_FILTER" | awk '
  /^[^ ]/ { suite = $1; next }
  /^  / { print suite $1 }')
IFS=/ read -r shard_i shard_n <<< "$SHARD"
TESTS=()
for k in "${!ALL[@]}"; do
  [ $(( k % shard_n )) -eq "$shard_i" ] && TESTS+=("${ALL[$k]}")
done
[ "$PYTEST" = 1 ] && TESTS+=(py.reliability_cuda py.reliability_cuda_cycles)

JOBLINES=()  # "tool test"
if [ -n "$JOBLIST" ]; then
  mapfile -t JOBLINES < <(grep -vE '^\s*(#|$)' "$JOBLIST")
else
  for t in "${TESTS[@]}"; do for tool in $TOOLS; do JOBLINES+=("$tool $t"); done; done
fi
in_list() { local x=$1; shift; for y in "$@"; do [ "$x" = "$y" ] && return 0; done; return 1; }
# Order: ORDER_FIRST's tests first (each with every tool in TOOL_ORDER, racecheck first by default: the slowest
# tool), then the rest by tool.
TOOL_ORDER=${TOOL_ORDER:-"racecheck memcheck synccheck"}
rank_tool() { local k=0 x; for x in $TOOL_ORDER; do [ "$x" = "$1" ] && { echo $k; return; }; k=$((k + 1)); done; echo $k; }
POOL=(); FIRST=(); LAST=()
mapfile -t SORTED < <(
  for j in "${JOBLINES[@]}"; do
    read -r tool t <<< "$j"
    r=500; k=0
    for f in $ORDER_FIRST; do [ "$f" = "$t" ] && r=$k; k=$((k + 1)); done
    printf '%03d %d %s\n' "$r" "$(rank_tool "$tool")" "$j"
  done | sort -k1,1n -k2,2n -s | cut -d' ' -f3-)
for j in "${SORTED[@]}"; do
  read -r tool t <<< "$j"
  if ! in_list "$t" $SOLO; then POOL+=("$j"); elif [[ $t == py.* ]]; then LAST+=("$j"); else FIRST+=("$j"); fi
done
echo "== ${#JOBLINES[@]} jobs (tool x test; ${#ALL[@]} GoogleTests listed, shard $SHARD, PYTEST=$PYTEST), $JOBS at a time," \
     "deadline ${DEADLINE}s; ${#FIRST[@]} run alone before the others, ${#LAST[@]} after"
echo "racecheck flags: ${RACECHECK_FLAGS:-"--racecheck-report hazard"}"

declare -A TO
for kv in $TIMEOUTS; do TO["${kv%%=*}"]=${kv#*=}; done
job_id() { local s="$1_$2"; echo "${s//[^A-Za-z0-9_.-]/_}"; }

# One sanitizer process; writes $LOGS/<id>.log and $LOGS/<id>.rc ("rc seconds cut").
run_job() {
  local tool=$1 t=$2 id flags to rem cut=0 s rc
  id=$(job_id "$tool" "$t")
  to=${TO[$t]:-$TEST_TIMEOUT}
  if [ "$DEADLINE" -gt 0 ]; then
    rem=$(( t0 + DEADLINE - $(date +%s) ))
    if [ "$rem" -lt 15 ]; then echo "-1 0 0" > "$LOGS/$id.rc"; return; fi
    [ "$rem" -lt "$to" ] && { to=$rem; cut=1; }
  fi
  flags=""
  [ "$tool" = memcheck ] && flags="$MEMCHECK_FLAGS"
  [ "$tool" = racecheck ] && flags=${RACECHECK_FLAGS:-"--racecheck-report hazard"}
  s=$(date +%s)
  # --error-exitcode tells sanitizer findings (86) from a failing test (1) and a timeout (124).
  case $t in
    py.reliability_cuda|py.reliability_cuda_cycles)
      local k="cuda and not cycles"; [ "$t" = py.reliability_cuda_cycles ] && k="cuda and cycles"
      while [ ! -s "$PIP_RC" ]; do sleep 2; done
      if [ "$(cat "$PIP_RC")" != 0 ]; then echo "pip build failed" > "$LOGS/$id.log"; rc=3; else
        # The wait for the build counts against the deadline.
        if [ "$DEADLINE" -gt 0 ]; then
          rem=$(( t0 + DEADLINE - $(date +%s) ))
          if [ "$rem" -lt 15 ]; then echo "-1 0 0" > "$LOGS/$id.rc"; return; fi
          [ "$rem" -lt "$to" ] && { to=$rem; cut=1; }
        fi
        s=$(date +%s)
        PYTHONUNBUFFERED=1 METALATTN_UNDER_SANITIZER=$tool timeout -k 10 "$to" "$CS" --tool "$tool" $flags --error-exitcode 86 --print-limit 20 \
          python3 -m pytest -q -p no:cacheprovider -k "$k" tests/python/test_reliability.py > "$LOGS/$id.log" 2>&1
        rc=$?
      fi ;;
    *)
      # racecheck runs the tests' quick mode (METALATTN_TEST_QUICK=1: fewer layers or cases, the same kernels).
      local quick=0; [ "$tool" = racecheck ] && quick=1
      METALATTN_TEST_QUICK=$quick timeout -k 10 "$to" "$CS" --tool "$tool" $flags --error-exitcode 86 --print-limit 20 \
        "$BIN" --gtest_filter="$t" > "$LOGS/$id.log" 2>&1
      rc=$? ;;
  esac
  echo "$rc $(( $(date +%s) - s )) $cut" > "$LOGS/$id.rc"
  printf '  done %-10s %-62s rc %-3s %4ss\n' "$tool" "$t" "$rc" "$(( $(date +%s) - s ))"
}

for j in "${FIRST[@]}"; do
  read -r tool t <<< "$j"
  run_job "$tool" "$t"
done
for j in "${POOL[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  read -r tool t <<< "$j"
  run_job "$tool" "$t" &
done
wait
for j in "${LAST[@]}"; do
  read -r tool t <<< "$j"
  run_job "$tool" "$t"
done

# ----------------------------------------------------------------------------------------------------- verdicts
# The test's own outcome, from its output in the log: pass / fail / skip.
test_passed() {
  case $2 in
    py.*) local last; last=$(grep -E "^[0-9]+ (passed|failed|skipped|errors?|deselected)" "$1" | tail -1)
          [[ $last == *passed* ]] && [[ $last != *failed* ]] && [[ $last != *error* ]] ;;
    *) grep -q "^\[  PASSED  \] 1 test\." "$1" && ! grep -q "^\[  SKIPPED \]" "$1" ;;
  esac
}
classify() {  # tool test rc cut log -> verdict
  local tool=$1 t=$2 rc=$3 cut=$4 log=$5 n_err n_oom n_other
  if [ "$rc" = -1 ]; then echo "NOT RUN"; return; fi
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    # Reports printed before the cut are findings all the same: say so in the verdict.
    n_err=$(grep -cE "^========= (Program hit|Invalid|Error|Warning|Race|Barrier|Uninitialized|Misaligned|Out-of-range)" "$log")
    local extra=""; [ "$n_err" -gt 0 ] && extra=" +$n_err reports"
    [ "$cut" = 1 ] && echo "CUT$extra" || echo "TIMEOUT$extra"; return
  fi
  if grep -q "^\[  SKIPPED \]" "$log" || grep -qE "^([0-9]+ [a-z]+, )*[0-9]+ skipped" "$log"; then
    echo SKIPPED; return
  fi
  # Every reported problem: API errors ("Program hit"), bad accesses, hazards, barrier errors, tool errors.
  n_err=$(grep -cE "^========= (Program hit|Invalid|Error|Warning|Race|Barrier|Uninitialized|Misaligned|Out-of-range|Cuda|Malloc|Fatal|Leaked|Address)" "$log")
  if [ "$rc" != 0 ] && grep -q "terminated before first instrumented API call" "$log"; then
    # The only report is the tool's own: the process never started CUDA. A host-only test, if it passed.
    if [ "$n_err" -eq 1 ] && test_passed "$log" "$t"; then echo "no CUDA work"; else echo "TEST FAILED (rc $rc)"; fi
    return
  fi
  if [ "$rc" = 86 ]; then
    n_oom=$(grep -cE "^========= Program hit cudaErrorMemoryAllocation \(error 2\)" "$log")
    n_other=$(( n_err - n_oom ))
    local summ; summ=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | tail -1 | grep -oE "[0-9]+")
    # racecheck has no ERROR SUMMARY: there its summary must show no hazard.
    [ -z "$summ" ] && grep -qE "RACECHECK SUMMARY: 0 hazards" "$log" && summ=$n_oom
    if in_list "$t" $EXPECT_API_OOM && [ "$n_oom" -gt 0 ] && [ "$n_other" -eq 0 ] && [ "${summ:-x}" = "$n_oom" ] \
       && test_passed "$log" "$t"; then
      echo "expected OOM ($n_oom)"
    else
      echo "SANITIZER ERRORS"
    fi
    return
  fi
  if [ "$rc" != 0 ]; then echo "TEST FAILED (rc $rc)"; return; fi
  # rc 0: racecheck warnings do not set the error exit code; a displayed hazard is still a finding.
  if [ "$tool" = racecheck ] && grep -qE "RACECHECK SUMMARY: [1-9][0-9]* hazard" "$log"; then echo "HAZARD WARNINGS"; return; fi
  if test_passed "$log" "$t"; then echo clean; else echo "TEST FAILED (rc 0, no pass line)"; fi
}

SUM="$OUT/san_summary.txt"
: > "$SUM"
declare -A V
ok=0; bad=0
for j in "${JOBLINES[@]}"; do
  read -r tool t <<< "$j"
  id=$(job_id "$tool" "$t")
  read -r rc secs cut < "$LOGS/$id.rc" 2>/dev/null || { rc=-1; secs=0; cut=0; }
  v=$(classify "$tool" "$t" "$rc" "$cut" "$LOGS/$id.log")
  V["$tool $t"]=$v
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGS/$id.log" 2>/dev/null | tail -1 | sed 's/^========= //')
  case $v in clean|"no CUDA work"|"expected OOM"*) ok=$((ok + 1)) ;; *) bad=$((bad + 1)) ;; esac
  printf '%-10s %-62s %-22s %4ss  %s\n' "$tool" "$t" "$v" "$secs" "$summary" >> "$SUM"
done
echo "== per job (tool, test, verdict, seconds, the tool's summary line)"
cat "$SUM"
echo "== the key lines of each job that is not plainly clean"
for j in "${JOBLINES[@]}"; do
  read -r tool t <<< "$j"
  v=${V["$tool $t"]}
  [ "$v" = clean ] || [ "$v" = "NOT RUN" ] && continue
  echo "-- $tool $t: $v"
  grep -E "^========= (Program hit|Invalid|Error|Warning|Race|Barrier|Uninitialized|Misaligned|Out-of-range|Fatal|Leaked)|^=========     (at|by) |^=========  +at |in [^ ]+\.cu[h]?:[0-9]+|Failure$|^FAILED|^E  |Timeout|passed|failed" \
    "$LOGS/$(job_id "$tool" "$t").log" 2>/dev/null | head -14 | sed 's/^/    /'
done | tee -a "$SUM"

tar -czf "$OUT/san_logs.tgz" -C "$OUT" san_logs && rm -rf "$LOGS"
{
  echo "== summary ($(( $(date +%s) - t0 )) s): $ok clean (clean, no CUDA work, expected OOM), $bad not clean," \
       "of ${#JOBLINES[@]} tool x test jobs"
  printf '| %-10s | %5s | %11s | %12s | %6s | %8s | %3s | %6s | %7s |\n' tool clean "no CUDA work" \
    "expected OOM" errors timeouts cut failed "not run"
  for tool in $TOOLS; do
    c=0; h=0; x=0; e=0; to=0; cu=0; f=0; nr=0; any=0
    for j in "${JOBLINES[@]}"; do
      read -r tl t <<< "$j"
      [ "$tl" = "$tool" ] || continue
      any=1
      case "${V["$tool $t"]}" in
        clean) c=$((c + 1)) ;;
        "no CUDA work") h=$((h + 1)) ;;
        "expected OOM"*) x=$((x + 1)) ;;
        "SANITIZER ERRORS"|"HAZARD WARNINGS") e=$((e + 1)) ;;
        TIMEOUT*) to=$((to + 1)) ;;
        CUT*) cu=$((cu + 1)) ;;
        "NOT RUN") nr=$((nr + 1)) ;;
        *) f=$((f + 1)) ;;
      esac
    done
    [ $any = 1 ] && printf '| %-10s | %5d | %11d | %12d | %6d | %8d | %3d | %6d | %7d |\n' "$tool" $c $h $x $e $to $cu \
      $f $nr
  done
} | tee -a "$SUM"
if [ $bad -ne 0 ]; then
  grep -E "NOT RUN|CUT" "$SUM" | awk '$3 == "NOT" || $3 == "CUT" {print $1, $2}' > "$OUT/san_rerun.txt"
  [ -s "$OUT/san_rerun.txt" ] && echo "jobs to run again (JOBLIST=): $OUT/san_rerun.txt ($(wc -l < "$OUT/san_rerun.txt"))"
fi
wait  # a Python package build still going (PYTEST=1 with no Python job run)
[ $bad -eq 0 ]
