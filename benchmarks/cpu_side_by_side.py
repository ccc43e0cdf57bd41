"""metalattn and llama.cpp on the same GGUF file, the same machine and the same threads, alternated A B A B.

    python benchmarks/cpu_side_by_side.py MODEL.gguf [MODEL2.gguf ...] --llama-bench PATH [--rounds 2] [-t 2]
        [--isa avx2]

--isa runs metalattn with METALATTN_CPU_ISA set (e.g. avx2 on an AVX-512 host, beside a llama.cpp built with
-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF: the AVX2 paths of both on the same machine).

Each round runs llama-bench (pp512 and tg128, its own repetitions) and then `metalattn bench` (pp512; tg128 after a
32-token prompt) on the CPU; the table gives the median over rounds of each tool's per-round median, and the ratio.
Alternating keeps a noisy shared VM from favouring whichever tool ran while the machine was quiet. llama-bench is
built from the source the llama-cpp-python sdist vendors (`-DGGML_NATIVE=ON`). JSON of every round goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def llama_bench(path: str, exe: str, threads: int, reps: int) -> dict:
    out = subprocess.run([exe, "-m", path, "-t", str(threads), "-p", "512", "-n", "128", "-r", str(reps), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    res = {}
    for r in rows:
        key = "pp512" if r.get("n_prompt") == 512 and r.get("n_gen") == 0 else "tg128"
        res[key] = float(r["avg_ts"])
    return res


def metalattn_bench(path: str, threads: int, reps: int, isa: str | None = None) -> dict:
    env = dict(os.environ)
    if isa:
        env["METALATTN_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-m", "metalattn", "bench", "-m", path, "-d", "cpu", "-t", str(threads),
                          "--prompt-lengths", "512", "--gen-length", "128", "--iterations", str(reps), "--json",
                          "--quiet"], capture_output=True, text=True, check=True, env=env).stdout
    r = json.loads(out)
    res = {"pp512": r["prefill"][0]["tokens_per_second"]["median"],
           "tg128": r["decode"]["tokens_per_second"]["median"], "raw": r}
    if "fraction_of_bandwidth_floor" in r["decode"]:  # decode over (read bandwidth / weight bytes per token)
        res["floor_fraction"] = r["decode"]["fraction_of_bandwidth_floor"]
        res["bandwidth_GBps"] = r["decode"]["bandwidth_bytes_per_second"] / 1e9
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="repetitions inside each tool per round")
    ap.add_argument("--isa", default=None, help="METALATTN_CPU_ISA for metalattn (scalar, avx2, avx512)")
    ap.add_argument("--out", default=None, help="write every round's figures here as JSON")
    args = ap.parse_args()
    report = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "machine": os.uname().machine,
              "isa": args.isa or "best", "llama_bench": args.llama_bench, "models": {}}
    for path in args.models:
        rounds = []
        for i in range(args.rounds):
            a = llama_bench(path, args.llama_bench, args.threads, args.reps)
            b = metalattn_bench(path, args.threads, args.reps, args.isa)
            rounds.append({"llama.cpp": a, "metalattn": {k: v for k, v in b.items() if k != "raw"}})
            print(f"{os.path.basename(path)} round {i + 1}: llama.cpp {a}  metalattn "
                  f"{ {k: round(v, 1) for k, v in b.items() if k != 'raw'} }", file=sys.stderr, flush=True)
        med = {tool: {k: statistics.median(r[tool][k] for r in rounds) for k in ("pp512", "tg128")}
               for tool in ("llama.cpp", "metalattn")}
        report["models"][os.path.basename(path)] = {"rounds": rounds, "median": med}
    print(f"| model | llama.cpp pp512 | metalattn pp512 | ratio | llama.cpp tg128 | metalattn tg128 | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, r in report["models"].items():
        a, b = r["median"]["llama.cpp"], r["median"]["metalattn"]
        print(f"| {name} | {a['pp512']:.1f} | {b['pp512']:.1f} | {b['pp512'] / a['pp512']:.2f}x | "
              f"{a['tg128']:.1f} | {b['tg128']:.1f} | {b['tg128'] / a['tg128']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
