#!/bin/bash
# GPU check of the CUDA general-architecture path (shaders/cuda/arch.cu): builds the Python package and the GoogleTest
# binary, runs the CudaArch GoogleTests (arch kernels at the Gemma 3 270M / Qwen2.5-0.5B / Qwen3-0.6B shapes against
# host references; whole models of six architectures against the CPU backend) plus the existing CudaBackend tests
# (the plain Llama path must be unchanged), then the Python arch tests of tests/python/test_cuda.py. Run from the repo
# root on the device, with .devcarry carried:
#   source .devcarry/setup.sh && bash benchmarks/device/arch.sh
# Prints a pass/fail summary; full logs land in $OUT (or ./device-out when OUT is unset).
set -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
t0=$(date +%s)
GTEST_FILTER=${GTEST_FILTER:-'CudaArch.*:CudaBackend.*'}
PYTEST_K=${PYTEST_K:-arch}

( cmake -S . -B /tmp/b -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/gtest_build.log" 2>&1 \
  && cmake --build /tmp/b -j"$(nproc)" --target test_cuda_kernels >> "$OUT/gtest_build.log" 2>&1 ) &
build_pid=$!
python3 -m pip install -q --upgrade --no-build-isolation --no-deps --target /tmp/site . > "$OUT/pip.log" 2>&1
pip_rc=$?
wait $build_pid
build_rc=$?
echo "builds: $(( $(date +%s) - t0 )) s (pip rc $pip_rc, gtest build rc $build_rc)"
[ $pip_rc -eq 0 ] || tail -30 "$OUT/pip.log"
[ $build_rc -eq 0 ] || grep -E "error|FAILED" "$OUT/gtest_build.log" | head -30

gtest_rc=1
if [ $build_rc -eq 0 ]; then
  timeout "${GTEST_TIMEOUT:-400}" /tmp/b/test_cuda_kernels --gtest_filter="$GTEST_FILTER" > "$OUT/gtest_arch.log" 2>&1
  gtest_rc=$?
  echo "== GoogleTest ($GTEST_FILTER): rc $gtest_rc"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\] .* ran|rel L2 vs CPU" "$OUT/gtest_arch.log" | head -40
  grep -B2 -A8 -E "Failure$" "$OUT/gtest_arch.log" | head -80
fi

py_rc=1
if [ $pip_rc -eq 0 ]; then
  timeout "${PYTEST_TIMEOUT:-600}" python3 -m pytest -q -p no:cacheprovider -k "$PYTEST_K" tests/python/test_cuda.py > "$OUT/pytest_arch.log" 2>&1
  py_rc=$?
  echo "== pytest tests/python/test_cuda.py -k $PYTEST_K: rc $py_rc"
  grep -E "passed|failed|error|^FAILED|^ERROR" "$OUT/pytest_arch.log" | tail -25
  [ $py_rc -eq 0 ] || grep -E "^E |assert" "$OUT/pytest_arch.log" | head -40
fi
echo "== summary: gtest $([ $gtest_rc -eq 0 ] && echo PASS || echo FAIL), pytest $([ $py_rc -eq 0 ] && echo PASS || echo FAIL), $(( $(date +%s) - t0 )) s"
[ $gtest_rc -eq 0 ] && [ $py_rc -eq 0 ]
