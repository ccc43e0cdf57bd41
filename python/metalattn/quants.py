"""GGUF weight formats in vectorised numpy: quantize and dequantize whole matrices.

The block layouts are the ones in cpp/include/metalattn/quant.h (GGUF's own). Legacy types hold 32 weights a block:
Q4_0 = fp16 d + 16 bytes of nibbles (weight j in the low nibble of byte j, weight j+16 in the high nibble), Q4_1
adds an fp16 min after d, Q5_0 / Q5_1 add 4 bytes of fifth bits, Q8_0 = fp16 d + 32 int8. The K-quants (Q2_K ..
Q6_K) hold 256-weight super-blocks of 16- or 32-weight sub-blocks with 4..8-bit scales. All scalars little-endian.

Our own quantizers (Q4_0, Q4_1, Q8_0) reproduce ggml's reference (non-SIMD) quantizers bit for bit: float32
arithmetic in the same order with the same truncation/rounding, so a file quantized here equals one quantized by
llama.cpp. Q5_0 / Q5_1 use the gguf package's port of the same reference. The K-quant quantizers here are simple
(per sub-block min/max fitting, no search): valid files for tests and synthetic models, not llama.cpp's output.
The new types dequantize through the gguf package's numpy code, which the C++ reference matches bit for bit
(tests/python/test_quants.py).
"""
from __future__ import annotations

import numpy as np

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14

TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
              BF16: "BF16", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
TYPES_BY_NAME = {name.lower(): t for t, name in TYPE_NAMES.items()}
SUPPORTED_TYPES = tuple(TYPE_NAMES)

BLOCK = 32    # weights per block of the legacy types
QK_K = 256    # weights per super-block of the K-quants
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176,
                Q6_K: 210}
_ELEMENT_BYTES = {F32: 4, F16: 2, BF16: 2}
K_QUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)


def type_name(ggml_type: int) -> str:
    """'Q4_0' for 2, etc.; 'type 20' for an id this module does not handle."""
    return TYPE_NAMES.get(int(ggml_type), f"type {int(ggml_type)}")


def parse_type(name_or_id) -> int:
    """A ggml type id from an id, a gguf GGMLQuantizationType, or a name such as 'q4_0' (any case)."""
    if isinstance(name_or_id, str):
        key = name_or_id.strip().lower()
        if key not in TYPES_BY_NAME:
            raise ValueError(f"unknown weight type {name_or_id!r}; expected one of {sorted(TYPES_BY_NAME)}")
        return TYPES_BY_NAME[key]
    t = int(name_or_id)
    if t not in TYPE_NAMES:
        raise ValueError(f"unsupported ggml type {t}; supported: {', '.join(TYPE_NAMES.values())}")
    return t


def is_quantized(ggml_type: int) -> bool:
    return int(ggml_type) in _BLOCK_BYTES


