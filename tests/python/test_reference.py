"""testing.reference_forward: the float64 yardstick every backend is compared against must itself be right.
Synthetic models check its structure (causality, GQA mapping, RoPE, a one-token forward by hand); the real
SmolLM2-135M, when installed, checks that the whole thing is a working language model."""
import dataclasses
import math

import numpy as np
import pytest

pytest.importorskip("gguf")

from metalattn.gguf_model import load_gguf  # noqa: E402
from metalattn.testing import (_rope, bytes_to_unicode, find_smollm2_gguf, reference_forward,  # noqa: E402
                               write_synthetic_gguf)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("ref") / "tiny.gguf", n_layers=3, d_model=64, d_ff=128,
                                n_heads=4, n_kv_heads=2, vocab_size=400, quant="q4_0", embd_quant="q8_0", seed=7)
    return load_gguf(path)


# A bound on the largest logit change (logits up to ~17) the fp16 K/V rounding (relative 2^-11 a value at most) makes
# on the tiny model: measured 0.005-0.006.
FP16_DRIFT = 2e-2


def random_tokens(n, vocab, seed):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def test_shape_dtype_and_finite(tiny):
    logits = reference_forward(tiny, random_tokens(10, 400, 0))
    assert logits.shape == (10, 400) and logits.dtype == np.float64
    assert np.all(np.isfinite(logits)) and 1.0 < logits.std() < 20.0


def test_causal(tiny):
    a = random_tokens(16, 400, 1)
    b = a[:7] + random_tokens(9, 400, 2)
    la, lb = reference_forward(tiny, a), reference_forward(tiny, b)
    np.testing.assert_allclose(la[:7], lb[:7], rtol=1e-12, atol=1e-12)
    assert np.abs(la[7:] - lb[7:]).max(axis=1).min() > 1e-3  # every later position does see the change
    # A prefix run alone gives the same logits as inside the longer run.
    np.testing.assert_allclose(reference_forward(tiny, a[:5]), la[:5], rtol=1e-12, atol=1e-12)


def test_rope_relative_positions(tiny):
    # Shifting every position by the same amount leaves all q.k products, hence the logits, unchanged (exactly in the
    # float64 math; with the fp16 K cache, whose rotated values round differently, to its precision)...
    toks = random_tokens(9, 400, 3)
    base = reference_forward(tiny, toks, kv_fp16=False)
    shifted = reference_forward(tiny, toks, positions=np.arange(9) + 37, kv_fp16=False)
    np.testing.assert_allclose(shifted, base, rtol=1e-9, atol=1e-9)
    fp16 = reference_forward(tiny, toks, positions=np.arange(9) + 37)
    assert 0 < np.abs(fp16 - base).max() < FP16_DRIFT
    # ...while changing the spacing between positions does change them.
    spread = reference_forward(tiny, toks, positions=np.arange(9) * 2, kv_fp16=False)
    assert np.abs(spread[1:] - base[1:]).max() > 1e-3


def test_kv_cache_rounds_through_fp16(tiny):
    # K and V pass through fp16 (as the backends' caches store them): a small change of the logits, nothing more.
    toks = random_tokens(12, 400, 6)
    exact, fp16 = reference_forward(tiny, toks, kv_fp16=False), reference_forward(tiny, toks)
    assert 0 < np.abs(fp16 - exact).max() < FP16_DRIFT
    assert np.array_equal(fp16.argmax(1), exact.argmax(1))


def test_rope_pairs_adjacent_dims():
    head_dim, base = 8, 10000.0
    x = np.zeros((3, 1, head_dim))
    x[:, 0, 0] = 1.0  # unit vector in dim 0: rotates into dim 1 at frequency 1
    x[:, 0, 2] = 2.0  # in dim 2: rotates into dim 3 at frequency base^(-2/8)
    pos = np.array([0, 1, 5])
    out = _rope(x, pos, base)
    np.testing.assert_allclose(out[:, 0, 0], np.cos(pos), atol=1e-15)
    np.testing.assert_allclose(out[:, 0, 1], np.sin(pos), atol=1e-15)
    f = base ** (-2 / head_dim)
    np.testing.assert_allclose(out[:, 0, 2], 2 * np.cos(pos * f), atol=1e-15)
    np.testing.assert_allclose(out[:, 0, 3], 2 * np.sin(pos * f), atol=1e-15)
    assert np.all(out[:, 0, 4:] == 0)


