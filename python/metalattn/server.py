"""`metalattn serve`: an OpenAI-compatible HTTP server (Starlette + uvicorn) in front of one Model.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. Streaming answers are
server-sent events exactly as OpenAI sends them, ending with `data: [DONE]`; errors are OpenAI's JSON
`{"error": {"message", "type", "param", "code"}}` with a 4xx status for every fault of the request.

Shape: the HTTP side validates and tokenizes, then hands a `Job` to the `Scheduler`, which owns the model. The
scheduler's one worker thread decodes every running job together (metalattn.batch.BatchGenerator: continuous
batching over the model's n_seq KV-cache slots, `metalattn serve --parallel N`; one batched forward step for all
active jobs, a job joining or leaving between two steps; a chat's next turn goes to the slot holding its history,
so only its new tokens are prefilled) and posts each token to the job's asyncio queue; the HTTP side turns those
events into JSON or SSE. Jobs beyond the slots wait in order. A client that goes away sets the job's cancel flag:
the worker drops it before its next step (freeing its slot), and a waiting job that was cancelled never starts.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import queue
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError as e:  # pragma: no cover - exercised by the CLI's message
    raise ImportError(
        f"metalattn serve needs the 'server' extra ({e.name} is missing): pip install 'metalattn[server]' "
        "(or: pip install starlette uvicorn)") from e

from .batch import BatchGenerator
from .errors import ContextOverflowError, InvalidArgumentError, MetalattnError, TokenError
from .model import GenerationStats

log = logging.getLogger("metalattn.server")

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
_REQUEST_ERRORS = (ContextOverflowError, InvalidArgumentError, TokenError)  # faults of the request: 400


class APIError(Exception):
    """A request the server refuses: becomes OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _AsciiJSON(JSONResponse):
    """Error bodies echo parts of the request: ASCII-escaped, so that no input (a lone surrogate) can break them."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: APIError, headers: Optional[dict] = None) -> JSONResponse:
    return _AsciiJSON(err.body(), status_code=err.status, headers=headers)


# ---------------------------------------------------------------------------------------------------- validation
_MISSING = object()


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _field(body: dict, key: str, kind: str, default: Any = None, required: bool = False, lo=None, hi=None,
           lo_open: bool = False) -> Any:
    """body[key] checked against `kind` (int, number, bool, str) and the bounds; null counts as absent."""
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        if required:
            raise APIError(400, f"'{key}' is a required property", param=key, code="missing_required_parameter")
        return default
    ok = {"int": isinstance(v, int) and not isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": isinstance(v, bool),
          "str": isinstance(v, str)}[kind]
    if not ok:
        want = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string"}[kind]
        raise APIError(400, f"'{key}' must be {want}, got {_type_name(v)} {json.dumps(v)[:40]}", param=key,
                       code="invalid_type")
    if kind in ("int", "number"):
        if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            rng = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
            raise APIError(400, f"'{key}' must be in {rng}, got {v}", param=key, code="invalid_value")
    return v


def _stops(body: dict) -> List[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise APIError(400, "'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' holds at most {MAX_STOP_STRINGS} strings", param="stop", code="invalid_value")
    if any(not s for s in v):
        raise APIError(400, "stop strings must be non-empty", param="stop", code="invalid_value")
    return v


def _sampling(body: dict) -> dict:
    """The sampling fields both endpoints share, as Model.stream arguments."""
    for key in ("presence_penalty", "frequency_penalty"):
        if _field(body, key, "number", 0, lo=-2, hi=2) != 0:
            raise APIError(400, f"'{key}' is not supported (only 0)", param=key, code="unsupported_parameter")
    if _field(body, "n", "int", 1, lo=1) != 1:
        raise APIError(400, "'n' must be 1: one choice per request", param="n", code="unsupported_parameter")
    seed = _field(body, "seed", "int")
    if seed is not None and seed < 0:
        seed = seed & 0xFFFFFFFFFFFFFFFF  # numpy seeds are non-negative; OpenAI's are int64
    return dict(temperature=float(_field(body, "temperature", "number", 1.0, lo=0, hi=2)),
                top_p=float(_field(body, "top_p", "number", 1.0, lo=0, hi=1, lo_open=True)),
                top_k=int(_field(body, "top_k", "int", 0, lo=0)),
                seed=seed, stop=_stops(body))


def _stream_flags(body: dict):
    stream = _field(body, "stream", "bool", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
        include_usage = _field(opts, "include_usage", "bool", False)
    return stream, include_usage


def _message_text(m: Any, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(400, f"{param} must be an object, got {_type_name(m)}", param=param, code="invalid_type")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise APIError(400, f"{param}.role must be a non-empty string", param=f"{param}.role",
                       code="invalid_type" if "role" in m else "missing_required_parameter")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: only text ones
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"{param}.content[{j}]: only text parts are supported",
                               param=f"{param}.content", code="invalid_value")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise APIError(400, f"{param}.content must be a string or an array of text parts",
                       param=f"{param}.content", code="invalid_type")
    return {"role": role, "content": content}


# ---------------------------------------------------------------------------------------------------- scheduling
class Job:
    """One request on its way through the scheduler. The worker thread calls emit(); the HTTP side awaits
    `events` (("chunk", GenerationChunk) ..., then ("done", GenerationStats) or ("error", exception))."""

    def __init__(self, ids: List[int], params: dict, loop: asyncio.AbstractEventLoop):
        self.ids = ids
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.generated = 0

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (shutdown): nobody listens any more
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class _Refusing:
    """Stands in for the generator once none can be made (the model was closed): every job fails at once."""

    busy = False
    active: list = []

    def __init__(self, err: Exception):
        self.err = err

    def submit(self, *args, **kwargs):
        raise self.err

    def cancel(self, seq) -> None:
        pass

    def step(self) -> list:
        return []


class Scheduler:
    """Owns the model. submit() queues a job; one worker thread decodes all running jobs together with a
    metalattn.batch.BatchGenerator over the model's n_seq KV-cache slots (continuous batching: between two batched
    steps, new jobs join and finished or abandoned ones leave). All model use happens on that thread.

    With n_seq=1 (`--parallel 1`) this is one job at a time, as fast as Model.stream (measured: the one-row step
    and the single-sequence step run at the same tok/s). A job whose client left is cancelled before the next step:
    its slot is freed at once, and a waiting job that was cancelled never starts. A job that fails (a bad prompt,
    the context, non-finite logits) ends with ("error", exception); the others go on."""

    def __init__(self, model, max_queue: int = 64):
        self.model = model
        self.max_queue = max_queue
        self.n_slots = model.n_seq
        self._gen = BatchGenerator(model)
        self._inbox: "queue.Queue[Optional[Job]]" = queue.Queue()  # jobs not yet handed to the generator
        self._jobs: Dict[Any, Job] = {}  # Sequence -> its Job, while the generator holds it (worker thread only)
        self._thread = threading.Thread(target=self._loop, name="metalattn-scheduler", daemon=True)
        self._lock = threading.Lock()
        self._stopping = False
        self._pending = 0  # jobs submitted and not yet finished (queued + active), under _lock
        self.active = 0  # jobs holding a KV-cache slot (updated after every step)
        self.completed = 0
        self.cancelled = 0
        self.failed = 0
        self.steps = 0  # batched steps run
        self.max_active = 0  # most jobs decoded together in one step so far
        self.last_cancelled_tokens: Optional[int] = None  # tokens a cancelled job had generated when it stopped

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancels the running and the queued jobs (each gets its "done" event), then ends the worker."""
        self._stopping = True
        self._inbox.put(None)  # the worker cancels everything when it reaches this, after its current step
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def queued(self) -> int:
        """Jobs waiting for a slot."""
        with self._lock:
            return max(0, self._pending - self.active)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise APIError(503, "the server is shutting down", code="server_shutting_down", type="server_error")
            if self._pending - self.n_slots >= self.max_queue:  # every slot taken and max_queue waiting
                raise APIError(503, f"the server is busy ({self.max_queue} requests queued); retry later",
                               code="server_busy", type="server_error")
            self._pending += 1
        self._inbox.put(job)

    # ------------------------------------------------------------------ the worker
    def _loop(self) -> None:
        gen = self._gen
        while True:
            if not gen.busy:  # nothing to decode: sleep until a job (or the stop sentinel) comes
                job = self._inbox.get()
                if job is None:
                    return
                self._take(job)
            while True:  # the jobs that came during the last step join before the next one
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._shutdown()
                    return
                self._take(job)
            if not gen.busy:
                continue
            for seq, job in self._jobs.items():
                if job.cancelled.is_set() and not seq.cancelled:
                    gen.cancel(seq)  # its slot is freed by the step below
            try:
                events = gen.step()
            except Exception as e:  # the model itself failed (closed, ...): every job ends with the error
                log.exception("batched step failed")
                for seq, job in list(self._jobs.items()):
                    seq.error = seq.error or e
                    seq.done = True
                    self._end(seq)
                try:
                    self._gen = gen = BatchGenerator(self.model)
                except Exception as e2:  # no generator can be made (the model is closed): refuse every later job
                    self._gen = gen = _Refusing(e2)
                with self._lock:
                    self.active = 0
                continue
            for seq, chunk in events:
                job = self._jobs.get(seq)
                if job is None:
                    continue
                if chunk is not None:
                    job.generated += 1
                    job.emit("chunk", chunk)
                if seq.done:
                    self._end(seq)
            n = len(gen.active)
            with self._lock:
                self.active = n
                self.steps += 1
                self.max_active = max(self.max_active, n)

    def _take(self, job: Job) -> None:
        """Hands a job to the generator (or ends it at once: cancelled while queued, or refused by submit)."""
        if job.cancelled.is_set():  # its client left while it waited
            with self._lock:
                self._pending -= 1
                self.cancelled += 1
            job.emit("done", GenerationStats(prompt_tokens=len(job.ids), finish_reason="cancelled"))
            return
        try:
            seq = self._gen.submit(job.ids, **job.params)
        except Exception as e:  # bad ids, a prompt past the context, bad settings: this job only
            with self._lock:
                self._pending -= 1
                self.failed += 1
            job.emit("error", e)
            return
        self._jobs[seq] = job

    def _end(self, seq) -> None:
        job = self._jobs.pop(seq)
        with self._lock:
            self._pending -= 1
            if seq.error is not None:
                self.failed += 1
            elif job.cancelled.is_set() or seq.stats.finish_reason == "cancelled":
                self.cancelled += 1
                self.last_cancelled_tokens = job.generated
            else:
                self.completed += 1
        if seq.error is not None:
            if not isinstance(seq.error, _REQUEST_ERRORS):
                log.error("generation failed: %s", seq.error)
            job.emit("error", seq.error)
        else:
            job.emit("done", copy.copy(seq.stats))

    def _shutdown(self) -> None:
        """Ends every job (cancelled) and frees the slots."""
        gen = self._gen
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                self._take(job)
        for seq in self._jobs:
            gen.cancel(seq)
        try:
            while gen.busy:
                for seq, _ in gen.step():
                    if seq.done and seq in self._jobs:
                        self._end(seq)
        except Exception:  # the model is gone: the jobs end anyway
            log.exception("shutdown step failed")
        for seq in list(self._jobs):
            seq.done = True
            self._end(seq)
        with self._lock:
            self.active = 0


