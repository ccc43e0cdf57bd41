#!/bin/bash
# Builds llama.cpp's CUDA tools (llama-bench, llama-quantize) for sm_90 on this machine, from the source that the
# llama-cpp-python sdist vendors (packed by ../shared/device/pack.sh as .devcarry/llama.cpp.tar.xz), and packs
# them with their shared libraries into .devcarry/llamacpp-bin.tar.xz (~42 MB), which
# benchmarks/device/realshapes.sh unpacks instead of building on the device (~6.5 minutes of device time there;
# ~45-60 minutes here on 2 cores: run it in the background, `nice`d, early in a session). This machine has the CUDA
# toolkit but no driver, so executables link with --allow-shlib-undefined (libcuda.so.1 resolves on the device).
#   bash benchmarks/build_llamacpp_carry.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
src=.devcarry/llama.cpp.tar.xz
[ -f "$src" ] || { echo "no $src: run ../shared/device/pack.sh first" >&2; exit 1; }
work=${1:-/tmp/lcpp}
mkdir -p "$work"
[ -d "$work/llama.cpp" ] || tar xJf "$src" -C "$work"
source benchmarks/llamacpp_cmake_flags.sh
cmake -S "$work/llama.cpp" -B "$work/b" "${LLAMACPP_CMAKE_FLAGS[@]}" \
  -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,--allow-shlib-undefined" > "$work/cfg.log"
cmake --build "$work/b" -j"$(nproc)" --target llama-bench llama-quantize
tar cf - -C "$work/b" bin | xz -T"$(nproc)" -9 > .devcarry/llamacpp-bin.tar.xz
ls -la .devcarry/llamacpp-bin.tar.xz