def test_one_token_by_hand(tiny):
    # One token at position 0: RoPE is the identity and attention returns V, so the whole forward is a few lines.
    cfg, w = tiny.config, tiny.dequantized
    tok = 123

    def norm(v, name):
        return v / math.sqrt(float(np.mean(v * v)) + cfg.rms_eps) * w(name).astype(np.float64)

    x = w("token_embd.weight")[tok].astype(np.float64)
    group = cfg.n_heads // cfg.n_kv_heads
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        h = norm(x, p + "attn_norm.weight")
        v = (w(p + "attn_v.weight").astype(np.float64) @ h).reshape(cfg.n_kv_heads, cfg.head_dim)
        v = v.astype(np.float32).astype(np.float16).astype(np.float64)  # as the fp16 V cache holds it
        attn = np.concatenate([v[head // group] for head in range(cfg.n_heads)])
        x = x + w(p + "attn_output.weight").astype(np.float64) @ attn
        h = norm(x, p + "ffn_norm.weight")
        g = w(p + "ffn_gate.weight").astype(np.float64) @ h
        u = w(p + "ffn_up.weight").astype(np.float64) @ h
        x = x + w(p + "ffn_down.weight").astype(np.float64) @ (g / (1 + np.exp(-g)) * u)
    expected = w("token_embd.weight").astype(np.float64) @ norm(x, "output_norm.weight")
    np.testing.assert_allclose(reference_forward(tiny, [tok])[0], expected, rtol=1e-10, atol=1e-10)


def _with_expanded_kv(model, kv_of_head):
    """The same model written as multi-head attention: K/V rows copied so query head h reads kv head kv_of_head[h]."""
    cfg = model.config
    # reference_forward reads its float64 weights from this cache (keys ("float64", tensor name)).
    cache = {("float64", t.name): t.dequantize().astype(np.float64) for t in model.tensors.values()}
    hd = cfg.head_dim
    for layer in range(cfg.n_layers):
        for part in ("attn_k", "attn_v"):
            key = ("float64", f"blk.{layer}.{part}.weight")
            rows = cache[key].reshape(cfg.n_kv_heads, hd, cfg.d_model)
            cache[key] = rows[list(kv_of_head)].reshape(cfg.n_heads * hd, cfg.d_model)
    return dataclasses.replace(model, config=dataclasses.replace(cfg, n_kv_heads=cfg.n_heads), _dequant_cache=cache)


def test_gqa_maps_query_heads_to_kv_heads_in_blocks(tiny):
    toks = random_tokens(8, 400, 4)
    gqa = reference_forward(tiny, toks)
    n_heads, group = tiny.config.n_heads, tiny.config.n_heads // tiny.config.n_kv_heads
    blocks = [h // group for h in range(n_heads)]         # llama.cpp / HF: heads 0,1 -> kv 0; heads 2,3 -> kv 1
    np.testing.assert_allclose(reference_forward(_with_expanded_kv(tiny, blocks), toks), gqa, rtol=1e-10, atol=1e-10)
    interleaved = [h % tiny.config.n_kv_heads for h in range(n_heads)]
    assert np.abs(reference_forward(_with_expanded_kv(tiny, interleaved), toks) - gqa).max() > 1e-3


def test_deep_synthetic_stays_in_range(tmp_path):
    # 30 layers like SmolLM2 (narrow, to stay fast): the writer's scales keep the residual stream O(1).
    model = load_gguf(write_synthetic_gguf(tmp_path / "deep.gguf", n_layers=30, d_model=64, d_ff=160, n_heads=4,
                                           n_kv_heads=1, vocab_size=300, seed=9))
    logits = reference_forward(model, random_tokens(12, 300, 5))
    assert np.all(np.isfinite(logits)) and 1.0 < logits.std() < 20.0
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert np.all(top2[:, 1] - top2[:, 0] > 1e-6)  # no exact ties for greedy decoding to trip over


def test_argument_errors(tiny):
    with pytest.raises(ValueError, match="non-empty"):
        reference_forward(tiny, [])
    with pytest.raises(ValueError, match=r"\[0, 400\)"):
        reference_forward(tiny, [5, 400])


# ------------------------------------------------------------------------------------------------ the real model

# Token ids of SmolLM2's tokenizer, obtained once with the `tokenizers` package from the GGUF's own vocab and merges
# (byte-level BPE); the test re-checks them against the vocabulary before use.
PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
PARAGRAPH = ("The sun rises in the east and sets in the west. Every morning, the birds begin to sing, and the people "
             "of the town wake up to start their day. Children walk to school, and their parents go to work.")
PARAGRAPH_IDS = [504, 2388, 13685, 281, 260, 6251, 284, 5208, 281, 260, 5846, 30, 5081, 5738, 28, 260, 4255, 1956,
                 288, 1900, 28, 284, 260, 701, 282, 260, 3102, 11368, 614, 288, 1120, 480, 1194, 30, 5194, 4549, 288,
                 1125, 28, 284, 480, 2652, 685, 288, 746, 30]


@pytest.fixture(scope="module")
def smollm2():
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2-135M GGUF not installed")
    return load_gguf(path)


def decode(model, ids):
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab = model.metadata["tokenizer.ggml.tokens"]
    return bytes(byte_of[ch] for i in ids for ch in vocab[i]).decode("utf-8", "replace")


def mean_nll(logits, ids):
    z = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


def test_real_model_greedy_continuation(smollm2):
    assert decode(smollm2, PROMPT_IDS) == PROMPT and decode(smollm2, PARAGRAPH_IDS) == PARAGRAPH
    ids = list(PROMPT_IDS)
    for _ in range(4):
        ids.append(int(np.argmax(reference_forward(smollm2, ids)[-1])))
    continuation = decode(smollm2, ids[len(PROMPT_IDS):])
    assert "Paris" in continuation, continuation


def test_real_model_perplexity(smollm2):
    ppl = math.exp(mean_nll(reference_forward(smollm2, PARAGRAPH_IDS), PARAGRAPH_IDS))
    shuffled = list(np.random.default_rng(0).permutation(PARAGRAPH_IDS))
    ppl_shuffled = math.exp(mean_nll(reference_forward(smollm2, shuffled), shuffled))
    # Measured: about 11.8 on the paragraph (a 135M model on plain English), hundreds when shuffled.
    assert ppl < 20, ppl
    assert ppl_shuffled > 10 * ppl, (ppl, ppl_shuffled)
