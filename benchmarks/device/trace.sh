#!/bin/bash
# Where one decode step's time goes inside the kernel chain: builds bench_cuda with -DMETALATTN_TRACE (block 0 of
# each decode kernel stamps %globaltimer at entry, after its programmatic wait, at marks inside, and at exit) and
# prints per-kernel medians at a few positions. Usage (repo root, .devcarry carried):
#   source .devcarry/setup.sh && bash benchmarks/device/trace.sh [N_CTX]
# N_CTX (default 2048) of 8192 adds positions 4000 and 8000 to the trace (issue 13's depth target).
# METALATTN_BENCH_SHAPE (135m, 360m, 1.7b, qwen, gemma) picks the model shape; gemma runs the general path (its norm +
# matvec kernels show as "norm+matvec" (QKV), "norm+gate/up" and "matvec->tmp" (O and down, before their post-norms)).
# METALATTN_TRACE_BLOCKS=$OUT/blocks adds a CSV per position of every block of the last traced step (SM, enter, release,
# exit): `python3 benchmarks/device/trace_blocks.py $OUT/blocks.pos32.csv` shows how each kernel's blocks spread.
cd "$(dirname "$0")/../.."
B=/tmp/btrace
( cmake -S . -B $B -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS=-DMETALATTN_TRACE \
  && cmake --build $B -j16 --target bench_cuda ) > ${OUT:-/tmp}/build_trace.log 2>&1 || { tail -30 ${OUT:-/tmp}/build_trace.log; exit 1; }
timeout 300 $B/bench_cuda "${1:-2048}" trace
