"""CPU decode time per token at given depths: for each depth, a prompt of that many random tokens, then 5 rounds of 8
greedy tokens; prints the median ms a token. Quicker than `metalattn bench -d cpu --depths` (which times 128-token
generations) for same-minutes A/Bs of two builds: run it alternately under each build's Python.
    python benchmarks/cpu_depth.py MODEL.gguf [32,1000,4000] [THREADS]"""
import statistics
import sys
import time

import numpy as np

import metalattn


def main():
    path = sys.argv[1]
    depths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "32,1000,4000").split(",")]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else None
    model = metalattn.load(path, device="cpu", n_ctx=max(8192, max(depths) + 64), n_threads=threads)
    for depth in depths:
        model.reset()
        token = model.forward_prompt(np.random.default_rng(0).integers(0, model.vocab_size, depth).tolist())
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(8):
                token = model.forward_token_greedy(token)
            times.append((time.perf_counter() - t) / 8 * 1e3)
        print(f"depth {depth}: {statistics.median(times):.3f} ms a token", flush=True)


if __name__ == "__main__":
    main()
