#!/bin/bash
# Builds, side by side on the device, what one session's GPU call usually needs: the Python package into /tmp/site,
# the CUDA GoogleTests (/tmp/b/test_cuda_kernels) and, with TRACE=1, the chain-trace bench_cuda
# (/tmp/btrace/bench_cuda, see trace.sh). Source it after .devcarry/setup.sh (repo root):
#   source .devcarry/setup.sh && source benchmarks/device/build_all.sh && /tmp/b/test_cuda_kernels ...
# Logs in $OUT (default ./device-out); prints the build time and the tail of any failed log; returns 1 on failure.
OUT=${OUT:-$PWD/device-out}
export OUT
mkdir -p "$OUT"
_t0=$(date +%s)
_cf=(-G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_BUILD_TESTS=ON -DMETALATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
_jobs=$(( $(nproc) / 2 ))
# A warm machine may hold these build folders from a configure with another generator, which cmake refuses.
for _d in /tmp/b /tmp/btrace; do
  [ ! -f "$_d/CMakeCache.txt" ] || grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja$" "$_d/CMakeCache.txt" || rm -rf "$_d"
done
( python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site . > "$OUT/pip.log" 2>&1 \
  || { echo "package build failed"; tail -20 "$OUT/pip.log"; exit 1; } ) &
_p1=$!
( cmake -S . -B /tmp/b "${_cf[@]}" > "$OUT/build_tests.log" 2>&1 \
  && cmake --build /tmp/b -j"$_jobs" --target test_cuda_kernels >> "$OUT/build_tests.log" 2>&1 \
  || { echo "test build failed"; tail -20 "$OUT/build_tests.log"; exit 1; } ) &
_p2=$!
_p3=
if [ -n "$TRACE" ]; then
  ( cmake -S . -B /tmp/btrace "${_cf[@]}" -DCMAKE_CUDA_FLAGS=-DMETALATTN_TRACE > "$OUT/build_trace.log" 2>&1 \
    && cmake --build /tmp/btrace -j"$_jobs" --target bench_cuda >> "$OUT/build_trace.log" 2>&1 \
    || { echo "trace build failed"; tail -20 "$OUT/build_trace.log"; exit 1; } ) &
  _p3=$!
fi
_rc=0
for _p in $_p1 $_p2 $_p3; do wait "$_p" || _rc=1; done
echo "builds: $(( $(date +%s) - _t0 )) s"
[ $_rc -eq 0 ]
