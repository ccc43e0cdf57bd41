#!/bin/bash
# Runs one CUDA GoogleTest many times, with programmatic dependent launch on and off, and counts failures: the tool
# for intermittent faults such as CudaBackend.PromptGraphReplayAtNewStartPositions (NOTES, "CUDA decode, session
# 10": one all_logits row of the replay at 72 off by 2e-3..6e-3 in 2 of ~10 runs). Run from the repo root on the
# device, with .devcarry carried:
#   source .devcarry/setup.sh && bash benchmarks/device/repeat_test.sh [TEST] [REPEATS]
# TEST defaults to CudaBackend.PromptGraphReplayAtNewStartPositions, REPEATS to 40. BIN: a prebuilt test_cuda_kernels.
set -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
TEST=${1:-CudaBackend.PromptGraphReplayAtNewStartPositions}
REPEATS=${2:-40}
t0=$(date +%s)
if [ -z "$BIN" ]; then
  BIN=/tmp/b/test_cuda_kernels
  cmake -S . -B /tmp/b -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/repeat_build.log" 2>&1 \
    && cmake --build /tmp/b -j"$(nproc)" --target test_cuda_kernels >> "$OUT/repeat_build.log" 2>&1 \
    || { tail -20 "$OUT/repeat_build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
for pdl in 1 0; do
  log="$OUT/repeat_pdl$pdl.log"
  METALATTN_CUDA_PDL=$pdl timeout "${REPEAT_TIMEOUT:-280}" "$BIN" --gtest_filter="$TEST" --gtest_repeat="$REPEATS" > "$log" 2>&1
  echo "PDL=$pdl (rc $?): $(grep -c '^\[       OK \]' "$log") passed, $(grep -c '^\[  FAILED  \] [A-Z]' "$log") failed"
  # The failing assertions and their traces (which row, which start position), counted.
  grep -E "^Expected|actual:|Google Test trace|all_logits row [0-9]+:|decode at [0-9]+$|tokens at [0-9]+$" "$log" | grep -vE "^Google" \
    | sed -E 's/actual: [0-9.e-]+ vs/actual: X vs/' | sort | uniq -c | sort -rn | head -12
done
echo "total $(( $(date +%s) - t0 )) s"
