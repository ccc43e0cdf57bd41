"""Batched decoding of several sequences (Engine.forward_batch, metalattn.batch.BatchGenerator, generate_batch):
every row of a batch must equal the same sequence decoded alone, on every architecture and CPU dispatch path; slots
keep their own positions and caches; bad batches raise metalattn errors."""

import numpy as np
import pytest

import metalattn
from metalattn import _core
from metalattn.batch import BatchGenerator
from metalattn.errors import (ContextChangedError, ContextOverflowError, InvalidArgumentError, MetalattnError,
                              TokenError)

from test_architectures import CASES, isas, rel_l2
from test_sampling import host_could_draw

ROW_REL_L2 = 1e-5  # a batch row against the same token decoded alone: same kernels, only summation order differs


def load_cpu(path, isa, monkeypatch, **kw):
    monkeypatch.setenv("METALATTN_CPU_ISA", isa)
    return metalattn.load(path, device="cpu", **kw)


def solo_logits(path, isa, monkeypatch, prompt, fed):
    """Logits after each fed token of one sequence decoded alone (single-sequence API, slot 0)."""
    m = load_cpu(path, isa, monkeypatch, n_ctx=128)
    m.forward_prompt(prompt)
    return [m.forward_token(t) for t in fed]


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("case", ["llama", "qwen2", "gemma3"])
def test_batch_rows_equal_sequences_decoded_alone(synthetic_factory, monkeypatch, isa, case):
    # Sequences of different prompt lengths (so the rows of one step sit at different positions; the Gemma case's
    # window of 8 is passed by the longer ones), each fed its own tokens; slot order differs from row order.
    kw = dict(quant="q4_0", embd_quant="q8_0", seed=11) if case == "llama" else dict(CASES[case], seed=12)
    path = synthetic_factory(**kw)
    rng = np.random.default_rng(3)
    m = load_cpu(path, isa, monkeypatch, n_ctx=128, n_seq=5)
    e = m._engine
    lengths = [1, 7, 16, 3]
    slots = [4, 0, 2, 1]
    prompts = [rng.integers(0, m.vocab_size, size=n).astype(np.int32) for n in lengths]
    feeds = [rng.integers(0, m.vocab_size, size=6).astype(np.int32) for _ in lengths]
    for s, p in zip(slots, prompts):
        e.forward_prompt_slot(s, p, False)
    got = [[] for _ in lengths]
    for step in range(6):
        rows = [i for i in range(len(lengths)) if i != 3 or step >= 2]  # sequence 3 joins at step 2
        tokens = np.array([feeds[i][step if i != 3 else step - 2] for i in rows], np.int32)
        ids, logits = e.forward_batch(tokens, np.array([slots[i] for i in rows], np.int32), True)
        for r, i in enumerate(rows):
            assert ids[r] == int(np.argmax(logits[r]))
            got[i].append(logits[r])
    for i, s in enumerate(slots):
        assert e.slot_pos(s) == lengths[i] + len(got[i])
        alone = solo_logits(path, isa, monkeypatch, prompts[i], feeds[i][: len(got[i])])
        for a, b in zip(got[i], alone):
            assert rel_l2(a, b) <= ROW_REL_L2
            assert int(np.argmax(a)) == int(np.argmax(b))
    assert e.slot_pos(3) == 0  # an unused slot stays empty


def test_prompt_on_a_slot_equals_slot_zero(synthetic_factory, monkeypatch):
    path = synthetic_factory(quant="q4_1", embd_quant="q8_0", seed=13)
    m = load_cpu(path, "scalar", monkeypatch, n_ctx=64, n_seq=3)
    toks = np.arange(5, 25, dtype=np.int32)
    _, a = m._engine.forward_prompt_slot(2, toks, True)
    b = m.forward_prompt_logits(toks)
    assert np.array_equal(a, b)
    assert m._engine.slot_pos(2) == 20 and m.pos == 20 and m._engine.slot_pos(1) == 0
    m._engine.truncate_slot(2, 4)
    assert m._engine.slot_pos(2) == 4 and m.pos == 20


