#!/bin/bash
# The CUDA backend's quant types Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (Q2_K, Q3_K and mixed stacks as the wide int8 layout)
# on the GPU machine: builds test_cuda_kernels and bench_cuda, runs the new GoogleTests, the existing CUDA tests that
# share the changed code (matvec kernels, packing, embedding, fp16 copies, the backend), and the benchmarks; ends
# with a short summary. Logs go to $OUT (or /tmp/quants-out).
# Usage (repo root, .devcarry carried): source .devcarry/setup.sh && bash benchmarks/device/quants.sh [stage...]
# Stages (default: test regress bench python): test | regress | bench | python | memcheck
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/quants-out}
mkdir -p "$OUT"
B=/tmp/bq
T=$B/test_cuda_kernels
BE=$B/bench_cuda
echo "== build ($B)"
( cmake -S . -B $B -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
  && cmake --build $B -j"$(nproc)" --target test_cuda_kernels bench_cuda ) > "$OUT/build.log" 2>&1 \
  || { echo "BUILD FAILED"; grep -E "error" "$OUT/build.log" | head -30; tail -20 "$OUT/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(test regress bench python)
summary=()
run_tests() {  # name filter timeout
  local name=$1 filter=$2 limit=$3
  echo "== $name: --gtest_filter='$filter'"
  timeout "$limit" $T --gtest_filter="$filter" > "$OUT/$name.log" 2>&1
  local rc=$?
  # Failures with their context (the SCOPED_TRACE lines name type, GPU layout and shape), then the verdicts.
  grep -E "^\[  FAILED|^\[       OK|^\[  PASSED|^\[  SKIPPED|random seed|\[ [a-z0-9]" "$OUT/$name.log" | head -80
  # Each failure with the lines that follow it: the expectation, the values and the SCOPED_TRACE context (type,
  # GPU layout, shape, position).
  grep -A12 -E ": Failure$" "$OUT/$name.log" | head -150
  local passed failed
  passed=$(grep -c "^\[       OK" "$OUT/$name.log")
  failed=$(grep -c "^\[  FAILED  \] [A-Za-z]*\.[A-Za-z]* (" "$OUT/$name.log")
  [ $rc -eq 124 ] && echo "TIMEOUT after ${limit}s"
  summary+=("$name: $passed passed, $failed failed, exit $rc")
}
for stage in "${stages[@]}"; do
  case $stage in
    test) run_tests quant_tests 'CudaQuant.*' 500 ;;
    regress) run_tests regression_tests 'CudaMatvec.*:CudaFused.*:CudaKernels.*:CudaPrefill.*:CudaPrompt.*:CudaBackend.*:CudaArch.*' 500 ;;
    bench)
      echo "== bench_cuda 2048 types (us per launch, GB/s)"
      timeout 120 $BE 2048 types 2>&1 | tee "$OUT/bench_types.log"
      echo "== bench_cuda 2048 q4_k_m (SmolLM2-135M shapes, the real Q4_K_M file's tensor types)"
      timeout 150 $BE 2048 q4_k_m 2>&1 | tee "$OUT/bench_q4_k_m.log" | grep -E "weights|create|decode|pp32|prefill|per-kernel|sum for"
      echo "== bench_cuda 2048 (Q4_0 layers, the RESULTS.md baseline: should be unchanged)"
      timeout 150 $BE 2048 2>&1 | tee "$OUT/bench_q4_0.log" | grep -E "create|decode|pp32|prefill|per-kernel|sum for" ;;
    python)
      echo "== Python: the package built here, tests/python/test_cuda.py -k quant_types (synthetic Q4_K_M-typed GGUFs vs the CPU)"
      python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site . > "$OUT/pip.log" 2>&1 \
        || { echo "pip build failed"; tail -20 "$OUT/pip.log"; }
      timeout 400 python3 -m pytest -q -p no:cacheprovider -k quant_types tests/python/test_cuda.py > "$OUT/pytest.log" 2>&1
      rc=$?
      grep -E "passed|failed|Error|assert|^E " "$OUT/pytest.log" | head -40
      summary+=("python quant_types: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest.log" | tail -1), exit $rc") ;;
    memcheck)
      echo "== compute-sanitizer memcheck on the quant kernel tests"
      timeout 500 compute-sanitizer --tool memcheck $T \
        --gtest_filter='CudaQuant.MatvecNormAndResidualAtRealShapes:CudaQuant.MixedStacks*:CudaQuant.Rows*' \
        > "$OUT/memcheck.log" 2>&1
      echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" "$OUT/memcheck.log" | head -20 ;;
  esac
done
echo "== summary"
for s in "${summary[@]}"; do echo "$s"; done
