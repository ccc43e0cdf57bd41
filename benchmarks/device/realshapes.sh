#!/bin/bash
# metalattn and llama.cpp side by side on the H100, on files shaped like the real Gemma 3 270M and
# Qwen2.5-Coder-0.5B Q4_K_M models (the GPU machine cannot hold the real files): a synthetic F16 model from
# metalattn.testing's preset, quantized to Q4_K_M by llama.cpp's own llama-quantize, so both tools read the same
# file with the same per-tensor types as the real ones. Stages (repo root, .devcarry carried with llama.cpp.tar.xz):
#   source .devcarry/setup.sh && bash benchmarks/device/realshapes.sh [llamacpp] [package] [models] [bench]
#   llamacpp: llama.cpp's CUDA tools into /tmp/llama.cpp/b: unpacked from .devcarry/llamacpp-bin.tar.xz where it was
#             carried (benchmarks/build_llamacpp_carry.sh builds it on the CPU machine), else built here (about 6.5
#             minutes of device time on 16 cores; kept while warm)
#   package:  build metalattn into /tmp/site
#   models:   write /tmp/rs/{gemma3,qwen25}-q4_k_m.gguf
#   bench:    llama-bench (-fa 1, all layers on the GPU) then `metalattn bench -d cuda`, each model, tables to $OUT
#   shapes:   the same for the three SmolLM2 shapes (135M, 360M, 1.7B; synthetic Q4_0 layers + Q8_0 embeddings
#             written by metalattn.testing, read by both engines as they are)
# PLENS (default 32,512) sets the prompt lengths both tools time; SHAPES (default all three) the SmolLM2 shapes, e.g.
# SHAPES="smollm2_1_7b:SMOLLM2_1_7B".
set -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT" /tmp/rs
LB=/tmp/llama.cpp/b/bin
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # carried tools: CUDA runtime, cuBLAS
# llama-bench, then metalattn bench, on one file; tables to stdout, raw output to $OUT.
bench_one() {
  local name=$1 f=$2
  echo "== $name"
  timeout 200 $LB/llama-bench -m $f -p ${PLENS:-32,512} -n 128 -fa 1 -ngl 99 -r 5 -o md 2>/dev/null | tee "$OUT/llamabench_$name.md"
  timeout 200 python3 -m metalattn bench -m $f -d cuda --prompt-lengths ${PLENS:-32,512} --iterations 10 --json -q \
    > "$OUT/metalattn_$name.json" 2> "$OUT/metalattn_$name.err" || tail -5 "$OUT/metalattn_$name.err"
  python3 -c "import json; from metalattn.bench import format_table; print(format_table(json.load(open('$OUT/metalattn_$name.json'))))"
}
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    llamacpp)
      if [ ! -x $LB/llama-bench ] && [ -f .devcarry/llamacpp-bin.tar.xz ]; then
        mkdir -p /tmp/llama.cpp/b && tar xJf .devcarry/llamacpp-bin.tar.xz -C /tmp/llama.cpp/b
      fi
      if [ ! -x $LB/llama-bench ]; then
        rm -rf /tmp/llama.cpp && tar xJf .devcarry/llama.cpp.tar.xz -C /tmp
        source benchmarks/llamacpp_cmake_flags.sh
        (cmake -S /tmp/llama.cpp -B /tmp/llama.cpp/b "${LLAMACPP_CMAKE_FLAGS[@]}" \
         && cmake --build /tmp/llama.cpp/b -j"$(nproc)" --target llama-bench llama-quantize llama-perplexity) \
          > "$OUT/llamacpp_build.log" 2>&1 || { tail -20 "$OUT/llamacpp_build.log"; exit 1; }
      fi ;;
    package)
      python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site . > "$OUT/pip.log" 2>&1 \
        || { tail -30 "$OUT/pip.log"; exit 1; } ;;
    models)
      for m in gemma3:GEMMA3_270M qwen25:QWEN25_05B; do
        name=${m%%:*}; preset=${m#*:}
        [ -f /tmp/rs/$name-q4_k_m.gguf ] && continue
        python3 -c "
from metalattn.testing import write_synthetic_gguf, $preset as p
kw = dict(p); kw.update(quant='f16', embd_quant='f16', output_quant=None, quants_by_part=None, n_ctx=8192)
write_synthetic_gguf('/tmp/rs/$name-f16.gguf', **kw)" || exit 1
        $LB/llama-quantize /tmp/rs/$name-f16.gguf /tmp/rs/$name-q4_k_m.gguf Q4_K_M > "$OUT/quantize_$name.log" 2>&1 \
          || { tail -20 "$OUT/quantize_$name.log"; exit 1; }
        rm -f /tmp/rs/$name-f16.gguf
      done ;;
    bench)
      for name in gemma3 qwen25; do bench_one $name /tmp/rs/$name-q4_k_m.gguf; done ;;
    shapes)
      for m in ${SHAPES:-smollm2_135m:SMOLLM2_135M smollm2_360m:SMOLLM2_360M smollm2_1_7b:SMOLLM2_1_7B}; do
        name=${m%%:*}; preset=${m#*:}; f=/tmp/rs/$name.gguf
        [ -f $f ] || python3 -c "from metalattn.testing import write_synthetic_gguf, $preset as p; write_synthetic_gguf('$f', **p)" || exit 1
        bench_one $name $f
      done ;;
  esac
  echo "[$stage: $(( $(date +%s) - t0 )) s]"
done
