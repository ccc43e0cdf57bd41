"""How much a random test model amplifies the fp16 K/V cache's rounding flips (NOTES, "CUDA, session 20").

Two engines compute the same K/V value in fp32 with last-bit differences; where that value lies near the midpoint of
two fp16 neighbours, the engines' caches hold values 2^-11 apart. This runs the CUDA tests' random model
(tests/cpp/cuda_test_util.h make_model: SmolLM2-135M widths, 4 layers, weights of std sigma, norm weights U(0.6, 1.4),
embedding std 1, RoPE base 1e5) in float64 twice over the same tokens, once with every K/V value nudged by NUDGE
(relative, normal) before its fp16 rounding, and prints each model's worst row (relative L2 of the logits).

    python3 benchmarks/flip_noise.py QK_SIGMA NUDGE TOKENS MODELS     e.g. 2 1e-6 104 12

QK_SIGMA: the q and k weights' sigma in units of 1/sqrt(d_model).
"""
import sys

import numpy as np

D, D_FF, N_HEADS, N_KV, HD, VOCAB, N_LAYERS = 576, 1536, 9, 3, 64, 2048, 4


def rope(x, pos):  # x [n, heads, HD], interleaved pairs
    i = np.arange(HD // 2)
    th = pos[:, None] * 100000.0 ** (-2 * i / HD)
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def rmsnorm(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w


def fp16(x):
    return x.astype(np.float32).astype(np.float16).astype(np.float64)


def forward(w, toks, nudge, rng):
    n = len(toks)
    pos = np.arange(n)
    x = w["emb"][toks]
    group = N_HEADS // N_KV
    for layer in w["layers"]:
        h = rmsnorm(x, layer["attn_norm"])
        q = rope((h @ layer["q"].T).reshape(n, N_HEADS, HD), pos)
        k = rope((h @ layer["k"].T).reshape(n, N_KV, HD), pos)
        v = (h @ layer["v"].T).reshape(n, N_KV, HD)
        if nudge:
            k = k * (1 + nudge * rng.standard_normal(k.shape))
            v = v * (1 + nudge * rng.standard_normal(v.shape))
        k, v = fp16(k), fp16(v)
        att = np.empty((n, N_HEADS, HD))
        for hh in range(N_HEADS):
            s = q[:, hh] @ k[:, hh // group].T / np.sqrt(HD)
            s[np.triu_indices(n, 1)] = -np.inf
            p = np.exp(s - s.max(1, keepdims=True))
            att[:, hh] = (p / p.sum(1, keepdims=True)) @ v[:, hh // group]
        x = x + att.reshape(n, -1) @ layer["o"].T
        h = rmsnorm(x, layer["ffn_norm"])
        g, u = h @ layer["gate"].T, h @ layer["up"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ layer["down"].T
    return rmsnorm(x, w["out_norm"]) @ w["emb"].T


def random_model(seed, qk_sigma):
    r = np.random.default_rng(seed)
    sd, sf = D ** -0.5, D_FF ** -0.5
    mat = lambda rows, cols, sigma: r.standard_normal((rows, cols)) * sigma
    norm = lambda n: r.uniform(0.6, 1.4, n)
    layers = [{"attn_norm": norm(D), "ffn_norm": norm(D), "q": mat(N_HEADS * HD, D, qk_sigma * sd),
               "k": mat(N_KV * HD, D, qk_sigma * sd), "v": mat(N_KV * HD, D, sd), "o": mat(D, N_HEADS * HD, 0.5 * sd),
               "gate": mat(D_FF, D, sd), "up": mat(D_FF, D, sd), "down": mat(D, D_FF, 0.5 * sf)}
              for _ in range(N_LAYERS)]
    return {"emb": mat(VOCAB, D, 1.0), "out_norm": norm(D), "layers": layers}, r


def main():
    qk_sigma, nudge, n_tok, n_models = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    worst = []
    for seed in range(n_models):
        w, r = random_model(seed, qk_sigma)
        toks = r.integers(0, VOCAB, n_tok)
        a = forward(w, toks, 0.0, None)
        b = forward(w, toks, nudge, np.random.default_rng(seed + 100))
        e = np.linalg.norm(a - b, axis=1) / np.linalg.norm(a, axis=1)
        worst.append(e.max())
    print(f"q/k sigma {qk_sigma} / sqrt(d), nudge {nudge:g}, {n_tok} tokens: worst row per model "
          + " ".join(f"{x:.1e}" for x in sorted(worst)))


if __name__ == "__main__":
    main()