def test_bad_batches_raise_metalattn_errors(synthetic_factory, monkeypatch):
    path = synthetic_factory(quant="q8_0", seed=14)
    m = load_cpu(path, "scalar", monkeypatch, n_ctx=8, n_seq=2)
    e = m._engine
    one = np.array([1], np.int32)
    with pytest.raises(TokenError, match="slot 2 out of range"):
        e.forward_batch(one, np.array([2], np.int32))
    with pytest.raises(TokenError, match="appears twice"):
        e.forward_batch(np.array([1, 2], np.int32), np.array([1, 1], np.int32))
    with pytest.raises(TokenError, match="out of range"):
        e.forward_batch(np.array([m.vocab_size], np.int32), np.array([0], np.int32))
    with pytest.raises(TokenError, match="empty batch"):
        e.forward_batch(np.array([], np.int32), np.array([], np.int32))
    with pytest.raises(TokenError, match="3 rows for 2"):
        e.forward_batch(np.array([1, 2, 3], np.int32), np.array([0, 1, 0], np.int32))
    e.forward_prompt_slot(1, np.arange(1, 9, dtype=np.int32), False)
    with pytest.raises(ContextOverflowError, match="slot 1 is full"):
        e.forward_batch(np.array([3, 4], np.int32), np.array([0, 1], np.int32))
    assert e.slot_pos(0) == 0 and e.slot_pos(1) == 8  # a refused batch moves no slot
    with pytest.raises(InvalidArgumentError):
        metalattn.load(path, device="cpu", n_seq=0)


@pytest.fixture(scope="module")
def real_batch_model(real_model):
    return metalattn.load(real_model, device="cpu", n_ctx=512, n_seq=4)


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "Water boils at", "import numpy as np\n"]


def test_generate_batch_equals_generate_on_the_real_model(real_batch_model):
    # 6 prompts over 4 slots: two wait for a slot and join while the others decode (continuous batching).
    m = real_batch_model
    alone = [m.generate(p, max_tokens=24) for p in PROMPTS]
    assert m.generate_batch(PROMPTS, max_tokens=24) == alone
    assert len(set(alone)) == len(alone) and all(len(t) > 20 for t in alone)
    assert m.generate_batch(PROMPTS[:2], max_tokens=0) == ["", ""]  # sequences that end without a token
    with pytest.raises(TokenError):  # a prompt the engine refuses raises its own error
        m.generate_batch(["Hello", [m.vocab_size]], max_tokens=4)


def test_generator_streams_stop_strings_sampling_and_prefix_reuse(real_batch_model):
    m = real_batch_model
    gen = BatchGenerator(m)
    a = gen.submit("The capital of France is", max_tokens=40, stop=".")
    b = gen.submit("Once upon a time", max_tokens=16, temperature=0.8, top_p=0.9, seed=5)
    c = gen.submit("Hello", max_tokens=0)
    chunks = {id(a): [], id(b): [], id(c): []}
    while gen.busy:
        for seq, chunk in gen.step():
            chunks[id(seq)].append(chunk)
    text_a = "".join(ch.text for ch in chunks[id(a)])
    # The next turn of a conversation goes to the slot holding its history and prefills only the new part (before
    # any single-sequence call below: those use slot 0, which may be a's).
    follow = "The capital of France is" + text_a + ". And of Spain?"
    d = gen.submit(follow, max_tokens=4)
    while gen.busy:
        gen.step()
    assert d.slot == a.slot and d.stats.cached_tokens >= len(m.tokenize("The capital of France is"))
    assert d.stats.prompt_tokens == len(m.tokenize(follow))
    assert text_a == m.generate("The capital of France is", max_tokens=40, stop=".")
    assert a.stats.finish_reason == "stop" and "." not in text_a
    assert b.stats.finish_reason == "length" and len(chunks[id(b)]) == 16
    assert [ch.index for ch in chunks[id(b)]] == list(range(16))
    assert chunks[id(c)] == [None] and c.stats.finish_reason == "length"
    sampled = "".join(ch.text for ch in chunks[id(b)])
    again = BatchGenerator(m)
    b2 = again.submit("Once upon a time", max_tokens=16, temperature=0.8, top_p=0.9, seed=5)
    out = []
    while again.busy:
        out += [ch.text for s, ch in again.step() if ch is not None]
    assert "".join(out) == sampled and b2.stats.generated_tokens == 16  # same seed, same draws
    # (b2 ran alone in slot 0: the single-sequence step, drawn by forward_token_sample, as Model.stream draws)
    assert m.generate("Once upon a time", max_tokens=16, temperature=0.8, top_p=0.9, seed=5) == sampled


