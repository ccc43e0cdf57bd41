"""Continuous batching: many sequences decoded together, one batched forward step for all of them.

A model loaded with `n_seq=N` has N KV-cache slots. A BatchGenerator places each submitted sequence in a free slot
(the one whose cached tokens share the longest prefix with its prompt, so the next turn of a chat reuses its
history), prefills its prompt there, and then every step() feeds the last token of every active sequence to the
engine as one batch (Engine.forward_batch: the projections run as n-row matrix products, each weight read once for
all rows; attention runs per row over the row's own slot). A sequence that finishes frees its slot between two
steps and a waiting one takes it.

    gen = BatchGenerator(model)
    a = gen.submit("Once upon a time", max_tokens=32)
    b = gen.submit([1, 2, 3], max_tokens=16, temperature=0.8, seed=1)
    while gen.busy:
        for seq, chunk in gen.step():
            ...   # chunk: a GenerationChunk of seq (None when seq ended without a token: cancelled or failed)

Model.generate_batch() and the server's scheduler (`metalattn serve --parallel N`) are built on it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import List, Optional, Sequence as Seq, Tuple, Union

import numpy as np

from .errors import (ContextChangedError, ContextOverflowError, InvalidArgumentError, MetalattnError,
                     NonFiniteError, TokenError)
from .model import GenerationChunk, GenerationStats, TextStream, _choose
from .sampling import sample


class Sequence:
    """One sequence of a BatchGenerator: prompt, settings and progress. `done` once it has finished; then
    `stats.finish_reason` says why ("stop", "length", "context", "cancelled") and `error` holds the exception of a
    sequence that failed."""

    def __init__(self, ids: List[int], max_tokens: int, temperature: float, top_k: int, top_p: float,
                 seed: Optional[int], stops: List[str], logprobs: Optional[int], tokenizer):
        self.ids = ids
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.logprobs = logprobs
        self.rng = np.random.default_rng(seed)
        self.text = TextStream(tokenizer, stops, max_tokens)
        self.stats = GenerationStats(prompt_tokens=len(ids))
        self.slot: Optional[int] = None
        self.pos = 0             # tokens in its slot's KV cache
        self.index = 0           # index of the next chunk
        self.token: Optional[int] = None  # the last generated token: fed at the next step
        self.done = False
        self.cancelled = False
        self.error: Optional[BaseException] = None
        self._t_decode = 0.0     # when its prefill ended

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def needs_logits(self) -> bool:
        return not self.greedy or self.logprobs is not None

    def __repr__(self) -> str:
        state = "done" if self.done else ("waiting" if self.slot is None else f"slot {self.slot}")
        return f"Sequence({len(self.ids)} prompt tokens, {self.index} generated, {state})"


class BatchGenerator:
    """Decodes the sequences submitted to it together over the model's n_seq KV-cache slots (see the module
    docstring). Each step() holds the model's lock. Slot 0 is also the cache of the single-sequence calls
    (generate, stream, forward_*): a sequence the generator placed there ends with ContextChangedError if such a call
    runs in between (hold `model.lock` around the steps to keep other threads out)."""

    def __init__(self, model):
        model._check_open()
        self.model = model
        self.n_slots = model.n_seq
        self._slots: List[Optional[Sequence]] = [None] * self.n_slots
        self._cached: List[List[int]] = [[] for _ in range(self.n_slots)]  # token ids each slot's cache holds
        self._waiting: "deque[Sequence]" = deque()
        self._slot0_mine = False  # slot 0 holds what _cached[0] says (no other call has moved it since)
        self._last_use = [0] * self.n_slots  # _clock when each slot was last given to a sequence
        self._prompt_len = [0] * self.n_slots  # prompt length of each slot's last sequence
        self._clock = 0

    # ------------------------------------------------------------------ queue
    def submit(self, prompt: Union[str, Seq[int]], max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: Optional[int] = None, stop: Optional[Union[str, Seq[str]]] = None,
               logprobs: Optional[int] = None) -> Sequence:
        """Queues a sequence (it starts at the next step with a free slot). The arguments are those of
        Model.stream(); bad ones raise here, at once."""
        model = self.model
        if max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        if logprobs is not None and logprobs < 0:
            raise InvalidArgumentError(f"logprobs must be >= 0, got {logprobs}")
        if temperature > 0:
            if not 0.0 < top_p <= 1.0:
                raise InvalidArgumentError(f"top_p must be in (0, 1], got {top_p}")
            if top_k < 0:
                raise InvalidArgumentError(f"top_k must be >= 0, got {top_k}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise InvalidArgumentError("stop strings must be non-empty")
        ids = model.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise TokenError("empty prompt: at least one token is needed")
        for i, t in enumerate(ids):
            if not 0 <= t < model.vocab_size:
                raise TokenError(f"token id {t} at index {i} out of range [0, {model.vocab_size})")
        if len(ids) > model.n_ctx:
            raise ContextOverflowError(f"{len(ids)} prompt tokens exceed the context of {model.n_ctx} tokens")
        seq = Sequence(ids, max_tokens, temperature, top_k, top_p, seed, stops, logprobs, model.tokenizer)
        self._waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stops a sequence; its slot is freed at the next step (which reports it with a None chunk)."""
        seq.cancelled = True

    @property
    def active(self) -> List[Sequence]:
        return [s for s in self._slots if s is not None]

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    # ------------------------------------------------------------------ steps
    def step(self) -> List[Tuple[Sequence, Optional[GenerationChunk]]]:
        """Admits waiting sequences into free slots (prefilling their prompts: each yields its first token), then
        runs one batched decode step for every other active sequence. Returns (sequence, chunk) for every token
        produced, and (sequence, None) for a sequence that ended without one (cancelled, failed, max_tokens=0)."""
        model = self.model
        events: List[Tuple[Sequence, Optional[GenerationChunk]]] = []
        with model.lock:
            model._check_open()
            engine = model._engine
            if self._slot0_mine and model._kv_owner is not self:  # another call used slot 0 since our last step
                self._slot0_mine = False
                self._cached[0] = []
                seq = self._slots[0]
                if seq is not None:
                    self._fail(seq, ContextChangedError(
                        f"{model.path.name}: another call used KV-cache slot 0 while a batched sequence was in it"),
                        events)
            for slot, seq in enumerate(self._slots):
                if seq is not None and seq.cancelled:
                    self._finish(seq, "cancelled")
                    events.append((seq, None))
            # Decode the sequences that already have a token to feed, then admit new ones: a newcomer's prefill
            # yields its first token itself.
            rows = [s for s in self._slots if s is not None]
            if rows:
                self._decode(engine, rows, events)
            self._admit(engine, events)
            if self._slot0_mine:
                model._kv_owner = self
                model._cache_tokens = None  # Model.stream's reuse_prefix history of slot 0 is no longer there
        return events

    def _free_slot(self, ids: List[int]) -> Optional[int]:
        """The free slot for a prompt: one whose cache the prompt continues (it starts with the whole prompt of the
        slot's last sequence: the next turn of that conversation), the longest such; else an empty slot (slot 0
        first: a lone sequence there takes the single-sequence step); else the least recently used one. Prompts that
        share only an opening (a chat template's system prompt) thus keep to their own slots instead of evicting
        another conversation's history while empty slots wait."""
        free = [s for s in range(self.n_slots) if self._slots[s] is None]
        if not free:
            return None
        best, best_n = None, 0
        for s in free:
            cached = self._slot_cache(s)
            n = _common_prefix(cached, ids)
            if n > best_n and n >= min(self._prompt_len[s], len(cached)):
                best, best_n = s, n
        if best is None:
            best = min(free, key=lambda s: (len(self._slot_cache(s)) > 0, self._last_use[s], s))
        self._clock += 1
        self._last_use[best] = self._clock
        return best

    def _slot_cache(self, slot: int) -> List[int]:
        """What the slot's KV cache holds as far as this generator knows (slot 0: nothing, once another call used it)."""
        return self._cached[slot] if slot != 0 or self._slot0_mine else []

    def _admit(self, engine, events) -> None:
        while self._waiting:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                seq.done = True
                seq.stats.finish_reason = "cancelled"
                events.append((seq, None))
                continue
            if seq.max_tokens == 0:
                self._waiting.popleft()
                seq.done = True
                seq.stats.finish_reason = "length"
                events.append((seq, None))
                continue
            slot = self._free_slot(seq.ids)
            if slot is None:
                return
            self._waiting.popleft()
            seq.slot = slot
            self._slots[slot] = seq
            self._prompt_len[slot] = len(seq.ids)
            keep = min(_common_prefix(self._slot_cache(slot), seq.ids), len(seq.ids) - 1)
            seq.stats.cached_tokens = keep
            t0 = time.perf_counter()
            try:
                engine.truncate_slot(slot, keep)
                rest = np.asarray(seq.ids[keep:], dtype=np.int32)
                self._cached[slot] = list(seq.ids)  # written first: a failing call leaves the slot marked stale
                if slot == 0:
                    self._slot0_mine = True
                token, logits = engine.forward_prompt_slot(slot, rest, seq.needs_logits)
                seq.pos = engine.slot_pos(slot)
                if seq.pos != len(seq.ids):
                    raise MetalattnError("internal error: the slot's position does not match its prompt")
            except Exception as e:  # this sequence fails; the others go on
                self._cached[slot] = []
                self._fail(seq, self._wrap(e), events)
                continue
            t1 = time.perf_counter()
            seq.stats.prefill_seconds = t1 - t0
            seq._t_decode = t1
            self._emit(seq, token, logits, t1, events)

    def _decode(self, engine, rows: List[Sequence], events) -> None:
        toks = [s.token for s in rows]
        slots = [s.slot for s in rows]
        cached = self._cached
        for slot, tok in zip(slots, toks):
            cached[slot].append(tok)
        drawn = [not s.greedy and s.logprobs is None for s in rows]  # sampled rows the step itself draws
        try:
            if len(rows) == 1 and slots[0] == 0:
                # One sequence, in slot 0: the single-sequence step (on CUDA the captured decode graph, ~1.6x the
                # one-row batch step), which reads and writes slot 0 as forward_batch would. A sampled one draws
                # where the logits are (forward_token_sample: on CUDA on the device, 8 bytes back), from the same
                # uniform sample() would take; _emit then takes the drawn token as it is.
                s0 = rows[0]
                if s0.logprobs is not None:
                    ids, logits = [None], [engine.forward_token(toks[0])]
                elif not s0.greedy:
                    ids = [engine.forward_token_sample(toks[0], float(s0.temperature), int(s0.top_k),
                                                       float(s0.top_p), float(s0.rng.random()))]
                    logits = None
                else:
                    ids, logits = [engine.forward_token_greedy(toks[0])], None
            elif any(drawn):
                # The sampled rows drawn where the logits are (on CUDA on the device), each from its own
                # generator's next uniform, as sample() would take it; logits come back only for logprobs.
                ids, logits = engine.forward_batch_sample(
                    np.array(toks, dtype=np.int32), np.array(slots, dtype=np.int32),
                    np.array([s.temperature if d else 0.0 for s, d in zip(rows, drawn)], dtype=np.float64),
                    np.array([s.top_k for s in rows], dtype=np.int64),
                    np.array([s.top_p for s in rows], dtype=np.float64),
                    np.array([s.rng.random() if d else 0.0 for s, d in zip(rows, drawn)], dtype=np.float64),
                    any(s.logprobs is not None for s in rows))
            else:
                ids, logits = engine.forward_batch(np.array(toks, dtype=np.int32), np.array(slots, dtype=np.int32),
                                                   any(s.needs_logits for s in rows))
        except Exception as e:  # e.g. non-finite logits: every row of the step fails
            err = self._wrap(e)
            for s in rows:
                cached[s.slot] = []
                self._fail(s, err, events)
            return
        now = time.perf_counter()
        for i, s in enumerate(rows):
            s.pos += 1
            self._emit(s, ids[i], None if logits is None or drawn[i] else logits[i], now, events)

    def _emit(self, seq: Sequence, argmax: int, logits, now: float, events) -> None:
        """Chooses seq's next token from the step's output and reports it: `argmax` is the step's argmax, or the
        token it drew already where a sampled step came without logits (forward_token_sample)."""
        lp = top = None
        try:
            if seq.logprobs is not None:
                token, lp, top = _choose(logits, seq.greedy, seq.rng, seq.temperature, seq.top_k, seq.top_p,
                                         seq.logprobs)
            elif seq.greedy or logits is None:
                token = int(argmax)
            else:
                token = sample(logits, seq.rng, seq.temperature, seq.top_k, seq.top_p)
        except Exception as e:
            self._fail(seq, self._wrap(e), events)
            return
        seq.token = token
        st = seq.stats
        st.generated_tokens = seq.index + 1
        st.decode_seconds = now - seq._t_decode
        text, finish = seq.text.push(token, seq.pos >= self.model.n_ctx)
        events.append((seq, GenerationChunk(text, token, seq.index, st.decode_tokens_per_second, finish, lp, top)))
        seq.index += 1
        if finish is not None:
            self._finish(seq, finish)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.done = True
        seq.stats.finish_reason = reason
        if seq.slot is not None and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None

    def _fail(self, seq: Sequence, err: BaseException, events) -> None:
        seq.error = err
        self._finish(seq, "error")
        events.append((seq, None))

    def _wrap(self, e: BaseException) -> BaseException:
        if isinstance(e, NonFiniteError):
            return self.model._non_finite(e)
        if isinstance(e, MetalattnError):
            return e
        return MetalattnError(f"{self.model.path.name}: batched decoding failed: {e}")


def _common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
