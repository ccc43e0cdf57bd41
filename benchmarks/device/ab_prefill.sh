#!/bin/bash
# Same-call A/B of CUDA prompt speed and GPU memory: the package at a base revision (A) against the working tree (B),
# built side by side on the device, on metalattn.testing's presets (n_ctx 4096). The device's copy of the tree has no
# git history of local commits, so the base travels as an archive made here first:
#   git archive -o .devcarry/ab_base.tar REV          (on this machine; REV = the base commit)
#   source .devcarry/setup.sh && bash benchmarks/device/ab_prefill.sh [s135m,qwen2,gemma3,s1.7b]
# Environment: PLENS (prompt lengths, default 64,512,2048), TESTS=1 also runs the carried .devcarry/bin/test_cuda_kernels
# while the packages build. Prints per preset and package: ppN medians, tg128 after 32 tokens, Model.memory_info().
# JSON of every bench run: $OUT/bench_<preset>_<A|B>.json.
set -o pipefail
PRESETS=${1:-s135m,qwen2,gemma3,s1.7b}
source "$(dirname "$0")/ab_build.sh"
ab_build "$PRESETS" ab_prefill || exit $?
for n in ${PRESETS//,/ }; do
  for s in A B; do
    json=$OUT/bench_${n}_$s.json
    PYTHONPATH=/tmp/ab_site$s:$PYTHONPATH timeout 120 python3 -m metalattn bench -m /tmp/ab_$n.gguf -d cuda -c 4096 \
      --prompt-lengths "${PLENS:-64,512,2048}" --iterations 5 -q --json > "$json" 2> "$OUT/bench_${n}_$s.err" \
      || { echo "$n $s: bench failed"; tail -3 "$OUT/bench_${n}_$s.err"; continue; }
    PYTHONPATH=/tmp/ab_site$s:$PYTHONPATH python3 - "$json" "$n" "$s" <<'PY'
import json, sys
import metalattn
d = json.load(open(sys.argv[1]))
m = metalattn.load(f"/tmp/ab_{sys.argv[2]}.gguf", device="cuda", n_ctx=4096)
pp = " ".join(f"pp{p['n_prompt']} {p['tokens_per_second']['median']:.0f}" for p in d["prefill"])
mem = {k: f"{v / 2**20:.0f} MiB" for k, v in m.memory_info().items()}
print(f"{sys.argv[2]:7s} {sys.argv[3]}: {pp} tg{d['decode']['n_gen']} {d['decode']['tokens_per_second']['median']:.0f} {mem}")
PY
  done
done
echo "total $(( $(date +%s) - T )) s"
