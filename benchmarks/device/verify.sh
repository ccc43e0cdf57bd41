#!/bin/bash
# GPU check of this tree on the lent H100 (../shared/GUIDE.md §5): builds the Python package, runs the CUDA Python
# tests (CUDA vs CPU on a synthetic SmolLM2-shaped model), `metalattn bench` on that model, and the GoogleTest CUDA
# kernel tests. Run from the repo root on the device, with .devcarry carried:
#   source .devcarry/setup.sh && bash benchmarks/device/verify.sh
# Logs and bench JSON land in $OUT (or ./device-out when OUT is unset).
set -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site . > "$OUT/pip.log" 2>&1 \
  || { tail -30 "$OUT/pip.log"; exit 1; }
echo "package build: $(( $(date +%s) - t0 )) s"
( cmake -S . -B /tmp/b -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/ctest_build.log" 2>&1 \
  && cmake --build /tmp/b -j"$(nproc)" --target test_cuda_kernels >> "$OUT/ctest_build.log" 2>&1 ) &
build_pid=$!
model=/tmp/smollm2_q4_0.gguf
python3 -c "from metalattn.testing import write_synthetic_gguf, SMOLLM2_135M; write_synthetic_gguf('$model', **SMOLLM2_135M)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -6
timeout 200 python3 -m metalattn bench -m "$model" -d cuda --prompt-lengths 32,128,512,2048 --iterations 10 --json -q \
  > "$OUT/bench_cuda.json"
python3 -c "import json; from metalattn.bench import format_table; print(format_table(json.load(open('$OUT/bench_cuda.json'))))"
wait $build_pid || { tail -30 "$OUT/ctest_build.log"; exit 1; }
timeout 300 /tmp/b/test_cuda_kernels 2>&1 | tee "$OUT/gtest_cuda.log" | grep -E "^\[  (FAILED|PASSED)|tests ran" | head -20
