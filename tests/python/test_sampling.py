import numpy as np
import pytest

from metalattn.errors import InvalidArgumentError, NonFiniteError
from metalattn.sampling import sample


class GridRng:
    """Stands in for np.random.Generator: random() returns the given uniforms in turn (sample draws one a token)."""

    def __init__(self, us):
        self.us = iter(us)

    def random(self):
        return next(self.us)


def reference(x, temperature=1.0, top_k=0, top_p=1.0):
    """The distribution sample() must draw from, in float64, and its candidates in draw order: weights
    exp((x - max) / T); top_k keeps the k largest logits, top_p the fewest of those (by decreasing logit) whose
    weight reaches top_p of theirs; ties go to the lower index; NaN is never a candidate."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    idx = np.flatnonzero(~np.isnan(x))
    order = idx[np.lexsort((idx, -x[idx]))]
    if 0 < top_k < x.size:
        order = order[:top_k]
    w = np.exp((x[order] - x[order].max()) / temperature)
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(w) / w.sum(), top_p) + 1)
        order, w = order[:keep], w[:keep]
    p = np.zeros(x.size)
    p[order] = w / w.sum()
    return p, order


def draw_ends(x, temperature=1.0, top_k=0, top_p=1.0):
    """The tokens u = 0 and u -> 1 draw: the first and last candidate in draw order, which is decreasing logit where
    top_k chose or where top_p's nucleus lies within the 1,024 largest logits, token id otherwise (sampling.h)."""
    p, order = reference(x, temperature, top_k, top_p)
    by_logit = (0 < top_k < len(x)) or (top_p < 1.0 and len(order) <= 1024)
    return (order[0], order[-1]) if by_logit else (order.min(), order.max())


def grid_counts(x, n, **kw):
    """Tokens drawn by n evenly spaced uniforms: each token's share of [0, 1) is one interval, so its count is within
    one or two of n times its probability."""
    rng = GridRng((np.arange(n) + 0.5) / n)
    return np.bincount([sample(x, rng, **kw) for _ in range(n)], minlength=len(x))


def test_top_k_1_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.normal(size=1000).astype(np.float32)
        assert sample(x, rng, temperature=0.7, top_k=1) == int(np.argmax(x))


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 40, 1.0), (0.8, 0, 0.9), (1.3, 64, 0.95), (0.5, 0, 0.5), (2.0, 3000, 0.99)])
def test_draws_follow_the_reference_distribution(temperature, top_k, top_p):
    x = (np.random.default_rng(1).normal(size=4096) * 3).astype(np.float32)
    n = 4000
    counts = grid_counts(x, n, temperature=temperature, top_k=top_k, top_p=top_p)
    p, order = reference(x, temperature, top_k, top_p)
    assert np.all(np.abs(counts - p * n) <= 2), np.max(np.abs(counts - p * n))
    assert set(np.flatnonzero(counts)) <= set(order.tolist())
    first, last = draw_ends(x, temperature, top_k, top_p)
    assert sample(x, GridRng([0.0]), temperature, top_k, top_p) == first
    assert sample(x, GridRng([1 - 1e-12]), temperature, top_k, top_p) == last


def test_small_softmax():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    assert np.allclose(grid_counts(logits, 1000) / 1000, [0.5, 0.3, 0.2], atol=0.002)
    rng = np.random.default_rng(1)
    counts = np.bincount([sample(logits, rng) for _ in range(20000)], minlength=3) / 20000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.02)


def test_top_p_cuts_the_tail():
    logits = np.log(np.array([0.6, 0.3, 0.05, 0.05]))
    assert set(np.flatnonzero(grid_counts(logits, 2000, top_p=0.8))) == {0, 1}


@pytest.mark.parametrize("scale", [0.0, 0.01, 0.3, 5.0])
def test_nucleus_over_a_vocabulary(scale):
    """top_p alone over 49,152 logits: peaked (the nucleus lies within the 1,024 largest logits), flat (it does not: it
    is found by buckets, cut again where one holds many tokens) and all equal (ties by id). The nucleus's first and
    last tokens in draw order must be the reference's, every draw must lie in it, and a grid's counts follow it."""
    x = (np.random.default_rng(4).normal(size=49152) * scale).astype(np.float32)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        p, order = reference(x, 1.0, 0, top_p)
        first, last = draw_ends(x, 1.0, 0, top_p)
        assert sample(x, GridRng([0.0]), top_p=top_p) == first
        assert sample(x, GridRng([1 - 1e-12]), top_p=top_p) == last
        counts = grid_counts(x, 500, top_p=top_p)
        assert set(np.flatnonzero(counts)) <= set(order.tolist())
        assert np.all(np.abs(counts - p * 500) <= 2)


