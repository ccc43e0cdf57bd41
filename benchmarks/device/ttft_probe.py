"""Time to first token under different histories, from Python (the way `metalattn bench` measures it).

Usage (device, after the package is importable): python3 benchmarks/device/ttft_probe.py MODEL.gguf
Prints the median ms of a 32-token prompt at position 0 right after: another prompt, 128 decode steps, 128 decode
steps with the garbage collector off, and 128 decode steps followed by a 2 ms pause; then the decode rate (tg128)
through Model.forward_token_greedy and through the bare engine call, to show the Python layer's cost per token.
"""
import gc
import statistics
import sys
import time

import numpy as np

import metalattn


def main(path: str) -> None:
    m = metalattn.load(path, device="cuda")
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, m.vocab_size, 32).astype(np.int32)
    res = {k: [] for k in ("after prompt", "after decode", "after decode, gc off", "after decode + 2 ms",
                           "after decode, engine call", "reset only")}

    def timed_prompt(direct=False):
        m.reset()
        t = time.perf_counter()
        if direct:
            m._engine.forward_prompt(prompt)
        else:
            m.forward_prompt(prompt)
        return (time.perf_counter() - t) * 1e3

    def decode(n=128):
        m.reset()
        tok = m.forward_prompt(prompt)
        for _ in range(n):
            tok = m.forward_token_greedy(tok)

    for it in range(12):
        timed_prompt()
        a = timed_prompt()
        decode()
        b = timed_prompt()
        gc.disable()
        decode()
        c = timed_prompt()
        gc.enable()
        decode()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2e-3:
            pass
        d = timed_prompt()
        decode()
        e = timed_prompt(direct=True)
        t = time.perf_counter()
        m.reset()
        f = (time.perf_counter() - t) * 1e3
        if it >= 2:
            for k, v in zip(res, (a, b, c, d, e, f)):
                res[k].append(v)
    for k, v in res.items():
        print(f"pp32 {k:28s}: median {statistics.median(v):.3f} ms  min {min(v):.3f}")

    rates = {"Model.forward_token_greedy": [], "engine.forward_token_greedy": []}
    for it in range(8):
        for name, step in (("Model.forward_token_greedy", m.forward_token_greedy),
                           ("engine.forward_token_greedy", m._engine.forward_token_greedy)):
            m.reset()
            tok = m.forward_prompt(prompt)
            t = time.perf_counter()
            for _ in range(128):
                tok = step(tok)
            if it >= 2:
                rates[name].append(128 / (time.perf_counter() - t))
    for k, v in rates.items():
        print(f"tg128 through {k:28s}: median {statistics.median(v):.0f} tok/s")


if __name__ == "__main__":
    main(sys.argv[1])
