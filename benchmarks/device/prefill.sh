#!/bin/bash
# Prefill work on the lent H100: build, then the stages named (repo root, .devcarry carried):
#   source .devcarry/setup.sh && bash benchmarks/device/prefill.sh [test|testall|bench|nsys|memcheck|racecheck]...
cd "$(dirname "$0")/../.."
B=/tmp/bp
T=$B/test_cuda_kernels; BE=$B/bench_cuda
( cmake -S . -B $B -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  && cmake --build $B -j16 --target test_cuda_kernels bench_cuda ) > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
F='CudaPrefill.*:CudaBackend.Prompt*'
for stage in "$@"; do
  case $stage in
    test) timeout 200 $T --gtest_filter="$F" 2>&1 | tee $OUT/test.log | grep -E "^\[  (FAILED|PASSED|  OK)|Failure|Expected|Which is|rel L2|random seed|prompt" | head -60 ;;
    testall) timeout 300 $T 2>&1 | tee $OUT/testall.log | grep -E "^\[  (FAILED|PASSED)|Failure|Expected|Which is" | head -40 ;;
    bench) timeout 120 $BE 2048 2>&1 | tee $OUT/bench.log | grep -E "device|prefill|decode" ;;
    nsys) if command -v nsys > /dev/null; then
            nsys profile -o $OUT/pf --force-overwrite true timeout 120 $BE 2048 > /dev/null 2>&1
            nsys stats -r cuda_gpu_kern_sum $OUT/pf.nsys-rep 2>/dev/null | head -30; rm -f $OUT/pf.nsys-rep $OUT/pf.sqlite
          else echo "no nsys"; fi ;;
    memcheck) timeout 240 compute-sanitizer --tool memcheck $T --gtest_filter='CudaPrefill.*:CudaBackend.PromptGraph*' > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" $OUT/memcheck.log | head ;;
    racecheck) timeout 200 compute-sanitizer --tool racecheck $T --gtest_filter='CudaPrefill.*' > $OUT/racecheck.log 2>&1; echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" $OUT/racecheck.log | head ;;
  esac
done
