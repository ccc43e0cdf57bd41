#!/bin/bash
# SASS of the CUDA kernels of one source file, read on a machine without a GPU (device time is scarce; instruction
# counts and the shape of a hot loop are not). Compiles FILE with the project's flags from a configured CUDA build
# folder, assembles its PTX for sm_90 and disassembles it with cuobjdump and nvdisasm from their PyPI wheels
# (downloaded once into $SASS_TOOLS, default /tmp/sass-tools). Prints, per kernel whose mangled name contains
# PATTERN, its instruction count, MMAs and global loads, and its loops (backward branches) with their lengths;
# the whole listing goes to /tmp/sass/<file>.sass.
#   cmake -S . -B /tmp/btm -G Ninja -DMETALATTN_BUILD_PYTHON=OFF -DMETALATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
#   bash benchmarks/sass.sh /tmp/btm shaders/cuda/prompt_mma.cu 'GgmlTypeE2EEELi1ELb0ELi4E'
set -euo pipefail
build=${1:?usage: sass.sh BUILD_DIR FILE [PATTERN]} file=${2:?usage: sass.sh BUILD_DIR FILE [PATTERN]} pattern=${3:-}
tools=${SASS_TOOLS:-/tmp/sass-tools}
if [ ! -x "$tools/cuobjdump" ] || [ ! -x "$tools/nvdisasm" ]; then
  mkdir -p "$tools/dl"
  python3 -m pip download -q --no-deps -d "$tools/dl" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  for w in "$tools"/dl/*.whl; do python3 -m zipfile -e "$w" "$tools/x" >/dev/null; done
  for t in cuobjdump nvdisasm; do cp "$(find "$tools/x" -name "$t" -type f | head -1)" "$tools/$t"; chmod +x "$tools/$t"; done
fi
obj="CMakeFiles/metalattn_cuda.dir/$file.o"
cmd=$(cd "$build" && ninja -t commands "$obj" | tail -1)
[ -n "$cmd" ] || { echo "sass.sh: $build has no rule for $obj (configure it with -DMETALATTN_CUDA=ON)"; exit 1; }
mkdir -p /tmp/sass
base=/tmp/sass/$(basename "$file")
(cd "$build" && eval "${cmd/-o $obj/-o $base.o}")
"$tools/cuobjdump" -ptx "$base.o" | awk '/^\.version/ {p = 1} /^Fatbin/ {p = 0} p' > "$base.ptx"
ptxas -arch=sm_90 -O3 "$base.ptx" -o "$base.cubin"
PATH=$tools:$PATH "$tools/cuobjdump" -sass "$base.cubin" > "$base.sass"
python3 - "$base.sass" "$pattern" <<'PY'
import collections, re, sys
text, pattern = open(sys.argv[1]).read(), sys.argv[2]
for fn in re.split(r"\n\s*Function : ", text)[1:]:
    name = fn.split("\n")[0].strip()
    if pattern not in name:
        continue
    ins = [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", fn)]
    ops = collections.Counter((op.split()[1] if op.startswith("@") else op.split()[0]) for _, op in ins)
    print(f"{name[:110]}\n  {len(ins)} instructions, {ops['HMMA.16816.F32']} HMMA, "
          f"{sum(v for k, v in ops.items() if k.startswith('LDG'))} LDG, "
          f"{sum(v for k, v in ops.items() if k.startswith('LDS'))} LDS")
    for a, op in ins:
        m = re.search(r"BRA.*?(0x[0-9a-f]+)$", op)
        if m and int(m.group(1), 16) < a:
            print(f"  loop {m.group(1)}..{a:#x}: {(a - int(m.group(1), 16)) // 16 + 1} instructions")
PY
