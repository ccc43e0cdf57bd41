import numpy as np
import pytest

from metalattn.sampling import sample


def test_top_k_1_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.normal(size=1000).astype(np.float32)
        assert sample(x, rng, temperature=0.7, top_k=1) == int(np.argmax(x))


def test_distribution_follows_softmax():
    rng = np.random.default_rng(1)
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float64))
    counts = np.bincount([sample(logits, rng) for _ in range(20000)], minlength=3) / 20000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.02)


def test_top_p_cuts_the_tail():
    rng = np.random.default_rng(2)
    logits = np.log(np.array([0.6, 0.3, 0.05, 0.05]))
    drawn = {sample(logits, rng, top_p=0.8) for _ in range(2000)}
    assert drawn == {0, 1}


def test_nan_never_drawn_and_errors():
    rng = np.random.default_rng(3)
    x = np.array([np.nan, 0.0, np.nan, 0.0])
    assert {sample(x, rng) for _ in range(200)} <= {1, 3}
    with pytest.raises(ValueError):
        sample(np.array([np.nan, np.nan]), rng)
    with pytest.raises(ValueError):
        sample(np.zeros(3), rng, temperature=0)
    with pytest.raises(ValueError):
        sample(np.zeros(3), rng, top_p=0)
    assert sample(np.array([0.0, np.inf, np.inf]), rng) == 1


def test_nucleus_probe_matches_full_sort():
    """Top-p over a flat distribution (the 1024-token probe holds too little mass) and a peaked one (it holds
    enough) must keep exactly the tokens a full sort keeps."""
    from metalattn.sampling import _nucleus

    rng = np.random.default_rng(4)
    for scale in (0.01, 5.0):
        x = rng.normal(size=49152) * scale
        w = np.exp(x - x.max())
        cands = np.arange(x.size)
        for p in (0.1, 0.5, 0.9, 0.99):
            got, _ = _nucleus(cands, w, w.sum(), p)
            order = np.argsort(-w, kind="stable")
            keep = int(np.searchsorted(np.cumsum(w[order]) / w.sum(), p) + 1)
            assert set(got.tolist()) == set(order[:keep].tolist())
