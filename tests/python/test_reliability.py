"""Reliability (issue 16): threads, interrupts, non-finite weights, closing, and the error classes of bad input.

CUDA variants skip where no GPU is found (benchmarks/device/sanitize.sh runs them on the GPU machine).
"""
import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import metalattn
from metalattn import _core, quants
from metalattn.errors import (ContextChangedError, GGUFError, InvalidArgumentError, MetalattnError, ModelClosedError,
                              NonFiniteError, NonFiniteWeightsError)
from metalattn.gguf_model import load_gguf
from metalattn.integrity import FP16_FIELDS, first_nonfinite, nonfinite_blocks

HAS_GPU = _core.cuda_compiled() and _core.cuda_device_count() > 0
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_GPU, reason="no CUDA device"))]

PROMPTS = ["the capital of france is", "once upon a time", "hello world", "the quick brown fox", "data model token",
           "music and film", "school city state", "water fire earth"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from metalattn.testing import write_synthetic_gguf

    # head_dim 32 (64 / 2 heads): the smallest the CUDA backend runs, so the CUDA variants use the same file.
    return write_synthetic_gguf(tmp_path_factory.mktemp("rel") / "small.gguf", n_heads=2, n_kv_heads=1, n_ctx=1024,
                                seed=3)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Slow enough that one forward_prompt of 1000 tokens takes a while on the CPU (for interrupts)."""
    from metalattn.testing import write_synthetic_gguf

    return write_synthetic_gguf(tmp_path_factory.mktemp("rel") / "wide.gguf", n_layers=4, d_model=256, d_ff=768,
                                n_heads=4, n_kv_heads=2, n_ctx=2048, seed=5)


def _load(path, device="cpu", **kw):
    if device == "cpu":
        kw.setdefault("n_threads", 1)
    return metalattn.load(path, device=device, **kw)


# ---------------------------------------------------------------------------------------------------- threads

def _expected(model, kwargs_list):
    return [model.generate(**kw) for kw in kwargs_list]


@pytest.fixture(autouse=True)
def _fast_thread_switches():
    """Python threads switch every 5 ms by default; 10 us makes unserialized calls interleave within a few tokens."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


# benchmarks/device/sanitize.sh runs these tests under compute-sanitizer with METALATTN_UNDER_SANITIZER=<tool>.
_SANITIZER = os.environ.get("METALATTN_UNDER_SANITIZER", "")
# racecheck runs the work another 10-100x slower than the other tools: the tests below then take smaller sizes (the
# same kernels), and it holds device memory of its own.
_RACECHECK = _SANITIZER == "racecheck"


def _run_threads(target, n):
    errors = []

    def wrap(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    # Under compute-sanitizer (see _SANITIZER) the same work runs 20-100x slower; a hang is still caught, later.
    for t in threads:
        t.join(900 if _SANITIZER else 60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


@pytest.mark.parametrize("device", DEVICES)
def test_threads_generating_on_one_model_match_single_threaded(small, device):
    model = _load(small, device)
    jobs = [dict(prompt=p, max_tokens=24) for p in PROMPTS]
    jobs += [dict(prompt=p, max_tokens=24, temperature=0.9, top_p=0.9, seed=i) for i, p in enumerate(PROMPTS[:4])]
    jobs += [dict(prompt=p, max_tokens=24, reuse_prefix=True) for p in PROMPTS[:4]]
    expected = _expected(model, jobs)
    assert len(set(expected)) > 4  # the prompts give different texts, so interleaving would show
    results = {}

    reps = 1 if _RACECHECK else 3

    def worker(i):
        for rep in range(reps):
            for j in range(i, len(jobs), 4):
                results[(i, rep, j)] = model.generate(**jobs[j])

    _run_threads(worker, 4)
    assert len(results) == reps * len(jobs)
    for (_, _, j), text in results.items():
        assert text == expected[j], (j, jobs[j])


@pytest.mark.parametrize("device", DEVICES)
def test_threads_on_low_level_calls_under_the_lock(small, device):
    model = _load(small, device)
    ids = model.tokenize(PROMPTS[0])
    with model.lock:
        model.reset()
        want = [model.forward_prompt(ids)]
        for _ in range(10):
            want.append(model.forward_token_greedy(want[-1]))
    got = {}

    def worker(i):
        for rep in range(5):
            with model.lock:  # a sequence of calls as one unit
                model.reset()
                seq = [model.forward_prompt(ids)]
                for _ in range(10):
                    seq.append(model.forward_token_greedy(seq[-1]))
                got[(i, rep)] = seq

    _run_threads(worker, 3)
    assert all(seq == want for seq in got.values())


def test_independent_models_run_in_parallel(small, wide):
    a, b = _load(small), _load(wide)
    want = {0: a.generate(PROMPTS[1], max_tokens=32), 1: b.generate(PROMPTS[2], max_tokens=32)}
    got = {}

    def worker(i):
        m, p = (a, PROMPTS[1]) if i == 0 else (b, PROMPTS[2])
        for rep in range(3):
            got[(i, rep)] = m.generate(p, max_tokens=32)

    _run_threads(worker, 2)
    assert all(text == want[i] for (i, _), text in got.items())
    # The engine releases the GIL: two models computing at once overlap in time.
    ids = np.array(b.tokenize(" ".join(PROMPTS) * 8)[:1000], dtype=np.int32)
    b.reset()
    t = time.perf_counter()
    b.forward_prompt(ids)
    alone = time.perf_counter() - t
    c = _load(wide)
    starts, ends = {}, {}

    def prefill(i):
        m = b if i == 0 else c
        m.reset()
        starts[i] = time.perf_counter()
        m.forward_prompt(ids)
        ends[i] = time.perf_counter()

    _run_threads(prefill, 2)
    # Overlap: the second started before the first ended (serialized runs would not overlap at all).
    assert max(starts.values()) < min(ends.values()), (starts, ends, alone)


def test_stream_detects_another_call_between_its_steps(small):
    model = _load(small)
    want = model.generate(PROMPTS[0], max_tokens=12)
    s = model.stream(PROMPTS[0], max_tokens=12)
    first = next(s)
    other = model.generate(PROMPTS[1], max_tokens=5)  # same thread, between two steps of the stream
    with pytest.raises(ContextChangedError, match="small.gguf.*model.lock"):
        next(s)
    assert other == model.generate(PROMPTS[1], max_tokens=5)
    # A stream nobody interrupts is unaffected; holding the lock across the loop keeps other threads out.
    assert first.text + "".join(c.text for c in model.stream(PROMPTS[0], max_tokens=12))[len(first.text):] == want
    texts = {}

    def worker(i):
        if i == 0:
            with model.lock:
                texts[i] = "".join(c.text for c in model.stream(PROMPTS[0], max_tokens=12) if not time.sleep(0.002))
        else:
            time.sleep(0.005)
            texts[i] = model.generate(PROMPTS[1], max_tokens=5)

    _run_threads(worker, 2)
    assert texts == {0: want, 1: other}


def test_stream_from_another_thread_raises_context_changed(small):
    model = _load(small)
    s = model.stream(PROMPTS[0], max_tokens=50)
    next(s)
    t = threading.Thread(target=lambda: model.generate(PROMPTS[1], max_tokens=3))
    t.start()
    t.join()
    with pytest.raises(ContextChangedError):
        for _ in s:
            pass


# ---------------------------------------------------------------------------------------------------- interrupts

def _interrupt_after(seconds):
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def _interrupt_somewhere(call, first_delay=0.01, deadline=20.0):
    """Calls `call` repeatedly with a SIGINT sent from a timer thread until one interrupts it."""
    end = time.time() + deadline
    delay = first_delay
    while time.time() < end:
        timer = _interrupt_after(delay)
        finished = False
        try:
            call()
            finished = True
            timer.join()
            time.sleep(0.2)  # a call faster than the timer: its signal lands here, and we try again
        except KeyboardInterrupt:
            timer.join()
            if not finished:
                return True
        delay = delay / 2
    return False


@pytest.mark.parametrize("device", DEVICES)
def test_keyboard_interrupt_leaves_the_model_usable(wide, device):
    assert threading.current_thread() is threading.main_thread()
    fresh = _load(wide, device)
    n_ids = 200 if _RACECHECK else 1000  # long enough to be hit, under racecheck too
    ids = np.array(fresh.tokenize(" ".join(PROMPTS) * 8)[:n_ids], dtype=np.int32)
    want_text = fresh.generate(PROMPTS[0], max_tokens=16)
    fresh.reset()  # check() below runs the prompt from position 0
    want_prompt = fresh.forward_prompt(ids)
    fresh.reset()
    want_logits = fresh.forward_prompt_logits(ids[:40])
    fresh.close()

    model = _load(wide, device)

    def check():
        assert model.generate(PROMPTS[0], max_tokens=16) == want_text
        model.reset()
        assert model.forward_prompt(ids) == want_prompt
        model.reset()
        logits = model.forward_prompt_logits(ids[:40])
        if device == "cpu":
            np.testing.assert_array_equal(logits, want_logits)
        else:  # the same kernels on the same input; allow for a different GEMM algorithm choice
            np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert model.generate(PROMPTS[0], max_tokens=16, reuse_prefix=True) == want_text

    # generate() long enough to be hit; stream(); a long forward_prompt (the engine releases the GIL, finishes the
    # prompt, and the interrupt is raised when it returns, so its position stays consistent).
    assert _interrupt_somewhere(lambda: model.generate(PROMPTS[2], max_tokens=1500))
    check()
    assert _interrupt_somewhere(lambda: [c for c in model.stream(PROMPTS[3], max_tokens=1500, reuse_prefix=True)])
    check()

    def prompt():
        model.reset()
        model.forward_prompt(ids)
        model.forward_prompt(ids[:n_ids // 2])

    assert _interrupt_somewhere(prompt)
    check()
    # A consumer that raises in the middle of a stream.
    with pytest.raises(KeyboardInterrupt):
        for chunk in model.stream(PROMPTS[1], max_tokens=100):
            if chunk.index == 5:
                raise KeyboardInterrupt
    check()


# ---------------------------------------------------------------------------------------------------- non-finite

def _plant(src, dst, tensor, byte_offset, raw):
    g = load_gguf(src)
    info = {t.name: t for t in g._reader.tensors}[tensor]
    offset = int(info.data_offset) + byte_offset
    g.close()
    del g
    shutil.copy(src, dst)
    with open(dst, "r+b") as f:
        f.seek(offset)
        f.write(raw)
    return dst


NAN16 = np.float16(np.nan).tobytes()
INF16 = np.float16(np.inf).tobytes()


def test_check_tensors_names_the_first_non_finite_tensor(small, tmp_path):
    # Row 3 of blk.1.ffn_up (Q4_0, 64 columns = 2 blocks of 18 bytes): its second block's scale.
    bad = _plant(small, tmp_path / "inf.gguf", "blk.1.ffn_up.weight", 3 * 36 + 18, INF16)
    with pytest.raises(NonFiniteWeightsError) as e:
        metalattn.load(bad, device="cpu", check_tensors=True)
    msg = str(e.value)
    assert str(bad) in msg and "'blk.1.ffn_up.weight'" in msg and "row 3, column 32" in msg and "inf" in msg
    assert isinstance(e.value, GGUFError) and isinstance(e.value, NonFiniteError)
    metalattn.load(small, device="cpu", check_tensors=True).close()  # a good file passes
    # metalattn info --check: exit status 1 and the same message; 0 on a good file.
    run = subprocess.run([sys.executable, "-m", "metalattn", "info", "--check", "--brief", "-m", str(bad)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "'blk.1.ffn_up.weight'" in run.stderr and str(bad) in run.stderr
    run = subprocess.run([sys.executable, "-m", "metalattn", "info", "--check", "--brief", "-m", str(small)],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "tensors finite" in run.stdout


@pytest.mark.parametrize("device", DEVICES)
def test_all_nan_logits_raise_non_finite_error_naming_the_file(small, tmp_path, device):
    bad = _plant(small, tmp_path / "nan.gguf", "token_embd.weight", 0, NAN16)  # token 0's first block
    model = _load(bad, device)
    calls = [lambda: model.generate([0, 5, 7], max_tokens=4),
             lambda: model.generate([0, 5, 7], max_tokens=4, temperature=0.8, seed=1),
             lambda: model.generate([0, 5, 7], max_tokens=4, reuse_prefix=True),
             lambda: list(model.stream([0, 5, 7], max_tokens=4, logprobs=2)),
             lambda: (model.reset(), model.forward_prompt([0, 5])),
             lambda: (model.reset(), model.forward_token_greedy(0))]
    for call in calls:
        with pytest.raises(NonFiniteError) as e:
            call()
        assert str(bad) in str(e.value) and "check_tensors=True" in str(e.value)
        assert not isinstance(e.value, NonFiniteWeightsError)
    # Tokens whose embedding is finite still run.
    model.reset()
    assert model.generate([5, 7], max_tokens=3) == _load(small, device).generate([5, 7], max_tokens=3)


@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS) + [quants.F16, quants.BF16, quants.F32])
def test_fast_scan_agrees_with_full_dequantization(qtype):
    rng = np.random.default_rng(qtype)
    cols = quants.block_elems(qtype) * 4
    rows = 64
    raw = rng.integers(0, 256, size=(rows, quants.row_bytes(qtype, cols)), dtype=np.uint8)
    if qtype in FP16_FIELDS:  # mostly finite scales, a few non-finite ones, at every field of the block
        size = quants._BLOCK_BYTES[qtype]
        blocks = raw.reshape(-1, size)
        for off in FP16_FIELDS[qtype]:
            blocks[:, off + 1] &= 0x3F  # exponent below all-ones: finite
            pick = rng.random(blocks.shape[0]) < 0.05
            blocks[pick, off + 1] |= 0x7C
    values = quants.dequantize(raw, qtype, rows, cols)
    per = quants.block_elems(qtype)
    want = ~np.isfinite(values.reshape(-1, per)).all(axis=1)
    got = nonfinite_blocks(raw, qtype)
    np.testing.assert_array_equal(got, want)
    assert want.any() and not want.all()
    found = first_nonfinite(raw, qtype, rows, cols)
    r, c = np.argwhere(~np.isfinite(values))[0]
    assert found[:2] == (int(r), int(c))


def test_check_tensors_speed_on_the_real_model(real_model):
    g = load_gguf(real_model)
    from metalattn.integrity import check_tensors

    t = time.perf_counter()
    assert check_tensors(g) == len(g.tensor_table())
    assert time.perf_counter() - t < 5.0


# ---------------------------------------------------------------------------------------------------- closing

def _proc_counts(path):
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    return dict(rss=rss_pages * os.sysconf("SC_PAGE_SIZE"), fds=len(os.listdir("/proc/self/fd")), maps=len(maps),
                file_maps=sum(1 for m in maps if str(path) in m))


def _closed_calls(model):
    return {
        "generate": lambda: model.generate("a", max_tokens=2),
        "stream": lambda: next(model.stream("a", max_tokens=2)),
        "forward_token_greedy": lambda: model.forward_token_greedy(1),
        "forward_token": lambda: model.forward_token(1),
        "forward_token_debug": lambda: model.forward_token_debug(1),
        "forward_prompt": lambda: model.forward_prompt([1, 2]),
        "forward_prompt_logits": lambda: model.forward_prompt_logits([1, 2]),
        "reset": model.reset,
        "truncate": lambda: model.truncate(0),
        "pos": lambda: model.pos,
        "memory_info": model.memory_info,
        "tokenize": lambda: model.tokenize("a"),
        "detokenize": lambda: model.detokenize([1]),
        "apply_chat_template": lambda: model.apply_chat_template([{"role": "user", "content": "hi"}]),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_closed_model_raises_model_closed_error(small, device):
    with _load(small, device) as model:
        assert model.generate("a b", max_tokens=3)
        s = model.stream("a b", max_tokens=10)
        next(s)
    assert model.closed and "closed" in repr(model)
    for name, call in _closed_calls(model).items():
        with pytest.raises(ModelClosedError, match="small.gguf.*closed") as e:
            call()
        assert isinstance(e.value, MetalattnError), name
    with pytest.raises(ModelClosedError):
        next(s)
    model.close()  # idempotent


def _cycles(path, device, n):
    for i in range(n):
        with _load(path, device, n_ctx=128) as model:
            model.generate(PROMPTS[i % len(PROMPTS)], max_tokens=8)
            model.forward_prompt_logits([1, 2, 3])


@pytest.mark.parametrize("device", DEVICES)
def test_load_generate_close_cycles_leave_resources_flat(small, device):
    _cycles(small, device, 10)  # warm-up: allocator pools, imports, lazily built tables
    gc.collect()
    before = _proc_counts(small)
    dev_before = _core.cuda_device_memory_used() if device == "cuda" else 0
    _cycles(small, device, 20 if _RACECHECK else 100)
    gc.collect()
    after = _proc_counts(small)
    assert after["file_maps"] == 0 and before["file_maps"] == 0
    assert after["fds"] == before["fds"], (before, after)
    assert abs(after["maps"] - before["maps"]) <= 4, (before, after)
    # Under compute-sanitizer the tool's own host records of every device allocation grow the process's RSS (~0.75 MB
    # a cycle on the H100), so there the host bound cannot tell the engine's memory from the tool's; racecheck also
    # takes device memory of its own (+100 MB over 100 cycles, 2026-11-24), so under it the device bound goes too.
    # Descriptors and mappings count under every tool, device memory under memcheck and synccheck.
    if not _SANITIZER:
        assert after["rss"] - before["rss"] < 16 << 20, (before, after)
    if device == "cuda" and not _RACECHECK:
        assert _core.cuda_device_memory_used() - dev_before <= 4 << 20


def test_close_releases_the_mapping_and_engine_at_once(small):
    model = _load(small)
    counts = _proc_counts(small)
    assert counts["file_maps"] >= 1
    model.close()
    assert _proc_counts(small)["file_maps"] == 0  # no gc.collect(): close() itself dropped every view


# ---------------------------------------------------------------------------------------------------- error classes

def test_argument_errors_are_metalattn_errors_and_value_errors(small):
    model = _load(small)
    for call in (lambda: _load(small, n_ctx=0), lambda: _load(small, n_threads=-1),
                 lambda: model.generate("a", max_tokens=-1), lambda: model.generate("a", stop=[""]),
                 lambda: model.generate("a", temperature=1.0, top_p=0.0),
                 lambda: model.generate("a", temperature=1.0, top_k=-1)):
        with pytest.raises(InvalidArgumentError) as e:
            call()
        assert isinstance(e.value, ValueError)


def test_tokenizer_errors_name_the_file(tmp_path):
    import gguf

    from metalattn.testing import write_synthetic_gguf

    src = write_synthetic_gguf(tmp_path / "src.gguf")
    g = load_gguf(src)
    # Rewrite with a tokenizer key of the wrong type (tokens as an array of ints).
    w = gguf.GGUFWriter(str(tmp_path / "bad_tok.gguf"), "llama")
    for key, value in g.metadata.items():
        if key in ("general.architecture",):
            continue
        if key == "tokenizer.ggml.tokens":
            w.add_key_value(key, list(range(len(value))), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        elif isinstance(value, list):
            sub = gguf.GGUFValueType.STRING if isinstance(value[0], str) else gguf.GGUFValueType.INT32
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    for name, t in g.tensors.items():
        if name == "output.weight" and g.tied_output:
            continue
        if t.data.ndim == 1:
            w.add_tensor(name, np.array(t.data, dtype=np.float32))
        else:
            w.add_tensor(name, np.array(t.data), raw_dtype=gguf.GGMLQuantizationType(t.ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="bad_tok.gguf.*tokenizer.ggml.tokens"):
        metalattn.load(tmp_path / "bad_tok.gguf", device="cpu")


def test_paths_that_are_not_gguf_files(tmp_path):
    (tmp_path / "dir.gguf").mkdir()
    os.mkfifo(tmp_path / "fifo.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    cases = {tmp_path / "dir.gguf": "a directory", tmp_path / "fifo.gguf": "not a regular file",
             tmp_path / "missing.gguf": "cannot open", tmp_path / "empty.gguf": "too short"}
    for path, words in cases.items():
        with pytest.raises(GGUFError) as e:
            metalattn.load(path, device="cpu")
        assert type(e.value) is GGUFError and str(path) in str(e.value) and words in str(e.value), e.value


@pytest.mark.parametrize("template", [
    "{{ 'a' * 10**9 }}", "{{ 9 ** 999999 }}", "{{ 'a'|center(10**9) }}", "{{ 'a'.ljust(2**30) }}", "{{ '%1000000000d' % 1 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% for i in range(10**9) %}{% endfor %}"])
def test_hostile_chat_template_is_stopped_quickly(small, tmp_path, template):
    """A chat template is code from the file: bounded in what it builds (no minutes of work, no GB strings)."""
    from metalattn.chat import ChatTemplateError

    model = _load(small)
    model.gguf.metadata["tokenizer.chat_template"] = template
    t = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="small.gguf"):
        model.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t < 5.0


def test_tokenize_from_many_threads(small):
    """The tokenizer's LRU cache of pre-tokens is shared: threads hitting and evicting entries at once must not
    break it (the server tokenizes requests while a worker generates)."""
    model = _load(small)
    model.tokenizer._cache_size = 16  # constant eviction
    words = [f"w{i} the capital {i * 7} of france is paris {i % 13}" for i in range(200)]
    want = [model.tokenize(w) for w in words]
    got = {}

    def worker(i):
        for rep in range(20):
            for j in range(i, len(words), 3):
                got[(rep, j)] = model.tokenize(words[j])

    _run_threads(worker, 4)
    assert all(ids == want[j] for (_, j), ids in got.items())
