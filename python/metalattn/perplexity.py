"""Perplexity over a text file, counted like llama.cpp's perplexity tool: the tokens are cut into
non-overlapping chunks of n_ctx tokens, each chunk runs from an empty cache, and only the second half of each
chunk is scored (so every scored token has at least n_ctx/2 tokens of context)."""

from __future__ import annotations

import math
import sys

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity(model, text: str, ctx: int = 512, max_chunks: int = 0, progress: bool = True) -> dict:
    if ctx < 4:
        raise ValueError("ctx must be at least 4 tokens")
    if ctx > model.n_ctx:
        raise ValueError(f"ctx {ctx} exceeds the model's loaded context {model.n_ctx}")
    tokens = model.tokenize(text, add_bos=False)
    n_chunks = len(tokens) // ctx
    if max_chunks > 0:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise ValueError(f"the text has {len(tokens)} tokens: fewer than one chunk of {ctx}")
    bos = model.tokenizer.bos_id
    nll, count = 0.0, 0
    first = ctx // 2
    for c in range(n_chunks):
        chunk = list(tokens[c * ctx:(c + 1) * ctx])
        if bos is not None and model.tokenizer.add_bos:
            chunk[0] = bos
        model.reset()
        logits = model.forward_prompt_logits(chunk, all_tokens=True)
        lp = log_softmax(logits[first:ctx - 1])
        targets = np.asarray(chunk[first + 1:ctx])
        nll -= float(lp[np.arange(targets.size), targets].sum())
        count += targets.size
        if progress:
            print(f"\r  chunk {c + 1}/{n_chunks}: ppl {math.exp(nll / count):.4f}", end="", file=sys.stderr,
                  flush=True)
    if progress:
        print(file=sys.stderr)
    return {"perplexity": math.exp(nll / count), "chunks": n_chunks, "ctx": ctx, "scored_tokens": count,
            "tokens": len(tokens)}
