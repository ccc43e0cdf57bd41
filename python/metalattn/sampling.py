"""Token sampling from a logits row: temperature, top-k, top-p (nucleus). Greedy decoding never comes here:
its argmax runs on the device. The draw itself is C++ (`_core.sample_logits`, cpp/engine/sampling.h): the numpy
form it replaced took 1.6-9.6 ms a token over 49k-262k-token vocabularies (42 ms for a flat row's top_p), longer
than a CUDA decode step. Sampled decoding steps draw where the logits are instead (Model.forward_token_sample: on
CUDA on the device, with these semantics, from the same uniform); sample() serves prompts' first tokens, batches and
logprobs."""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgumentError, NonFiniteError


def check_args(temperature: float, top_k: int, top_p: float) -> None:
    """Raises InvalidArgumentError unless temperature > 0, top_k >= 0 and 0 < top_p <= 1."""
    if not temperature > 0:
        raise InvalidArgumentError("temperature must be > 0 for sampling (use greedy decoding for 0)")
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgumentError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidArgumentError(f"top_k must be >= 0, got {top_k}")


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> int:
    """Draws one token id with one uniform from `rng`. NaN logits are never drawn; an infinite logit takes all the
    mass; top_k=0 and top_p=1 disable those filters (ties go to the lower token id). Logits are read as float32."""
    check_args(temperature, top_k, top_p)
    x = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    if x.size == 0:
        raise NonFiniteError("no logits: nothing to sample")
    from . import _core  # imported here: metalattn imports without a build and says how to make one

    return int(_core.sample_logits(x, float(temperature), int(top_k), float(top_p), float(rng.random())))
