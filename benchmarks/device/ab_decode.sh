#!/bin/bash
# Same-call A/B of CUDA decode speed: the package at a base revision (A) against the working tree (B), built side by
# side on the device and run alternately, one process per case, on metalattn.testing's presets. The device's copy of
# the tree has no git history of local commits, so the base travels as an archive made here first:
#   git archive -o .devcarry/ab_base.tar REV          (on this machine; REV = the base commit)
#   source .devcarry/setup.sh && bash benchmarks/device/ab_decode.sh [qwen2,gemma3,s135m,s360m,s1.7b]
# Environment: REPS (alternated rounds, default 2), PLEN (prompt tokens before tg128, default 32), TESTS=1 also runs
# the carried .devcarry/bin/test_cuda_kernels while the packages build. Prints us/token per round and a table of the
# best round per package; same greedy tokens on both sides show as the same hash.
set -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
T=$(date +%s)
[ -f .devcarry/ab_base.tar ] || { echo "ab_decode: make .devcarry/ab_base.tar first (git archive -o .devcarry/ab_base.tar REV)"; exit 2; }
if [ -n "$TESTS" ]; then
  ( timeout 300 .devcarry/bin/test_cuda_kernels > "$OUT/tests.log" 2>&1; echo "tests rc $?" >> "$OUT/tests.log" ) &
fi
rm -rf /tmp/ab_A && mkdir -p /tmp/ab_A && tar -xf .devcarry/ab_base.tar -C /tmp/ab_A
export CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / 2 ))
( cd /tmp/ab_A && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab_siteA . > "$OUT/pipA.log" 2>&1 \
  || { echo "build A failed"; tail -20 "$OUT/pipA.log"; } ) &
( python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab_siteB . > "$OUT/pipB.log" 2>&1 \
  || { echo "build B failed"; tail -20 "$OUT/pipB.log"; } ) &
PYTHONPATH=$PWD/python:$PYTHONPATH python3 benchmarks/device/ab_decode.py write "${1:-qwen2,gemma3,s135m,s1.7b}" \
  > "$OUT/models.log" 2>&1 &
wait
echo "builds, models$([ -n "$TESTS" ] && echo ", tests") $(( $(date +%s) - T )) s"
[ -n "$TESTS" ] && { tail -3 "$OUT/tests.log"; grep -E "FAILED|Failure" "$OUT/tests.log" | head; }
python3 benchmarks/device/ab_decode.py run "${1:-qwen2,gemma3,s135m,s1.7b}" 2>&1 | tee "$OUT/ab.log"
echo "total $(( $(date +%s) - T )) s"