# ---------------------------------------------------------------------------------------------------- the app
class _Ctx:
    """What the endpoints share: the model's name(s), its tokenizer and context size, and the scheduler."""

    def __init__(self, model, model_id: str, aliases, scheduler: Scheduler, api_key: Optional[str]):
        self.model = model
        self.model_id = model_id
        self.names = {model_id, *[a for a in aliases if a]}
        self.scheduler = scheduler
        self.api_key = api_key
        self.created = int(time.time())

    def check_model(self, body: dict) -> None:
        name = _field(body, "model", "str", required=True)
        if name not in self.names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def token_info(self, token: int) -> dict:
        b = self.model.tokenizer.token_to_bytes(token)
        return {"token": b.decode("utf-8", errors="replace"), "bytes": list(b)}

    def max_tokens(self, body: dict, n_prompt: int, default: Optional[int]) -> int:
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        n_ctx = self.model.n_ctx
        if n_prompt >= n_ctx:
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens, but the prompt has "
                                f"{n_prompt} tokens, leaving no room for an answer", param="messages" if
                           "messages" in body else "prompt", code="context_length_exceeded")
        mt = _field(body, key, "int", None, lo=1)
        if mt is None:
            return min(default, n_ctx - n_prompt) if default is not None else n_ctx - n_prompt
        if n_prompt + mt > n_ctx:
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens; the prompt's {n_prompt} "
                                f"tokens plus {key}={mt} exceed it (at most {n_ctx - n_prompt})", param=key,
                           code="context_length_exceeded")
        return mt


