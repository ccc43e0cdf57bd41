"""Token sampling from a logits row: temperature, top-k, top-p (nucleus). Greedy decoding never comes here:
its argmax runs on the device."""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgumentError, NonFiniteError

# Top-p first looks among this many most likely tokens (an O(V) partition instead of an O(V log V) sort of the
# whole vocabulary) and sorts everything only when they do not already hold the requested mass.
_NUCLEUS_PROBE = 1024


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> int:
    """Draws one token id. NaN logits are never drawn; top_k=0 and top_p=1 disable those filters."""
    if temperature <= 0:
        raise InvalidArgumentError("temperature must be > 0 for sampling (use greedy decoding for 0)")
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgumentError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidArgumentError(f"top_k must be >= 0, got {top_k}")
    x = np.asarray(logits, dtype=np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    if (x == np.inf).any():  # an infinite logit takes all the mass; ties go to the lowest index
        return int(np.argmax(x == np.inf))
    if not np.isfinite(x).any():
        raise NonFiniteError("every logit is NaN or -inf: nothing to sample")
    candidates = np.arange(x.size)
    if 0 < top_k < x.size:
        candidates = np.argpartition(-x, top_k - 1)[:top_k]
    scores = x[candidates] / temperature
    weights = np.exp(scores - scores.max())
    total = weights.sum()
    if top_p < 1.0:
        candidates, weights = _nucleus(candidates, weights, total, top_p)
        total = weights.sum()
    return int(candidates[rng.choice(candidates.size, p=weights / total)])


def _nucleus(candidates: np.ndarray, weights: np.ndarray, total: float, top_p: float):
    """The smallest set of most likely candidates whose probability reaches top_p (ties broken by index)."""
    probe = min(_NUCLEUS_PROBE, candidates.size)
    order = np.argpartition(-weights, probe - 1)[:probe] if probe < candidates.size else np.arange(candidates.size)
    order = order[np.lexsort((candidates[order], -weights[order]))]
    cum = np.cumsum(weights[order]) / total
    if cum[-1] < top_p and probe < candidates.size:  # the probe did not hold enough mass: sort everything
        order = np.lexsort((candidates, -weights))
        cum = np.cumsum(weights[order]) / total
    keep = int(min(np.searchsorted(cum, top_p) + 1, order.size))
    return candidates[order[:keep]], weights[order[:keep]]
