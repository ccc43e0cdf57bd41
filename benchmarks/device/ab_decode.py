"""The measuring half of benchmarks/device/ab_decode.sh: `write MODELS` writes the synthetic presets (n_ctx 4096, or
$N_CTX: /tmp/ab_NAME_NCTX.gguf) to /tmp; `run MODELS` times tg128 after PLEN prompt tokens (6 rounds in one process, the first dropped, median) for the
packages in /tmp/ab_siteA and /tmp/ab_siteB, alternated REPS times; `one PATH` is one such process."""
import os
import statistics
import subprocess
import sys
import time

PRESETS = {"qwen2": "QWEN25_05B", "gemma3": "GEMMA3_270M", "s135m": "SMOLLM2_135M", "s360m": "SMOLLM2_360M",
           "s1.7b": "SMOLLM2_1_7B"}


def path_of(name):
    ctx = os.environ.get("N_CTX", "4096")
    return f"/tmp/ab_{name}.gguf" if ctx == "4096" else f"/tmp/ab_{name}_{ctx}.gguf"


def one(path):
    import numpy as np
    import metalattn
    m = metalattn.load(path, device="cuda", n_ctx=4096)
    prompt = np.random.default_rng(1).integers(0, m.vocab_size, int(os.environ.get("PLEN", "32"))).tolist()
    per_token, seq = [], []
    for rnd in range(6):
        m.reset()
        tok = m.forward_prompt(prompt)
        seq = []
        t = time.perf_counter()
        for _ in range(128):
            tok = m.forward_token_greedy(tok)
            seq.append(tok)
        if rnd:
            per_token.append((time.perf_counter() - t) / 128 * 1e6)
    print(f"{statistics.median(per_token):.1f} {hash(tuple(seq)) & 0xffff:04x}")


def main():
    what, names = sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else []
    if what == "one":
        return one(names[0])
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        sys.exit(f"ab_decode: unknown preset(s) {unknown}; known: {', '.join(PRESETS)}")
    if what == "write":
        import metalattn.testing as mt
        for n in names:
            if not os.path.exists(path_of(n)):
                t = time.time()
                n_ctx = int(os.environ.get("N_CTX", "4096"))  # other than 4096: the file name says it
                mt.write_synthetic_gguf(path_of(n), **{**getattr(mt, PRESETS[n]), "n_ctx": n_ctx})
                print(f"wrote {path_of(n)} in {time.time() - t:.0f} s", flush=True)
        return
    best = {}
    for n in names:
        for rep in range(int(os.environ.get("REPS", "2"))):
            for pkg in "AB":
                env = dict(os.environ, PYTHONPATH=f"/tmp/ab_site{pkg}:" + os.environ.get("PYTHONPATH", ""))
                out = subprocess.run([sys.executable, __file__, "one", path_of(n)], env=env, capture_output=True,
                                     text=True)
                if out.returncode:
                    print(f"{n:7s} {pkg} failed: {out.stderr.strip()[-300:]}", flush=True)
                    continue
                us, h = out.stdout.split()
                best[(n, pkg)] = min(best.get((n, pkg), float("inf")), float(us))
                print(f"{n:7s} {pkg} round {rep}: {float(us):7.1f} us/token, tokens {h}", flush=True)
    print("\npreset   A (base) us/token   B (tree) us/token   B speed-up")
    for n in names:
        a, b = best.get((n, "A"), float("nan")), best.get((n, "B"), float("nan"))
        print(f"{n:7s} {a:18.1f} {b:19.1f} {a / b:11.3f}x")


if __name__ == "__main__":
    main()