def _finish(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else ("stop" if reason == "stop" else "length")


def _usage(n_prompt: int, stats) -> dict:
    done = stats.generated_tokens if stats is not None else 0
    cached = stats.cached_tokens if stats is not None else 0
    return {"prompt_tokens": n_prompt, "completion_tokens": done, "total_tokens": n_prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Non-streaming requests: cancel the job as soon as the client hangs up."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel()
            job.events.put_nowait(("gone", None))
            return


async def _collect(request: Request, job: Job):
    """All of a job's chunks and its stats, or None when the client left first."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, job))
    chunks = []
    try:
        while True:
            kind, payload = await job.events.get()
            if kind == "chunk":
                chunks.append(payload)
            elif kind == "done":
                return chunks, payload
            elif kind == "error":
                raise _job_error(payload)
            else:
                return None
    finally:
        job.cancel()  # a no-op once done; stops the worker if this handler itself was cancelled
        watcher.cancel()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _job_error(e: Exception) -> APIError:
    """The API error for a job that failed in the worker: a fault of the request (its tokens, its context) is a
    400 as the HTTP side's own checks give; anything else a 500."""
    if isinstance(e, ContextOverflowError):
        return APIError(400, str(e), code="context_length_exceeded")
    if isinstance(e, _REQUEST_ERRORS):
        return APIError(400, str(e), code="invalid_value")
    return APIError(500, f"generation failed: {e}", code="generation_failed")


def _error_event(e: Exception) -> str:
    return _sse(_job_error(e).body())


async def _stream_events(job: Job, base: dict, n_prompt: int, include_usage: bool, chunk_choice, final_choice,
                         first: Optional[dict] = None):
    """The server-sent events of a streamed completion: the opening choice (if any), one event per chunk for which
    chunk_choice(chunk) gives a choice, final_choice(stats) with the finish reason, the usage when asked, then
    [DONE]. The job is cancelled when the client leaves (this generator is cancelled or closed) or the stream ends."""
    try:
        if first is not None:
            yield _sse(dict(base, choices=[first]))
        while True:
            kind, payload = await job.events.get()
            if kind == "chunk":
                choice = chunk_choice(payload)
                if choice is not None:
                    yield _sse(dict(base, choices=[choice]))
            elif kind == "done":
                yield _sse(dict(base, choices=[final_choice(payload)]))
                if include_usage:
                    yield _sse(dict(base, choices=[], usage=_usage(n_prompt, payload)))
                break
            else:
                yield _error_event(payload)
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def _chat_logprobs(ctx: _Ctx, chunks, top: int) -> dict:
    content = []
    for c in chunks:
        if c.token in ctx.model.tokenizer.eot_ids:
            continue
        entry = dict(ctx.token_info(c.token), logprob=c.logprob)
        entry["top_logprobs"] = [dict(ctx.token_info(t), logprob=lp) for t, lp in (c.top_logprobs or [])[:top]]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(ctx: _Ctx, chunks, offset0: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    offset = offset0
    for c in chunks:
        if c.token in ctx.model.tokenizer.eot_ids:
            continue
        piece = ctx.token_info(c.token)["token"]
        tokens.append(piece)
        lps.append(c.logprob)
        tops.append({ctx.token_info(t)["token"]: lp for t, lp in (c.top_logprobs or [])})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {_type_name(body)}", code="invalid_type")
    stack = [body]
    while stack:  # JSON may spell lone UTF-16 surrogates (\ud800), which no text can hold
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "The request body holds a string with a lone UTF-16 surrogate (not text)",
                               code="invalid_json") from None
    return body


def create_app(model, model_id: Optional[str] = None, api_key: Optional[str] = None, aliases=(),
               max_queue: int = 64, scheduler: Optional[Scheduler] = None) -> Starlette:
    """The ASGI app serving `model`. It starts its scheduler's worker on startup and stops it on shutdown."""
    model_id = model_id or model.path.stem
    sched = scheduler or Scheduler(model, max_queue=max_queue)
    ctx = _Ctx(model, model_id, aliases, sched, api_key)

    async def chat_completions(request: Request):
        body = await _json_body(request)
        ctx.check_model(body)
        messages = body.get("messages", _MISSING)
        if messages is _MISSING or messages is None:
            raise APIError(400, "'messages' is a required property", param="messages",
                           code="missing_required_parameter")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty array of messages", param="messages",
                           code="invalid_type" if not isinstance(messages, list) else "invalid_value")
        msgs = [_message_text(m, i) for i, m in enumerate(messages)]
        params = _sampling(body)
        stream, include_usage = _stream_flags(body)
        want_lp = _field(body, "logprobs", "bool", False)
        top = _field(body, "top_logprobs", "int", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not want_lp:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                           code="invalid_value")
        top = top or 0

        def render():
            try:
                text = model.apply_chat_template(msgs)
            except MetalattnError as e:
                raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                               code="invalid_value") from None
            return model.tokenize(text)

        ids = await run_in_threadpool(render)
        params["max_tokens"] = ctx.max_tokens(body, len(ids), None)
        params["logprobs"] = top if want_lp else None
        job = Job(ids, params, asyncio.get_running_loop())
        sched.submit(job)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "created": created, "model": ctx.model_id, "system_fingerprint": None}
        if not stream:
            got = await _collect(request, job)
            if got is None:
                return JSONResponse({}, status_code=499)
            chunks, stats = got
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(c.text for c in chunks)},
                      "logprobs": _chat_logprobs(ctx, chunks, top) if want_lp else None,
                      "finish_reason": _finish(stats.finish_reason)}
            return JSONResponse(dict(head, object="chat.completion", choices=[choice],
                                     usage=_usage(len(ids), stats)))

        base = dict(head, object="chat.completion.chunk")
        if include_usage:
            base["usage"] = None

        def chunk_choice(c):
            if not (c.text or want_lp):
                return None
            lp = _chat_logprobs(ctx, [c], top) if want_lp else None
            return {"index": 0, "delta": {"content": c.text}, "logprobs": lp, "finish_reason": None}

        events = _stream_events(
            job, base, len(ids), include_usage, chunk_choice,
            lambda stats: {"index": 0, "delta": {}, "logprobs": None, "finish_reason": _finish(stats.finish_reason)},
            first={"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def completions(request: Request):
        body = await _json_body(request)
        ctx.check_model(body)
        prompt = body.get("prompt", _MISSING)
        if prompt is _MISSING or prompt is None:
            raise APIError(400, "'prompt' is a required property", param="prompt", code="missing_required_parameter")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise APIError(400, "'prompt' must be a string, an array of token ids, or a batch of one of them "
                                    "(batches of several prompts are not supported)", param="prompt",
                               code="invalid_value")
            bad = [t for t in prompt if not 0 <= t < model.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})",
                               param="prompt", code="invalid_value")
        elif not isinstance(prompt, str):
            raise APIError(400, f"'prompt' must be a string or an array of token ids, got {_type_name(prompt)}",
                           param="prompt", code="invalid_type")
        if _field(body, "echo", "bool", False):
            raise APIError(400, "'echo' is not supported", param="echo", code="unsupported_parameter")
        if body.get("suffix") not in (None, ""):
            raise APIError(400, "'suffix' is not supported", param="suffix", code="unsupported_parameter")
        if _field(body, "best_of", "int", 1, lo=1) != 1:
            raise APIError(400, "'best_of' must be 1", param="best_of", code="unsupported_parameter")
        params = _sampling(body)
        stream, include_usage = _stream_flags(body)
        k = _field(body, "logprobs", "int", None, lo=0, hi=MAX_TOP_LOGPROBS)
        ids = list(prompt) if isinstance(prompt, list) else await run_in_threadpool(model.tokenize, prompt)
        if not ids:
            raise APIError(400, "the prompt is empty (no tokens)", param="prompt", code="invalid_value")
        params["max_tokens"] = ctx.max_tokens(body, len(ids), 16)
        params["logprobs"] = k
        job = Job(ids, params, asyncio.get_running_loop())
        sched.submit(job)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_id,
                "system_fingerprint": None}
        if not stream:
            got = await _collect(request, job)
            if got is None:
                return JSONResponse({}, status_code=499)
            chunks, stats = got
            choice = {"text": "".join(c.text for c in chunks), "index": 0,
                      "logprobs": _completion_logprobs(ctx, chunks) if k is not None else None,
                      "finish_reason": _finish(stats.finish_reason)}
            return JSONResponse(dict(head, choices=[choice], usage=_usage(len(ids), stats)))

        base = dict(head, usage=None) if include_usage else head
        offset = 0  # characters of text streamed so far (text_offset of the logprobs)

        def chunk_choice(c):
            nonlocal offset
            if not (c.text or k is not None):
                return None
            lp = _completion_logprobs(ctx, [c], offset) if k is not None else None
            if lp is not None and lp["tokens"]:
                offset += len(lp["tokens"][0])
            return {"text": c.text, "index": 0, "logprobs": lp, "finish_reason": None}

        events = _stream_events(
            job, base, len(ids), include_usage, chunk_choice,
            lambda stats: {"text": "", "index": 0, "logprobs": None, "finish_reason": _finish(stats.finish_reason)})
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": ctx.model_id, "object": "model", "created": ctx.created, "owned_by": "metalattn"}]})

    async def health(request: Request):
        s = ctx.scheduler
        return JSONResponse({"status": "ok", "model": ctx.model_id, "device": model.device, "n_ctx": model.n_ctx,
                             "parallel": s.n_slots, "active": s.active, "queued": s.queued,
                             "max_active": s.max_active, "completed": s.completed,
                             "cancelled": s.cancelled, "failed": s.failed,
                             "last_cancelled_tokens": s.last_cancelled_tokens})

    def guarded(handler):
        async def endpoint(request: Request):
            try:
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except Exception as e:  # never let a request take the server down
                log.exception("request failed")
                return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))
        return endpoint

    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code), headers=getattr(exc, "headers", None))

    class AuthMiddleware:
        """With an API key, every request needs `Authorization: Bearer <key>` (401 otherwise)."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and ctx.api_key is not None:
                auth = ""
                for k, v in scope.get("headers", []):
                    if k == b"authorization":
                        auth = v.decode("latin-1")
                        break
                scheme, _, token = auth.partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                         ctx.api_key.encode()):
                    why = "no API key was given" if not auth else "the API key is wrong"
                    resp = error_response(APIError(401, f"Incorrect API key: {why} (send Authorization: Bearer "
                                                        "<key>)", code="invalid_api_key"),
                                          headers={"WWW-Authenticate": "Bearer"})
                    await resp(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        if not sched._thread.is_alive() and sched._thread.ident is None:
            sched.start()
        yield
        sched.stop()

    from starlette.middleware import Middleware

    app = Starlette(routes=[
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/health", guarded(health), methods=["GET"]),
    ], exception_handlers={HTTPException: http_error}, middleware=[Middleware(AuthMiddleware)], lifespan=lifespan)
    app.state.scheduler = sched
    app.state.model_id = model_id
    return app


class ServerThread:
    """Runs the app under uvicorn in a background thread on an already-bound socket (port 0: an ephemeral one);
    for tests and embedding. `url` is the base URL, e.g. http://127.0.0.1:43123/v1 minus the /v1."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="metalattn-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(model, host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None,
          model_id: Optional[str] = None, aliases=(), log_level: str = "info") -> None:
    """Serves `model` until interrupted (Ctrl-C)."""
    app = create_app(model, model_id=model_id, api_key=api_key, aliases=aliases)
    print(f"metalattn: serving {app.state.model_id} ({model.device}, {model.n_seq} parallel sequence"
          f"{'s' if model.n_seq != 1 else ''}, n_ctx {model.n_ctx} each) at "
          f"http://{host}:{port}/v1" + (" (API key required)" if api_key else ""), flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
