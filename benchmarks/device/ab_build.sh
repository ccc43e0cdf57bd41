# Sourced by the same-call A/B scripts (ab_decode.sh, ab_prefill.sh): `ab_build PRESETS NAME` builds the package at
# the base revision (.devcarry/ab_base.tar, made on this machine with `git archive -o .devcarry/ab_base.tar REV`) into
# /tmp/ab_siteA and the working tree into /tmp/ab_siteB, side by side, writes the synthetic presets to /tmp/ab_*.gguf
# (ab_decode.py write) and, with TESTS=1, runs the carried .devcarry/bin/test_cuda_kernels meanwhile. Sets T (start
# time) and OUT (logs; default ./device-out). Returns 2 without the base archive.
ab_build() {
  local presets=$1 name=$2
  OUT=${OUT:-$PWD/device-out}
  mkdir -p "$OUT"
  T=$(date +%s)
  [ -f .devcarry/ab_base.tar ] || { echo "$name: make .devcarry/ab_base.tar first (git archive -o .devcarry/ab_base.tar REV)"; return 2; }
  if [ -n "$TESTS" ]; then
    ( timeout 300 .devcarry/bin/test_cuda_kernels > "$OUT/tests.log" 2>&1; echo "tests rc $?" >> "$OUT/tests.log" ) &
  fi
  rm -rf /tmp/ab_A && mkdir -p /tmp/ab_A && tar -xf .devcarry/ab_base.tar -C /tmp/ab_A
  export CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 ))
  ( cd /tmp/ab_A && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab_siteA . > "$OUT/pipA.log" 2>&1 \
    || { echo "build A failed"; tail -20 "$OUT/pipA.log"; } ) &
  ( python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab_siteB . > "$OUT/pipB.log" 2>&1 \
    || { echo "build B failed"; tail -20 "$OUT/pipB.log"; } ) &
  PYTHONPATH=$PWD/python:$PYTHONPATH python3 benchmarks/device/ab_decode.py write "$presets" > "$OUT/models.log" 2>&1 &
  wait
  echo "builds, models$([ -n "$TESTS" ] && echo ", tests") $(( $(date +%s) - T )) s"
  if [ -n "$TESTS" ]; then
    tail -3 "$OUT/tests.log"
    grep -E "^\[  FAILED|Failure" "$OUT/tests.log" | head
  fi
  return 0
}
