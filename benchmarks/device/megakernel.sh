#!/bin/bash
# Issue 13's three-step persistent decode prototype (benchmarks/bench_megakernel.cu) in its variants, beside the
# engine's graph path on the same shapes, in one device call. Each variant is one nvcc line (built in parallel here);
# the engine's figure is `bench_cuda <n_ctx> decode` (tg128 after 32 tokens) with METALATTN_BENCH_SHAPE.
# Usage (repo root on the device; no package build needed):
#   bash benchmarks/device/megakernel.sh [VARIANTS]
# VARIANTS: names from the table below (default: all). Logs in $OUT (default ./device-out); prints each variant's
# timings (2 layers and all layers: the slope is a layer's cost) and its per-instruction trace.
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT" /tmp/mk
declare -A FLAGS=(
  [base]=""                                              # SmolLM2-135M shapes, 4 O parts, 16 units, 8 QKV rows
  [relaxed]="-DMK_POLL_RELAXED"                          # counters polled relaxed, one acquire fence after
  [rows16]="-DMK_QKV_ROWS=16"                            # 60 QKV tasks instead of 120
  [rows16_relaxed]="-DMK_QKV_ROWS=16 -DMK_POLL_RELAXED"
  [t512]="-DMK_THREADS=512"                              # 16 warps a block
  [s360]="-DMK_360M"                                     # SmolLM2-360M shapes
  [s360_relaxed]="-DMK_360M -DMK_POLL_RELAXED"
  [s17_t512]="-DMK_1_7B -DMK_THREADS=512"                # SmolLM2-1.7B shapes, 16 warps a block
  [s17_t512_o2]="-DMK_1_7B -DMK_THREADS=512 -DMK_OPARTS=2"
)
VARIANTS=${1:-base,relaxed,rows16,rows16_relaxed,t512,s360,s360_relaxed,s17_t512,s17_t512_o2}
T=$(date +%s)
for v in ${VARIANTS//,/ }; do
  [ -n "${FLAGS[$v]+x}" ] || { echo "megakernel.sh: unknown variant $v (known: ${!FLAGS[*]})"; exit 2; }
  # shellcheck disable=SC2086
  nvcc -O3 -arch=sm_90 -std=c++17 ${FLAGS[$v]} benchmarks/bench_megakernel.cu -o /tmp/mk/$v > "$OUT/nvcc_$v.log" 2>&1 &
done
if [ ! -x /tmp/mk/bench_cuda ]; then
  ( cmake -S . -B /tmp/mk/build -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/bench_build.log" 2>&1 \
    && cmake --build /tmp/mk/build -j8 --target bench_cuda >> "$OUT/bench_build.log" 2>&1 \
    && cp /tmp/mk/build/bench_cuda /tmp/mk/bench_cuda ) &
fi
wait
echo "builds $(( $(date +%s) - T )) s"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for v in ${VARIANTS//,/ }; do
  [ -x /tmp/mk/$v ] || { echo "== $v: build failed"; tail -5 "$OUT/nvcc_$v.log"; continue; }
  timeout 120 /tmp/mk/$v > "$OUT/mk_$v.log" 2>&1
  echo "rc $?" >> "$OUT/mk_$v.log"
  echo "== $v"
  grep -E "us a step|layer \(sum|MISMATCH|rc [^0]|^QKV|^ATTN|^FFN|fit" "$OUT/mk_$v.log" | grep -v "prefetch 0"
done
if [ -x /tmp/mk/bench_cuda ]; then
  for shape in 135m 360m 1.7b; do
    METALATTN_BENCH_SHAPE=$shape timeout 90 /tmp/mk/bench_cuda 2048 decode > "$OUT/engine_$shape.log" 2>&1
    echo "== engine $shape: $(grep -E "tg128" "$OUT/engine_$shape.log" | head -1)"
  done
else
  echo "== engine: bench_cuda build failed"; tail -5 "$OUT/bench_build.log"
fi
echo "total $(( $(date +%s) - T )) s"
