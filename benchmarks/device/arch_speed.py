"""Decode and prompt speed of the CUDA general path on synthetic models shaped like Gemma 3 270M and Qwen2.5-0.5B
(all layers, the real vocabularies, Q8_0: types every CUDA build reads), at short and long contexts. Run on the
device after the package is built (benchmarks/device/arch.sh builds it):  python3 benchmarks/device/arch_speed.py"""
import os
import time

import numpy as np

import metalattn
from metalattn.testing import GEMMA3_270M, QWEN25_05B, write_synthetic_gguf

CASES = {
    "gemma3-270m-q8_0": {**GEMMA3_270M, "quant": "q8_0", "embd_quant": "q8_0", "quants_by_part": None},
    "qwen2.5-0.5b-q8_0": {**QWEN25_05B, "quant": "q8_0", "embd_quant": "q8_0", "output_quant": "q8_0",
                          "quants_by_part": None},
}

for name, kw in CASES.items():
    path = f"/tmp/{name}.gguf"
    if not os.path.exists(path):
        write_synthetic_gguf(path, **{**kw, "n_ctx": 8192})
    m = metalattn.load(path, device="cuda", n_ctx=8192)
    toks = np.random.default_rng(0).integers(0, m.vocab_size, 8192).tolist()
    for plen in (32, 2048, 7900):
        m.reset()
        tok = m.forward_prompt(toks[:plen])  # first use of this length runs eagerly; the second is a graph
        m.reset()
        t = time.perf_counter()
        tok = m.forward_prompt(toks[:plen])
        pt = time.perf_counter() - t
        n = 256 if plen < 7900 else 200
        t = time.perf_counter()
        for _ in range(n):
            tok = m.forward_token_greedy(tok)
        dt = time.perf_counter() - t
        print(f"{name}: {m._engine.kernels_per_token} kernels/token; prompt {plen}: {pt * 1e3:.2f} ms "
              f"({plen / pt:.0f} tok/s); decode from there: {n / dt:.0f} tok/s ({dt / n * 1e6:.0f} us/token)",
              flush=True)
