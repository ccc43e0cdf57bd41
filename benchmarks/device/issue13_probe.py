"""Issue 13's two latency targets on synthetic presets, from Python (device, with the package importable):

  python3 benchmarks/device/issue13_probe.py ttft    # 32- and 64-token prompts on the SmolLM2-1.7B shape
  python3 benchmarks/device/issue13_probe.py depth   # decode us/token at depth 32, 1,024, 4,096, 8,000 (135M shape)

Run `ttft` again with METALATTN_CUDA_PROMPT_MMA=0 to time the long-prompt kernel on the same prompts.
"""
import os, statistics, sys, time
import numpy as np
import metalattn
from metalattn import testing

what = sys.argv[1]
if what == "ttft":
    p = "/tmp/s17b.gguf"
    if not os.path.exists(p):
        testing.write_synthetic_gguf(p, **dict(testing.SMOLLM2_1_7B, n_ctx=1024))
    m = metalattn.load(p, device="cuda")
    ids = np.arange(100, 132, dtype=np.int32)
    for n in (32, 64):
        ts = []
        for _ in range(30):
            m.reset()
            t = time.perf_counter(); m.forward_prompt(ids[:n] if n <= 32 else np.arange(100, 100 + n, dtype=np.int32))
            ts.append((time.perf_counter() - t) * 1e3)
        mma = os.environ.get("METALATTN_CUDA_PROMPT_MMA", "1")
        print(f"{what} PROMPT_MMA={mma} n={n}: median {statistics.median(ts[5:]):.3f} ms, min {min(ts):.3f}")
elif what == "depth":
    p = "/tmp/s135.gguf"
    if not os.path.exists(p):
        testing.write_synthetic_gguf(p, **testing.SMOLLM2_135M)
    m = metalattn.load(p, device="cuda")
    rng = np.random.default_rng(1)
    for depth in (32, 1024, 4096, 8000):
        res = []
        for rep in range(3):
            m.reset()
            tok = m.forward_prompt(rng.integers(0, 49152, depth).astype(np.int32))
            for _ in range(8): tok = m.forward_token_greedy(tok)
            t = time.perf_counter()
            for _ in range(128): tok = m.forward_token_greedy(tok)
            res.append((time.perf_counter() - t) / 128 * 1e6)
        print(f"depth {depth}: {statistics.median(res):.1f} us/token ({', '.join(f'{r:.1f}' for r in res)})")