def test_slot_choice_keeps_conversations_apart(synthetic_factory, monkeypatch):
    # Prompts sharing only an opening take empty slots (slot 0 first); a continuation goes back to its own slot;
    # with every slot holding a history, a new prompt takes the least recently used one.
    path = synthetic_factory(quant="q8_0", seed=16)
    m = load_cpu(path, "scalar", monkeypatch, n_ctx=64, n_seq=3)
    gen = BatchGenerator(m)
    opening = [5, 6, 7, 8]

    def run(ids):
        seq = gen.submit(ids, max_tokens=2)
        while gen.busy:
            gen.step()
        return seq

    a = run(opening + [10, 11])
    b = run(opening + [20, 21])
    c = run(opening + [30, 31])
    assert [a.slot, b.slot, c.slot] == [0, 1, 2]
    b2 = run(b.ids + [b.token, 22])  # b's next turn: its own slot, only the new tokens prefilled
    assert b2.slot == 1 and b2.stats.cached_tokens >= len(b.ids)
    d = run(opening + [40])  # no continuation, no empty slot: the least recently used (a's)
    assert d.slot == 0 and d.stats.cached_tokens == len(opening)


def test_generator_cancel_and_errors(real_batch_model):
    m = real_batch_model
    gen = BatchGenerator(m)
    a = gen.submit("Once upon a time", max_tokens=100)
    b = gen.submit("Water boils at", max_tokens=5)
    gen.step()
    gen.cancel(a)
    ended = []
    while gen.busy:
        ended += [s for s, ch in gen.step() if ch is None or ch.finish_reason]
    assert a.done and a.stats.finish_reason == "cancelled" and a.index < 100
    assert b.done and b.stats.finish_reason == "length"
    with pytest.raises(ContextOverflowError):
        gen.submit(list(range(1, 600)))
    with pytest.raises(TokenError):
        gen.submit([m.vocab_size])
    with pytest.raises(InvalidArgumentError):
        gen.submit("x", stop=[""])


def test_single_sequence_calls_between_steps_end_the_slot_zero_sequence(real_model):
    m = metalattn.load(real_model, device="cpu", n_ctx=256, n_seq=1)
    gen = BatchGenerator(m)
    a = gen.submit("Once upon a time", max_tokens=50)
    gen.step()
    gen.step()
    assert a.slot == 0
    m.generate("Hello", max_tokens=3)  # moves slot 0 under the generator
    events = gen.step()
    assert events == [(a, None)] and isinstance(a.error, ContextChangedError)
    # A new sequence starts afresh in slot 0 and equals generate().
    b = gen.submit("Water boils at", max_tokens=12)
    out = []
    while gen.busy:
        out += [ch.text for s, ch in gen.step() if ch is not None]
    assert b.slot == 0 and "".join(out) == m.generate("Water boils at", max_tokens=12)


@pytest.mark.skipif(not (_core.cuda_compiled() and _core.cuda_device_count() > 0), reason="no CUDA device")
def test_cuda_batch_rows_equal_cpu(synthetic_factory):
    path = synthetic_factory(quant="q4_0", embd_quant="q8_0", seed=15, head_dim=32)
    g = load_cuda_batching(path, n_ctx=64, n_seq=3)
    c = metalattn.load(path, device="cpu", n_ctx=64, n_seq=3)
    rng = np.random.default_rng(4)
    for s, n in enumerate([3, 9, 1]):
        p = rng.integers(0, g.vocab_size, size=n).astype(np.int32)
        g._engine.forward_prompt_slot(s, p, False)
        c._engine.forward_prompt_slot(s, p, False)
    for _ in range(5):
        toks = rng.integers(0, g.vocab_size, size=3).astype(np.int32)
        slots = np.array([2, 0, 1], np.int32)
        gi, gl = g._engine.forward_batch(toks, slots, True)
        ci, cl = c._engine.forward_batch(toks, slots, True)
        for r in range(3):
            assert rel_l2(gl[r], cl[r]) <= 1e-3
        assert gi == [int(np.argmax(x)) for x in gl]


