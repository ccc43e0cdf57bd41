#!/bin/bash
# Per-kernel GPU time of CUDA decode steps on the real-model shapes: ncu replays each graph node alone
# at the running clocks with a warm L2 (gpu__time_duration, so launch gaps and programmatic-launch overlap are NOT in these figures; their sum against
# the measured time per token says how much the chain itself costs). Needs the package in /tmp/site and the models
# of realshapes.sh in /tmp/rs. Usage (repo root, .devcarry carried):
#   source .devcarry/setup.sh && bash benchmarks/device/profile_decode.sh [gemma3-q4_k_m qwen25-q4_k_m ...]
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
names=${*:-gemma3-q4_k_m qwen25-q4_k_m}
for n in $names; do
  cat > /tmp/decode_once.py <<PY
import metalattn, numpy as np
m = metalattn.load("/tmp/rs/$n.gguf", device="cuda", n_ctx=2048)
toks = np.random.default_rng(0).integers(0, m.vocab_size, 32).astype(np.int32)
t = m.forward_prompt(toks)
for _ in range(4): t = m.forward_token_greedy(t)
print("kernels per token", m._engine.kernels_per_token)
PY
  timeout 280 ncu --csv --cache-control none --clock-control none --metrics gpu__time_duration.sum --graph-profiling node python3 /tmp/decode_once.py \
    > "$OUT/ncu_$n.csv" 2> "$OUT/ncu_$n.err"
  echo "== $n: isolated kernel times (ncu), the last decode step"
  python3 - "$OUT/ncu_$n.csv" <<'PY'
import csv, sys, collections
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = list(csv.DictReader(lines))
rows = [r for r in rows if r.get("Metric Name") == "gpu__time_duration.sum"]
# The decode steps are the last 4 * K kernels; K from the stdout line.
import re
k = int(re.search(r"kernels per token (\d+)", open(sys.argv[1]).read()).group(1))
step = rows[-k:]
tot = sum(float(r["Metric Value"].replace(",", "")) for r in step)
unit = step[0]["Metric Unit"]
by = collections.defaultdict(lambda: [0, 0.0])
for r in step:
    nm = r["Kernel Name"].split("(")[0][:90]
    by[nm][0] += 1; by[nm][1] += float(r["Metric Value"].replace(",", ""))
print(f"one step: {k} kernels, sum of isolated times {tot:.0f} {unit}")
for nm, (c, t) in sorted(by.items(), key=lambda x: -x[1][1]):
    print(f"{t/tot*100:5.1f}%  x{c:3d}  mean {t/c:8.0f} {unit}  {nm}")
PY
done
