#!/bin/bash
# Builds the CUDA kernel tests and bench_cuda for sm_90 on this machine (no GPU needed; 5-15 minutes on 2 cores, a
# few when only one .cu changed) and packs them, xz-compressed (~17 MB each), into .devcarry/bin/<tag>/ so that a
# device call only unpacks and runs them (benchmarks/device/ab_binaries.sh). Device time is the scarce resource:
# building there costs minutes of it per call.
#   bash benchmarks/build_carry.sh TAG [BUILD_DIR] [EXTRA_CUDA_FLAGS]
# e.g. `bash benchmarks/build_carry.sh base` on the base revision, then again with `new` on the change; a trace build:
# `bash benchmarks/build_carry.sh trace /tmp/btrace -DMETALATTN_TRACE`. Four binaries fit the 64 MiB a call carries.
set -euo pipefail
tag=${1:?usage: build_carry.sh TAG [BUILD_DIR] [EXTRA_CUDA_FLAGS]}
build=${2:-/tmp/bcarry} flags=${3:-}
cd "$(dirname "$0")/.."
gt=()
[ -d .devcarry/googletest ] && gt=(-DFETCHCONTENT_SOURCE_DIR_GOOGLETEST="$PWD/.devcarry/googletest")
cmake -S . -B "$build" -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_FLAGS="$flags" "${gt[@]}" > /dev/null
targets=(bench_cuda)
[ -z "$flags" ] && targets+=(test_cuda_kernels)  # the tests of a diagnostic build add nothing
ninja -C "$build" "${targets[@]}"
mkdir -p ".devcarry/bin/$tag"
for t in "${targets[@]}"; do xz -T2 -6 -c "$build/$t" > ".devcarry/bin/$tag/$t.xz"; done
echo "$(git rev-parse --short HEAD)$(git diff --quiet || echo +changes)" > ".devcarry/bin/$tag/REVISION"
ls -la ".devcarry/bin/$tag"