def check_batch_draws(engine, rows, rounding):
    """Five batch steps over the engine's slots (prompted), rows = [(temperature, top_k, top_p)] one a slot in
    reverse slot order: forward_batch_sample's greedy rows are their logits' argmax and its sampled rows what
    sample_logits draws from the same logits and uniform (where `rounding`, a differing draw must lie between the host's
    draws at (u, top_p) -/+ 1e-6 in the draw's order, as tests/python/test_cuda.py checks a single step)."""
    n = len(rows)
    rng = np.random.default_rng(8)
    temps = np.array([r[0] for r in rows], np.float64)
    ks = np.array([r[1] for r in rows], np.int64)
    ps = np.array([r[2] for r in rows], np.float64)
    differ = 0
    for _ in range(5):
        toks = rng.integers(0, engine.vocab_size, size=n).astype(np.int32)
        slots = np.arange(n, dtype=np.int32)[::-1].copy()
        us = rng.random(n)
        ids, logits = engine.forward_batch_sample(toks, slots, temps, ks, ps, us, True)
        for i, (t, k, p) in enumerate(rows):
            if t <= 0:
                assert ids[i] == int(np.argmax(logits[i]))
                continue
            want = _core.sample_logits(logits[i], t, k, p, us[i])
            if ids[i] == want:
                continue
            assert rounding, f"row {i}: drew {ids[i]}, the host {want}"
            differ += 1
            assert host_could_draw(logits[i], t, k, p, us[i], ids[i]), f"row {i}: drew {ids[i]}, the host {want}"
    assert differ <= 2


BATCH_DRAWS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 40, 1.0), (1.0, 0, 0.9), (0.7, 2000, 0.95), (1.2, 30, 0.8)]


def prompt_slots(engine, n):
    """Slots 0 .. n-1 each holding a random prompt of 2 + slot tokens."""
    rng = np.random.default_rng(3)
    for s in range(n):
        engine.forward_prompt_slot(s, rng.integers(0, engine.vocab_size, size=2 + s).astype(np.int32), False)


def load_cuda_batching(path, **kw):
    """The model on CUDA, or a skip where the device cannot hold its sequence slots."""
    try:
        return metalattn.load(path, device="cuda", **kw)
    except MetalattnError as e:
        pytest.skip(f"CUDA batching: {e}")


def test_batch_rows_draw_what_sample_draws(synthetic_factory):
    m = metalattn.load(synthetic_factory(quant="q4_0", seed=15, head_dim=32), device="cpu", n_ctx=64, n_seq=6)
    prompt_slots(m._engine, 6)
    check_batch_draws(m._engine, BATCH_DRAWS, rounding=False)
    # Bad sampling settings of a drawn row are refused before the step runs; a greedy row's are not read.
    before = [m._engine.slot_pos(s) for s in range(6)]
    one = np.ones(1)
    for t, k, p, u in [(1.0, -1, 1.0, 0.5), (1.0, 0, 1.5, 0.5), (1.0, 0, 1.0, 1.0)]:
        with pytest.raises(ValueError, match="sampling: "):
            m._engine.forward_batch_sample(np.array([1], np.int32), np.array([0], np.int32), t * one,
                                           np.array([k], np.int64), p * one, u * one)
    assert [m._engine.slot_pos(s) for s in range(6)] == before
    m._engine.forward_batch_sample(np.array([1], np.int32), np.array([0], np.int32), 0 * one,
                                   np.array([-1], np.int64), 5 * one, 3 * one)
    with pytest.raises(ValueError, match="one entry a row"):
        m._engine.forward_batch_sample(np.array([1, 2], np.int32), np.array([0, 1], np.int32), one,
                                       np.array([0], np.int64), one, 0.5 * one)


