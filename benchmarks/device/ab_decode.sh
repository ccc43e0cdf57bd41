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
source "$(dirname "$0")/ab_build.sh"
ab_build "${1:-qwen2,gemma3,s135m,s1.7b}" ab_decode || exit $?
python3 benchmarks/device/ab_decode.py run "${1:-qwen2,gemma3,s135m,s1.7b}" 2>&1 | tee "$OUT/ab.log"
echo "total $(( $(date +%s) - T )) s"
