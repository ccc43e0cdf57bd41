#!/bin/bash
# `metalattn bench -d cuda` on a synthetic model written from one of metalattn.testing's presets (its real file's
# shape and tensor types), once per environment variant, variants alternated, ROUNDS times: an A/B of an engine switch
# on the installed package (PYTHONPATH, e.g. /tmp/site from `realshapes.sh package`) without a second build.
#   PRESET=QWEN25_05B ROUNDS=2 bash benchmarks/device/preset_bench_env.sh - METALATTN_CUDA_GENERAL=1
# A variant is `-` (no setting) or VAR=VALUE[,VAR=VALUE...]. Prints one line per run (prompt tok/s and ms, decode
# tok/s, time to first token); the JSON of each run goes to $OUT/bench_<preset>_<variant>_r<round>.json.
set -o pipefail
OUT=${OUT:-$PWD/device-out}
PRESET=${PRESET:-QWEN25_05B}
mkdir -p "$OUT" /tmp/rs
f=/tmp/rs/preset_${PRESET}.gguf
[ -f "$f" ] || python3 -c "from metalattn.testing import write_synthetic_gguf, $PRESET as p; write_synthetic_gguf('$f', **p)" \
  || { echo "could not write the $PRESET model"; exit 1; }
for r in $(seq 1 "${ROUNDS:-2}"); do
  for spec in "$@"; do
    vars=()
    [ "$spec" != - ] && IFS=, read -ra vars <<< "$spec"
    j="$OUT/bench_${PRESET}_${spec//[^A-Za-z0-9]/_}_r$r.json"
    env "${vars[@]}" timeout 300 python3 -m metalattn bench -m "$f" -d cuda --prompt-lengths "${LENGTHS:-32,512}" \
      --iterations "${ITERATIONS:-10}" --json -q > "$j" 2> "${j%.json}.err" || { tail -5 "${j%.json}.err"; continue; }
    python3 - "$j" "$spec" "$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
parts = ["pp%d %.0f (%.3f ms)" % (p["n_prompt"], p["tokens_per_second"]["median"], p["ms"]["median"]) for p in d["prefill"]]
x = d.get("decode")
if x:
    parts.append("tg%d %.0f, TTFT %.3f ms" % (x["n_gen"], x["tokens_per_second"]["median"], x["time_to_first_token_ms"]["median"]))
print("%s r%s: %s" % (sys.argv[2], sys.argv[3], " | ".join(parts)))
PY
  done
done
