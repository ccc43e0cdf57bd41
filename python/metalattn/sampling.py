"""Token sampling from a logits row: temperature, top-k, top-p (nucleus). Greedy decoding never comes here:
its argmax runs on the device."""

from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> int:
    """Draws one token id. NaN logits are never drawn; top_k=0 and top_p=1 disable those filters."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling (use greedy decoding for 0)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    x = np.asarray(logits, dtype=np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    if not np.isfinite(x).any() and not (x == np.inf).any():
        raise ValueError("every logit is NaN or -inf: nothing to sample")
    if (x == np.inf).any():  # an infinite logit takes all the mass; ties go to the lowest index
        return int(np.argmax(x == np.inf))
    candidates = np.arange(x.size)
    if 0 < top_k < x.size:
        candidates = np.argpartition(-x, top_k - 1)[:top_k]
    scores = x[candidates] / temperature
    order = np.argsort(-scores, kind="stable")
    candidates, scores = candidates[order], scores[order]
    probs = np.exp(scores - scores[0])
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
    return int(candidates[rng.choice(candidates.size, p=probs)])
