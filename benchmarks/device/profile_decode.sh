#!/bin/bash
# Per-kernel GPU time of CUDA decode steps: ncu replays each graph node of the last decode step alone at the running
# clocks (gpu__time_duration, so launch gaps and programmatic-launch overlap are NOT in these figures; their sum
# against the measured time per token says how much the chain itself costs), with the DRAM bytes each read, its
# grid, block, registers and dynamic shared memory. Needs the package in /tmp/site. Usage (repo root, .devcarry
# carried):
#   source .devcarry/setup.sh && bash benchmarks/device/profile_decode.sh [MODEL ...]
# MODEL: a GGUF path, a name of realshapes.sh's models in /tmp/rs (gemma3-q4_k_m, qwen25-q4_k_m: the default), or a
# synthetic preset of ab_decode.py (s135m, s360m, s1.7b, qwen2, gemma3; written to /tmp/ab_NAME.gguf when missing).
# COLD=1 flushes the caches before each kernel (weights then come from HBM, as in a decode step of a model larger
# than L2); the default keeps L2 warm. Session 21 (RESULTS): `COLD=1 ... profile_decode.sh s1.7b qwen2`.
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
cache=$([ -n "$COLD" ] && echo all || echo none)
here=$(cd "$(dirname "$0")" && pwd)
for n in ${*:-gemma3-q4_k_m qwen25-q4_k_m}; do
  if [ -f "$n" ]; then path=$n; n=$(basename "$n" .gguf)
  elif [ -f "/tmp/rs/$n.gguf" ]; then path=/tmp/rs/$n.gguf
  else
    path=/tmp/ab_$n.gguf
    [ -f "$path" ] || PYTHONPATH=$here/../../python:$PYTHONPATH python3 "$here/ab_decode.py" write "$n" > /dev/null \
      || { echo "$n: not a file, a /tmp/rs model or a preset"; continue; }
  fi
  cat > /tmp/decode_once.py <<PY
import metalattn, numpy as np
m = metalattn.load("$path", device="cuda", n_ctx=2048)
toks = np.random.default_rng(0).integers(0, m.vocab_size, 32).astype(np.int32)
t = m.forward_prompt(toks)
for _ in range(4): t = m.forward_token_greedy(t)
print("kernels per token", m._engine.kernels_per_token)
PY
  timeout 280 ncu --csv --cache-control "$cache" --clock-control none --graph-profiling node \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic \
    python3 /tmp/decode_once.py > "$OUT/ncu_$n.csv" 2> "$OUT/ncu_$n.err"
  echo "== $n: isolated kernel times (ncu, L2 $([ -n "$COLD" ] && echo flushed || echo warm)), the last decode step"
  python3 - "$OUT/ncu_$n.csv" <<'PY'
import collections, csv, re, sys
text = open(sys.argv[1]).read()
k = int(re.search(r"kernels per token (\d+)", text).group(1))
launches = collections.OrderedDict()  # ncu's ID -> that launch's metrics
for r in csv.DictReader(l for l in text.splitlines() if l.startswith('"')):
    d = launches.setdefault(r["ID"], {"name": r["Kernel Name"].split("(")[0][:70]})
    d[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
step = list(launches.values())[-k:]  # the last decode step: its K launches
total = sum(d["gpu__time_duration.sum"] for d in step)
by = collections.OrderedDict()
for d in step:
    key = (d["name"], int(d.get("launch__grid_size", 0)), int(d.get("launch__block_size", 0)))
    a = by.setdefault(key, {"n": 0, "ns": 0.0, "bytes": 0.0, "regs": d.get("launch__registers_per_thread", 0),
                            "smem": d.get("launch__shared_mem_per_block_dynamic", 0)})
    a["n"] += 1
    a["ns"] += d["gpu__time_duration.sum"]
    a["bytes"] += d.get("dram__bytes_read.sum", 0.0)
print(f"one step: {k} kernels, sum of isolated times {total / 1000:.1f} us")
print("share  count  mean us  MB read  GB/s  grid x block  regs  dyn smem  kernel")
for (name, grid, block), a in sorted(by.items(), key=lambda x: -x[1]["ns"]):
    print(f"{a['ns'] / total * 100:4.1f}% {a['n']:5d} {a['ns'] / a['n'] / 1000:8.2f} {a['bytes'] / a['n'] / 1e6:8.2f} "
          f"{a['bytes'] / a['ns']:5.0f} {grid:6d} x {block:<4d} {a['regs']:4.0f} {a['smem'] / 1024:7.1f}K  {name}")
PY
done
