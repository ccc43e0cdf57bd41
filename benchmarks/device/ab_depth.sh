#!/bin/bash
# Same-call A/B of CUDA decode speed at depth (issue 13's depth target): the package at a base revision (A) against the
# working tree (B), built side by side (ab_build.sh), `metalattn bench --depths` on synthetic presets written with
# n_ctx 8192. Usage (repo root, .devcarry carried; .devcarry/ab_base.tar made first, see ab_build.sh):
#   source .devcarry/setup.sh && bash benchmarks/device/ab_depth.sh [s135m,s1.7b]
# Environment: DEPTHS (default 32,1024,4096,8000), ROUNDS (A/B alternations, default 2). JSON in $OUT/depth_*.json.
set -o pipefail
PRESETS=${1:-s135m}
source "$(dirname "$0")/ab_build.sh"
N_CTX=8192 ab_build "$PRESETS" ab_depth || exit $?
for n in ${PRESETS//,/ }; do
  for r in $(seq "${ROUNDS:-2}"); do
    for s in A B; do
      json=$OUT/depth_${n}_${s}_$r.json
      PYTHONPATH=/tmp/ab_site$s:$PYTHONPATH timeout 200 python3 -m metalattn bench -m /tmp/ab_${n}_8192.gguf -d cuda \
        -c 8192 --prompt-lengths 32 --depths "${DEPTHS:-32,1024,4096,8000}" --iterations 3 -q --json > "$json" \
        2> "$OUT/depth_${n}_$s.err" || { echo "$n $s: bench failed"; tail -3 "$OUT/depth_${n}_$s.err"; continue; }
      python3 - "$json" "$n" "$s" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
cells = " ".join(f"d{r['depth']} {r['us_per_token']['median']:.0f}us" for r in d.get("decode_at_depth", []))
print(f"{sys.argv[2]:6s} {sys.argv[3]}: {cells}")
PY
    done
  done
done
echo "total $(( $(date +%s) - T )) s"
