#!/bin/bash
# Per-kernel GPU time of a few-token CUDA prompt (time to first token) on synthetic presets: ncu replays each graph
# node of the last of three N-token prompts alone (gpu__time_duration, L2 and DRAM bytes), so launch gaps and
# programmatic-launch overlap are not in these figures; their sum against the measured prompt time says what the chain
# costs. Needs the package importable (e.g. /tmp/site on PYTHONPATH). Usage (repo root, .devcarry carried):
#   source .devcarry/setup.sh && bash benchmarks/device/profile_prompt.sh [s1.7b,s135m] [N_TOKENS]
# DETAIL=1 adds ncu's speed-of-light, occupancy, warp-state and scheduler figures of the first layer's four projections
# (the third prompt's first four prompt_mma launches); STALLS=1 the same four kernels' warp stall reasons (cycles a warp
# spends per issued instruction, by reason) and instruction counts.
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
presets=${1:-s1.7b}
n_tok=${2:-32}
python3 benchmarks/device/ab_decode.py write "$presets" > "$OUT/profile_prompt_models.log" 2>&1 \
  || { tail -5 "$OUT/profile_prompt_models.log"; exit 1; }
for n in ${presets//,/ }; do
  cat > /tmp/prompt_once.py <<PY
import metalattn, numpy as np
m = metalattn.load("/tmp/ab_$n.gguf", device="cuda", n_ctx=4096)
toks = np.random.default_rng(0).integers(0, m.vocab_size, $n_tok).astype(np.int32)
for _ in range(3):
    m.reset()
    m.forward_prompt(toks)
PY
  timeout 240 ncu --csv --cache-control none --clock-control none --graph-profiling node \
    --metrics gpu__time_duration.sum,lts__t_bytes.sum,dram__bytes_read.sum python3 /tmp/prompt_once.py \
    > "$OUT/ncu_prompt_$n.csv" 2> "$OUT/ncu_prompt_$n.err" || { echo "$n: ncu failed"; tail -5 "$OUT/ncu_prompt_$n.err"; continue; }
  echo "== $n: $n_tok-token prompt, isolated kernel times (ncu), the last of three prompts"
  python3 - "$OUT/ncu_prompt_$n.csv" <<'PY'
import collections, csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.DictReader(lines))
by_id = collections.OrderedDict()
for r in rows:
    k = (r["ID"], r["Kernel Name"].split("(")[0].replace("void ", "")[:80])
    by_id.setdefault(k, {})[r["Metric Name"]] = (float(r["Metric Value"].replace(",", "")), r["Metric Unit"])
kernels = list(by_id.items())
# One prompt is the kernels after the second-to-last embedding launch (each prompt starts with one).
starts = [i for i, ((_, name), _) in enumerate(kernels) if "embed" in name]
last = kernels[starts[-1]:] if starts else kernels
def val(m, key, scale):
    v, unit = m.get(key, (0.0, ""))
    mult = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}[unit]
    return v * mult / scale
tot = sum(val(m, "gpu__time_duration.sum", 1) for _, m in last)
by = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
for (_, name), m in last:
    b = by[name]
    b[0] += 1
    b[1] += val(m, "gpu__time_duration.sum", 1)
    b[2] += val(m, "lts__t_bytes.sum", 1e6)
    b[3] += val(m, "dram__bytes_read.sum", 1e6)
print(f"one prompt: {len(last)} kernels, sum of isolated times {tot:.0f} us")
print(f"{'share':>6} {'n':>4} {'us':>8} {'L2 MB':>8} {'DRAM MB':>8}  kernel")
for name, (c, t, l2, dr) in sorted(by.items(), key=lambda x: -x[1][1]):
    print(f"{t / tot * 100:5.1f}% {c:4d} {t:8.1f} {l2:8.1f} {dr:8.1f}  {name}")
PY
  if [ -n "$DETAIL" ]; then
    echo "== $n: first layer's projections (QKV, O, gate/up, down), ncu sections"
    timeout 240 ncu --cache-control none --clock-control none --graph-profiling node -k regex:prompt_mma \
      --launch-skip 192 --launch-count 4 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis python3 /tmp/prompt_once.py \
      > "$OUT/ncu_detail_$n.txt" 2>&1
    grep -E "prompt_mma_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Dynamic Shared|Issued Warp Per|No Eligible|Active Warps Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Grid Size|Cluster Size|Mem Busy|Max Bandwidth" "$OUT/ncu_detail_$n.txt" | sed -E 's/ +/ /g' | cut -c1-110
    grep -iE "stall|estimated speedup" "$OUT/ncu_detail_$n.txt" | sed -E 's/ +/ /g' | cut -c1-200 | head -12
  fi
  if [ -n "$STALLS" ]; then
    echo "== $n: first layer's projections (QKV, O, gate/up, down): stall cycles per issued instruction"
    timeout 240 ncu --csv --cache-control none --clock-control none --graph-profiling node -k regex:prompt_mma \
      --launch-skip 192 --launch-count 4 --metrics gpu__time_duration.sum,smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
      python3 /tmp/prompt_once.py > "$OUT/ncu_stalls_$n.csv" 2> "$OUT/ncu_stalls_$n.err"
    python3 "$(dirname "$0")/ncu_stalls.py" "$OUT/ncu_stalls_$n.csv"
  fi
done