@pytest.mark.skipif(not (_core.cuda_compiled() and _core.cuda_device_count() > 0), reason="no CUDA device")
def test_cuda_batch_rows_draw_on_the_device(synthetic_factory):
    g = load_cuda_batching(synthetic_factory(quant="q4_0", embd_quant="q8_0", seed=15, head_dim=32), n_ctx=64,
                           n_seq=6)
    prompt_slots(g._engine, 6)
    check_batch_draws(g._engine, BATCH_DRAWS, rounding=True)
    # Without logits back the same draws: the device's (the host's for the top_k past 1,024).
    for s in range(6):
        g._engine.truncate_slot(s, 0)
        g._engine.forward_prompt_slot(s, np.array([5, 6 + s], np.int32), False)
    args = [np.array(x) for x in zip(*BATCH_DRAWS)]
    toks, slots, us = np.array([7] * 6, np.int32), np.arange(6, dtype=np.int32), np.linspace(0.05, 0.95, 6)
    with_logits, _ = g._engine.forward_batch_sample(toks, slots, args[0].astype(np.float64), args[1].astype(np.int64),
                                                    args[2].astype(np.float64), us, True)
    for s in range(6):
        g._engine.truncate_slot(s, 2)
    without, none = g._engine.forward_batch_sample(toks, slots, args[0].astype(np.float64), args[1].astype(np.int64),
                                                   args[2].astype(np.float64), us, False)
    assert none is None and without == with_logits


def test_serve_default_slots_fit_the_cuda_cache_budget(synthetic_factory, monkeypatch):
    # `metalattn serve` without --parallel: 4 slots on the CPU; on CUDA up to 8, as many as 4 GiB of cache holds.
    import argparse

    from metalattn import cli, model as model_mod

    path = str(synthetic_factory(quant="q8_0", seed=17))  # 2 layers, kv_dim 32, fp16 K and V: 256 bytes a position
    args = argparse.Namespace(device="cpu", model=path, n_ctx=None)
    assert cli._default_parallel(args) == cli.DEFAULT_PARALLEL_CPU
    monkeypatch.setattr(model_mod, "_resolve_device", lambda d: "cuda")
    assert cli._default_parallel(argparse.Namespace(device="cuda", model=path, n_ctx=None)) == 8
    big = (3 << 30) // 256  # 3 GiB a slot: one fits
    assert cli._default_parallel(argparse.Namespace(device="cuda", model=path, n_ctx=big)) == 1
    half = (1 << 30) // 256  # 1 GiB a slot: four fit
    assert cli._default_parallel(argparse.Namespace(device="cuda", model=path, n_ctx=half)) == 4
    assert cli._default_parallel(argparse.Namespace(device="cuda", model=path + ".missing", n_ctx=None)) == 1


@pytest.mark.skipif(not (_core.cuda_compiled() and _core.cuda_device_count() > 0), reason="no CUDA device")
def test_cuda_generate_batch_equals_generate(synthetic_factory):
    # Greedy texts of 12 prompts decoded together (8 slots: rows join and leave, tensor-core chains of 8 rows) equal
    # each prompt decoded alone (the decode graph), on a SmolLM2-shaped model of 4 layers.
    path = synthetic_factory(quant="q4_0", embd_quant="q8_0", seed=18, n_layers=4, d_model=576, d_ff=1536,
                             n_heads=9, n_kv_heads=3, vocab_size=4096, n_ctx=512)
    m = metalattn.load(path, device="cuda", n_ctx=256, n_seq=8)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(10, 4000, size=int(n)).tolist() for n in rng.integers(3, 40, size=12)]
    budgets = [int(k) for k in rng.integers(8, 48, size=12)]
    alone = [m.generate(p, max_tokens=k) for p, k in zip(prompts, budgets)]
    gen = BatchGenerator(m)
    seqs = [gen.submit(p, max_tokens=k) for p, k in zip(prompts, budgets)]
    texts = {id(s): [] for s in seqs}
    while gen.busy:
        for s, ch in gen.step():
            if ch is not None:
                texts[id(s)].append(ch.text)
    assert ["".join(texts[id(s)]) for s in seqs] == alone
