#!/bin/bash
# The decode attention kernel alone at depth (issue 13's depth target): ncu replays the split attention of a few decode
# steps after a DEPTH-token prompt on a synthetic preset written with n_ctx 8192, and prints its time, DRAM bytes and
# throughput, occupancy and the warp stall reasons (cycles a warp spends per issued instruction, by reason). ncu runs
# each launch alone, so what the kernel overlaps with the kernel before it (its pre-wait loads) is in these times.
# Needs the package importable (e.g. /tmp/site on PYTHONPATH). Usage (repo root, .devcarry carried):
#   source .devcarry/setup.sh && bash benchmarks/device/profile_attention.sh [s135m] [1000,8000]
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
preset=${1:-s135m}
depths=${2:-1000,8000}
N_CTX=8192 python3 benchmarks/device/ab_decode.py write "$preset" > "$OUT/profile_attention_models.log" 2>&1 \
  || { tail -5 "$OUT/profile_attention_models.log"; exit 1; }
for d in ${depths//,/ }; do
  cat > /tmp/attn_once.py <<PY
import metalattn, numpy as np
m = metalattn.load("/tmp/ab_${preset}_8192.gguf", device="cuda", n_ctx=8192)
toks = np.random.default_rng(0).integers(0, m.vocab_size, $d).astype(np.int32)
t = m.forward_prompt(toks)
for _ in range(3):
    t = m.forward_token_greedy(t)
PY
  echo "== $preset at depth $d: decode attention (ncu, two layers of the third decode step)"
  skip=${SKIP:-70}  # two decode steps of a 30-layer preset and 10 layers: layers 11-12 of the third step
  timeout 280 ncu --cache-control none --clock-control none --graph-profiling node -k regex:attention_decode \
    --launch-skip "$skip" --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats --section MemoryWorkloadAnalysis python3 /tmp/attn_once.py > "$OUT/ncu_attn_$d.txt" 2>&1
  grep -E "attention_decode|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Dynamic Shared|Issued Warp Per|No Eligible|Eligible Warps|Warp Cycles Per Issued|Grid Size|Block Size|Mem Busy|Max Bandwidth" \
    "$OUT/ncu_attn_$d.txt" | sed -E 's/ +/ /g' | cut -c1-110
  timeout 280 ncu --csv --cache-control none --clock-control none --graph-profiling node -k regex:attention_decode \
    --launch-skip "$skip" --launch-count 2 --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
    python3 /tmp/attn_once.py > "$OUT/ncu_attn_stalls_$d.csv" 2> "$OUT/ncu_attn_stalls_$d.err"
  python3 "$(dirname "$0")/ncu_stalls.py" "$OUT/ncu_attn_stalls_$d.csv"
done