def test_ties_go_to_the_lower_index():
    x = np.array([1.0, 3.0, 3.0, 3.0], dtype=np.float32)
    assert set(np.flatnonzero(grid_counts(x, 1000, top_k=2))) == {1, 2}
    assert set(np.flatnonzero(grid_counts(x, 1000, top_p=0.5))) == {1, 2}  # 1/3 + 1/3 reaches one half


def test_nan_inf_and_errors():
    x = np.array([np.nan, 0.0, np.nan, 0.0])
    assert set(np.flatnonzero(grid_counts(x, 200))) == {1, 3}
    assert set(np.flatnonzero(grid_counts(x, 200, top_k=1))) == {1}
    assert sample(np.array([0.0, np.inf, np.inf]), GridRng([0.9])) == 1
    assert set(np.flatnonzero(grid_counts(np.array([-np.inf, 0.0, -np.inf]), 100))) == {1}
    rng = np.random.default_rng(3)
    for bad in (np.array([np.nan, np.nan]), np.array([-np.inf, np.nan]), np.array([], dtype=np.float32)):
        with pytest.raises(NonFiniteError):
            sample(bad, rng)
    for kw in (dict(temperature=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(InvalidArgumentError):
            sample(np.zeros(3), rng, **kw)


def test_float64_and_strided_logits_read_as_float32():
    x = np.random.default_rng(5).normal(size=2000) * 2
    us = (np.arange(300) + 0.5) / 300
    want = [sample(x.astype(np.float32), GridRng([u]), top_k=50) for u in us]
    assert [sample(x, GridRng([u]), top_k=50) for u in us] == want
    wide = np.zeros((2000, 2))
    wide[:, 0] = x
    assert [sample(wide[:, 0], GridRng([u]), top_k=50) for u in us] == want


def test_log_probs_match_the_float64_log_softmax():
    """_core.log_probs (stream(logprobs=k), the server's logprobs): the token's and the k best log-probabilities of
    the raw logits' softmax, against float64 numpy; NaN logits are left out of the sum and of the best."""
    from metalattn import _core

    rng = np.random.default_rng(6)
    for n, k in ((5, 3), (4096, 20), (262144, 5)):
        x = (rng.normal(size=n) * 4).astype(np.float32)
        x[rng.integers(0, n, size=n // 50)] = np.nan
        x[2] = x[np.nanargmax(x)]  # a tie for the best: the lower id comes first
        ok = ~np.isnan(x)
        xd = x.astype(np.float64)
        m = xd[ok].max()
        lps = xd - (m + np.log(np.exp(xd[ok] - m).sum()))
        for token in (int(np.nanargmax(x)), 1, n - 1):
            lp, top = _core.log_probs(x, token, k)
            if np.isnan(x[token]):
                assert np.isnan(lp)
            else:
                assert lp == pytest.approx(lps[token], abs=1e-6)
            idx = np.flatnonzero(ok)
            want = idx[np.lexsort((idx, -xd[idx]))][:k]
            assert [i for i, _ in top] == want.tolist()
            assert [v for _, v in top] == pytest.approx(lps[want].tolist(), abs=1e-6)
    with pytest.raises(NonFiniteError):
        _core.log_probs(np.full(4, np.nan, dtype=np.float32), 0, 2)


def host_could_draw(logits, temperature, top_k, top_p, u, token) -> bool:
    """Whether a device's draw `token` (the GPU sums its weights with expf and in other orders than the host) is one
    the host's sample_logits draws at (u, top_p) within 1e-6: between its draws at both ends, in the draw's order
    (token ids without a filter, else larger logit first, the lower id among equal ones); both move the draw one
    way. A draw equal to the host's at (u, top_p) passes too."""
    from metalattn import _core

    x = np.ascontiguousarray(logits, dtype=np.float32)
    lo = _core.sample_logits(x, temperature, top_k, top_p - 1e-6 if top_p < 1 else top_p, max(0.0, u - 1e-6))
    hi = _core.sample_logits(x, temperature, top_k, min(1.0, top_p + 1e-6), min(0.9999999, u + 1e-6))
    if (top_k == 0 or top_k >= x.size) and top_p == 1.0:
        return lo <= token <= hi
    rank = np.empty(x.size, np.int64)
    rank[np.lexsort((np.arange(x.size), -x))] = np.arange(x.size)
    return rank[lo] <= rank[token] <= rank[hi]


def replay_sampled(model, ids, seed, max_tokens, temperature, top_k=0, top_p=1.0):
    """What stream(..., seed) samples, step by step the long way: the prompt's and every step's logits on the host
    (forward_prompt_logits, forward_token) and sample() with the same generator's uniforms."""
    rng = np.random.default_rng(seed)
    model.reset()
    out = [sample(model._engine.forward_prompt_logits(np.asarray(ids, np.int32), False), rng, temperature, top_k,
                  top_p)]
    while len(out) < max_tokens:
        out.append(sample(model._engine.forward_token(out[-1]), rng, temperature, top_k, top_p))
    return out


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 20},
                                {"temperature": 1.3, "top_p": 0.8}, {"temperature": 0.9, "top_k": 5, "top_p": 0.5}])
def test_sampled_decoding_draws_what_sample_draws(synthetic_factory, kw):
    """Sampled decoding draws each step where the logits are (forward_token_sample: on the CPU from the row it
    computed, on a GPU on the device); on the CPU that is sample_logits over the same row with the same uniform, so
    stream() equals the long way exactly."""
    import metalattn

    model = metalattn.load(synthetic_factory(quant="q4_0", seed=21), device="cpu")
    ids = model.tokenize("sampled decoding")
    got = [c.token for c in model.stream(ids, max_tokens=24, seed=9, **kw)]
    assert got == replay_sampled(model, ids, 9, len(got), **kw)
    assert len(got) == 24  # the synthetic vocabulary has no end-of-text token among its draws here


class ShortRuns:
    """An engine whose sampled runs stop after two steps (as a CUDA run stops at a draw left to the host)."""

    def __init__(self, engine):
        self._e = engine
        self.cut = 0

    def forward_tokens_sample(self, token, n, temperature, top_k, top_p, u):
        if n > 2:
            self.cut += 1
        return self._e.forward_tokens_sample(token, min(n, 2), temperature, top_k, top_p, u[:min(n, 2)])

    def __getattr__(self, name):
        return getattr(self._e, name)


def test_sampled_runs_cut_short_keep_the_uniforms_in_order(synthetic_factory):
    """stream() decodes sampled tokens in runs (forward_tokens_sample); a run that returns fewer steps than asked
    leaves its unused uniforms to the next steps, so the tokens are still the one-by-one draws."""
    import metalattn

    model = metalattn.load(synthetic_factory(quant="q4_0", seed=21), device="cpu")
    ids = model.tokenize("sampled runs")
    kw = {"temperature": 0.9, "top_k": 50}
    want = replay_sampled(model, ids, 11, 40, **kw)
    model._engine = ShortRuns(model._engine)
    assert [c.token for c in model.stream(ids, max_tokens=40, seed=11, **kw)] == want
    assert model._engine.cut > 3
    assert model.pos == len(ids) + 39  # the cache holds the prompt and every fed token


def test_forward_token_sample_checks_its_arguments(synthetic_factory):
    import metalattn

    model = metalattn.load(synthetic_factory(quant="q4_0", seed=21), device="cpu")
    for bad in [(0.0, 0, 1.0, 0.5), (1.0, -1, 1.0, 0.5), (1.0, 0, 0.0, 0.5), (1.0, 0, 1.5, 0.5), (1.0, 0, 1.0, 1.0)]:
        model.reset()
        with pytest.raises(ValueError, match="sampling: "):
            model._engine.forward_token_sample(1, *bad)
        assert model._engine.pos == 0, "a refused draw runs no step"
        t, k, p, u = bad
        with pytest.raises(InvalidArgumentError):
            model.forward_token_sample(1, u, temperature=t, top_k=k, top_p=p)
        assert model.pos == 0
    # The public call draws what sample() draws from forward_token's logits with the same uniform.
    model.reset()
    logits = model.forward_token(5)
    model.reset()
    assert model.forward_token_sample(5, 0.4, temperature=0.8, top_k=30) == sample(
        logits, GridRng([0.4]), 0.8, 30, 1.0)