def block_elems(ggml_type: int) -> int:
    """Weights per block: 32 (legacy), 256 (K-quants), 1 (float types)."""
    t = parse_type(ggml_type)
    return QK_K if t in K_QUANTS else BLOCK if t in _BLOCK_BYTES else 1


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of `cols` weights (quantized types need cols % block_elems == 0)."""
    t = parse_type(ggml_type)
    if t in _ELEMENT_BYTES:
        return cols * _ELEMENT_BYTES[t]
    be = block_elems(t)
    if cols % be:
        raise ValueError(f"{type_name(t)} needs a row length that is a multiple of {be}, got {cols}")
    return cols // be * _BLOCK_BYTES[t]


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """float32 [n] -> uint8 [n, 2]: IEEE half, round to nearest even (as F16C and ggml's scalar fallback do)."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _fp16_from_bytes(b: np.ndarray) -> np.ndarray:
    """uint8 [n, 2] -> float32 [n, 1] (exact)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32).reshape(-1, 1)


def _safe_reciprocal(d: np.ndarray) -> np.ndarray:
    """1/d in float32, 0 where d == 0 (a block of zeros quantizes to the zero code, as in ggml)."""
    out = np.zeros_like(d)
    np.divide(np.float32(1.0), d, out=out, where=d != 0)
    return out


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 codes [n, 32] (0..15) -> [n, 16]: weight j low nibble, weight j+16 high nibble."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] -> uint8 codes [n, 32] in weight order."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf on float32 values. Done in float64, where |v| + 0.5 is exact, so 0.49999997 does not round up."""
    a = np.abs(v.astype(np.float64))
    return np.copysign(np.floor(a + 0.5), v)


def _quantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    # d is the signed value of largest magnitude over -8, so that value maps exactly to code 0 and the
    # other side gets the extra level (ggml's reference choice). The first such value wins ties, as in ggml.
    n = blocks.shape[0]
    signed_max = blocks[np.arange(n), np.abs(blocks).argmax(axis=1)]
    d = signed_max / np.float32(-8.0)
    inv = _safe_reciprocal(d)
    # float32 multiply-add, then truncation toward zero: C's (int8_t)(x*id + 8.5f); the sum is >= 0.
    codes = np.trunc(blocks * inv[:, None] + np.float32(8.5))
    q = np.minimum(codes, 15).astype(np.uint8)
    out = np.empty((n, 18), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:] = _pack_nibbles(q)
    return out


def _quantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    lo = blocks.min(axis=1)
    hi = blocks.max(axis=1)
    d = (hi - lo) / np.float32(15.0)
    inv = _safe_reciprocal(d)
    codes = np.trunc((blocks - lo[:, None]) * inv[:, None] + np.float32(0.5))
    q = np.minimum(codes, 15).astype(np.uint8)
    out = np.empty((n, 20), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:4] = _fp16_bytes(lo)
    out[:, 4:] = _pack_nibbles(q)
    return out


def _quantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = np.abs(blocks).max(axis=1) / np.float32(127.0)
    inv = _safe_reciprocal(d)
    q = _round_half_away(blocks * inv[:, None]).astype(np.int8)
    out = np.empty((n, 34), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:] = q.view(np.uint8)
    return out


def _float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even; NaNs stay (quiet) NaNs instead of rounding to inf."""
    bits = x.view(np.uint32).astype(np.uint64)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [n, 8] -> the 12 packed bytes of Q4_K / Q5_K (see quant.h)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _quantize_q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """[n, 256] -> Q4_K (bits 4) or Q5_K (bits 5): weight = d*sc*q - dmin*m per 32-weight sub-block."""
    n = blocks.shape[0]
    levels = (1 << bits) - 1
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)                         # the min term can only subtract
    scale = (sub.max(axis=2) - lo) / np.float32(levels)
    d = (scale.max(axis=1) / np.float32(63.0)).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1) / np.float32(63.0)).astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(scale * _safe_reciprocal(d)[:, None]), 0, 63)  # round up: the range stays covered
    mn = np.clip(np.round(-lo * _safe_reciprocal(dmin)[:, None]), 0, 63)
    step = d[:, None] * sc                                        # [n, 8]
    offset = dmin[:, None] * mn
    q = np.clip(np.round((sub + offset[:, :, None]) * _safe_reciprocal(step)[:, :, None]), 0, levels).astype(np.uint8)
    q = q.reshape(n, 4, 2, 32)                                    # sub-block 2c + h: nibble h of byte 32c + l
    qs = (q[:, :, 0, :] & 0x0F) | ((q[:, :, 1, :] & 0x0F) << 4)
    head = np.empty((n, 16), np.uint8)
    head[:, 0:2] = _fp16_bytes(d)
    head[:, 2:4] = _fp16_bytes(dmin)
    head[:, 4:16] = _k_scale_bytes(sc, mn)
    if bits == 4:
        return np.concatenate([head, qs.reshape(n, 128)], axis=1)
    high = (q.reshape(n, 8, 32) >> 4) & 1                         # bit j of qh[l]: sub-block j, weight l
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate([head, qh, qs.reshape(n, 128)], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> Q6_K: weight = d * sc * (q - 32), int8 sc per 16-weight sub-block."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / np.float32(31.0)
    d = (scale.max(axis=1) / np.float32(127.0)).astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(scale * _safe_reciprocal(d)[:, None]), 0, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = (np.clip(np.round(sub * _safe_reciprocal(step)[:, :, None]), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = np.empty((n, 2, 64), np.uint8)                           # per half h: [g0 | g2 << 4 , g1 | g3 << 4]
    ql[:, :, :32] = (q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4)
    ql[:, :, 32:] = (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    out = np.empty((n, 210), np.uint8)
    out[:, :128] = ql.reshape(n, 128)
    out[:, 128:192] = qh.reshape(n, 64).astype(np.uint8)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = _fp16_bytes(d)
    return out


def _gguf_quantize(t: int):
    import gguf.quants

    return lambda blocks: gguf.quants.quantize(blocks, gguf.GGMLQuantizationType(t)).reshape(blocks.shape[0], -1)


def quantize(x: np.ndarray, ggml_type) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, row_bytes] in the GGUF layout of `ggml_type`."""
    t = parse_type(ggml_type)
    x = np.asarray(x)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D matrix, got shape {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    rb = row_bytes(t, cols)
    if t == F32:
        return x.astype("<f4").view(np.uint8).reshape(rows, rb)
    if t == F16:
        return x.astype("<f2").view(np.uint8).reshape(rows, rb)
    if t == BF16:
        return _float_to_bf16_bits(x).astype("<u2").view(np.uint8).reshape(rows, rb)
    quantizers = {Q4_0: _quantize_q4_0, Q4_1: _quantize_q4_1, Q8_0: _quantize_q8_0, Q5_0: _gguf_quantize(Q5_0),
                  Q5_1: _gguf_quantize(Q5_1), Q4_K: lambda b: _quantize_q45_k(b, 4),
                  Q5_K: lambda b: _quantize_q45_k(b, 5), Q6_K: _quantize_q6_k}
    if t not in quantizers:
        raise ValueError(f"quantizing to {type_name(t)} is not supported (dequantizing is)")
    blocks = x.reshape(-1, block_elems(t))
    # Work in slabs so the float temporaries stay small for big matrices (token_embd is 28M weights).
    slab = 1 << 16 if block_elems(t) == BLOCK else 1 << 13
    out = np.empty((blocks.shape[0], _BLOCK_BYTES[t]), np.uint8)
    for start in range(0, blocks.shape[0], slab):
        out[start:start + slab] = quantizers[t](blocks[start:start + slab])
    return out.reshape(rows, rb)


def dequantize(data: np.ndarray, ggml_type, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, row_bytes] (or any buffer of that many bytes) in the GGUF layout -> float32 [rows, cols]."""
    t = parse_type(ggml_type)
    rb = row_bytes(t, cols)
    raw = np.asarray(data)
    if raw.dtype != np.uint8:
        raw = np.ascontiguousarray(raw).view(np.uint8)
    if raw.size != rows * rb:
        raise ValueError(f"{type_name(t)} [{rows} x {cols}] needs {rows * rb} bytes, got {raw.size}")
    raw = np.ascontiguousarray(raw).reshape(-1)
    if t == F32:
        return raw.view("<f4").astype(np.float32).reshape(rows, cols)
    if t == F16:
        return raw.view("<f2").astype(np.float32).reshape(rows, cols)
    if t == BF16:
        return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(rows, cols)
    if t not in (Q4_0, Q4_1, Q8_0):
        import gguf.quants

        with np.errstate(invalid="ignore", over="ignore"):
            w = gguf.quants.dequantize(raw.reshape(rows, rb), gguf.GGMLQuantizationType(t))
        return np.asarray(w, dtype=np.float32).reshape(rows, cols)
    blocks = raw.reshape(-1, _BLOCK_BYTES[t])
    d = _fp16_from_bytes(blocks[:, :2])
    if t == Q4_0:
        q = _unpack_nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
        w = d * q.astype(np.float32)
    elif t == Q4_1:
        m = _fp16_from_bytes(blocks[:, 2:4])
        # Two float32 roundings (multiply, then add), the way ggml's scalar code and the gguf package compute it.
        w = d * _unpack_nibbles(blocks[:, 4:]).astype(np.float32) + m
    else:
        w = d * blocks[:, 2:].view(np.int8).astype(np.float32)
    return w.reshape(rows, cols)
