#!/bin/bash
# Same-call A/B of decode on binaries built on the CPU machine (benchmarks/build_carry.sh) and carried in
# .devcarry/bin/<tag>/: runs the kernel tests of the last tag given, then `bench_cuda 2048 decode` (tg128 after a
# 32-token prompt, and the same steps run ahead) of every tag on every shape, alternated, ROUNDS times. Usage (repo
# root; carry only the .xz files the call needs, e.g. [".devcarry/bin/base/bench_cuda.xz", ".devcarry/bin/new"]):
#   SHAPES="qwen gemma 135m 1.7b" ROUNDS=2 TESTS=1 bash benchmarks/device/ab_binaries.sh base new
# A tag named `trace` (`build_carry.sh trace /tmp/btrace -DMETALATTN_TRACE`) runs `bench_cuda 2048 trace` once per
# shape instead, its table to $OUT/trace_<shape>.txt; with METALATTN_TRACE_BLOCKS=<prefix> also the block logs
# (<prefix>_<shape>.pos<P>.csv; benchmarks/device/trace_blocks.py reads them).
# MODE=prefill runs bench_cuda's whole table and keeps its prompt times (ms): the first token of 32 after a decode
# run, and pp1 .. pp2048.
# MODE=depth runs `bench_cuda $NCTX depth` (decode at depths 32 .. 8,000; NCTX defaults to 8192 there; other depths
# with METALATTN_BENCH_DEPTHS=32,96,160) in place of the tg128 decode; NCTX (default 2048 otherwise) is the context
# of every mode (a trace reaches 8,000 at 8192).
# A variant may name environment settings after its tag, `TAG@VAR=VALUE[,VAR=VALUE...]`: the same binary run under
# them (an experiment's switches), e.g. `ab_binaries.sh new new@METALATTN_X_FOO=1`.
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT" /tmp/abbin
T=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for tag in $(printf '%s\n' "$@" | sed 's/@.*//' | sort -u); do
  for f in .devcarry/bin/$tag/*.xz; do
    [ -f "$f" ] || continue
    b=/tmp/abbin/$tag/$(basename "$f" .xz)
    mkdir -p /tmp/abbin/$tag && xz -dc "$f" > "$b" && chmod +x "$b"
  done
  echo "$tag: $(cat .devcarry/bin/$tag/REVISION 2>/dev/null)"
done
MODE=${MODE:-decode}
NCTX=${NCTX:-$([ "$MODE" = depth ] && echo 8192 || echo 2048)}
last=${!#}
last=${last%%@*}
if [ -n "$TESTS" ] && [ -x /tmp/abbin/$last/test_cuda_kernels ]; then
  timeout 300 /tmp/abbin/$last/test_cuda_kernels > "$OUT/tests_$last.log" 2>&1
  echo "tests of $last: rc $? | $(tail -1 "$OUT/tests_$last.log")"
  grep -E "^\[  FAILED|Failure" "$OUT/tests_$last.log" | head -20
fi
for r in $(seq 1 "${ROUNDS:-2}"); do
  for sh in ${SHAPES:-qwen gemma 135m 1.7b}; do
    for spec in "$@"; do
      tag=${spec%%@*} vars=()
      [ "$spec" != "$tag" ] && IFS=, read -ra vars <<< "${spec#*@}"
      # bench_cuda of this variant on this shape: run TIMEOUT_S [MODE_ARG]
      run() { env "${vars[@]}" METALATTN_BENCH_SHAPE=$sh timeout "$1" /tmp/abbin/$tag/bench_cuda "$NCTX" "${@:2}"; }
      if [ "$tag" = trace ]; then
        if [ "$r" = 1 ]; then
          vars+=(${METALATTN_TRACE_BLOCKS:+METALATTN_TRACE_BLOCKS=${METALATTN_TRACE_BLOCKS}_$sh})
          run 120 trace > "$OUT/trace_$sh.txt" 2>&1
          echo "$sh trace: $(grep -m1 "decode step" "$OUT/trace_$sh.txt")"
        fi
        continue
      fi
      case $MODE in
        prefill) echo "$sh $spec r$r: $(run 120 | grep -E "^prefill pp|^pp32 ms" |
                   sed -E 's/prefill (pp[0-9]+) *: *([0-9.]+) ms.*/\1 \2/; s/^pp32 ms right after: 128 decode steps ([0-9.]+).*/ttft \1/' |
                   tr '\n' ' ') (ms)" ;;
        depth) echo "$sh $spec r$r: $(run 120 depth | grep "at depth" | sed 's/decode at depth //; s/median //' | tr '\n' ' ')" ;;
        *) echo "$sh $spec r$r: $(run 90 decode | grep tg128 | tr '\n' ' ')" ;;
      esac
    done
  done
  echo "round $r: $(( $(date +%s) - T )) s"
done
