#!/bin/bash
# GPU kernel work on the lent H100: build the GoogleTest CUDA tests and bench_cuda, then run the stages named.
# Usage (repo root, .devcarry carried): source .devcarry/setup.sh && bash benchmarks/device/kernels.sh [stage...]
# Stages: see the case list below. Logs go to $OUT.
cd "$(dirname "$0")/../.."
B=/tmp/b
T=$B/test_cuda_kernels; BE=$B/bench_cuda
# PREBUILT=<dir> with test_cuda_kernels and bench_cuda (built locally, carried): skips the device build.
if [ -n "$PREBUILT" ] && [ -x "$PREBUILT/test_cuda_kernels" ] && [ -x "$PREBUILT/bench_cuda" ]; then
  T=$PREBUILT/test_cuda_kernels; BE=$PREBUILT/bench_cuda
else
  ( cmake -S . -B $B -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    && cmake --build $B -j16 --target test_cuda_kernels bench_cuda ) > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
fi
ls -la $T $BE || { tail -40 $OUT/build.log; exit 1; }
for stage in "$@"; do
  case $stage in
    test) timeout 300 $T 2>&1 | tee $OUT/test.log | grep -E "^\[  (FAILED|PASSED|  OK|SKIPPED)|Failure|error|Expected|Which is|actual|rel L2|random seed" | head -80 ;;
    testf) timeout 300 $T --gtest_filter="$FILTER" 2>&1 | tee $OUT/testf.log | grep -E "^\[  (FAILED|PASSED|  OK)|Failure|Expected|Which is|rel L2" | head -60 ;;
    testpdl) METALATTN_CUDA_PDL=1 timeout 200 $T --gtest_filter='CudaBackend.*' 2>&1 | tee $OUT/testpdl.log | grep -E "^\[  (FAILED|PASSED|  OK)|Failure|Expected|Which is|rel L2" | head -40 ;;
    bench) timeout 120 $BE 2048 2>&1 | tee $OUT/bench.log ;;
    benchpdl) METALATTN_CUDA_PDL=1 timeout 120 $BE 2048 2>&1 | tee $OUT/bench_pdl.log ;;
    ncu) NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
      # kernels-only bench: the first launch of each attention kernel is at pos 160.
      for spec in "attention_decode_short_kernel 0" "attention_decode_kernel 0"; do set -- $spec
        timeout 150 $NCU -k regex:$1 --launch-skip $2 -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
          --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy $BE 2048 kernels > $OUT/ncu_$1.log 2>&1
        echo "ncu $1 rc=$?"; grep -E "Duration|Elapsed Cycles|Stall|Warp Cycles Per|Issued Warp|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Registers|Achieved Occ|ERR" $OUT/ncu_$1.log | head -30
      done ;;
    ncuprompt) NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      # The bench's first call is a 32-token prompt: its layer 0 is the five few-token kernels (QKV, attention, O,
      # gate/up, down), each profiled alone (serialized, so without the programmatic overlap).
      timeout 200 $NCU -k regex:'prompt_mma|attention_prompt_few' -c 5 --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy $BE 2048 > $OUT/ncu_prompt.log 2>&1
      echo "ncu prompt rc=$?"; grep -E "prompt_mma_kernel|attention_prompt_few|Duration|Stall|Warp Cycles Per Issued|L2 Hit|Mem Busy|Max Bandwidth|Registers Per|Achieved Occ|Grid Size|Dynamic Shared|ERR" $OUT/ncu_prompt.log | head -80 ;;
    memcheck) timeout 400 compute-sanitizer --tool memcheck $T --gtest_filter='CudaMatvec.FloatRows*:CudaFused.*:CudaKernels.*:CudaPrompt.*:CudaBackend.Greedy*:CudaBackend.DecodeMatchesReferenceSmall*:CudaBackend.FewToken*' > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" $OUT/memcheck.log | head ;;
    racecheck) METALATTN_TEST_QUICK=1 timeout 300 compute-sanitizer --tool racecheck $T --gtest_filter='CudaFused.NormGateUpSilu*:CudaFused.DecodeAttentionShort*:CudaPrompt.*:CudaBackend.Greedy*' > $OUT/racecheck.log 2>&1; echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" $OUT/racecheck.log | head ;;
  esac
done
