"""GGUF weight formats in vectorised numpy: quantize and dequantize whole matrices.

The block layouts are the ones in cpp/include/metalattn/quant.h (GGUF's own). Legacy types hold 32 weights a block:
Q4_0 = fp16 d + 16 bytes of nibbles (weight j in the low nibble of byte j, weight j+16 in the high nibble), Q4_1
adds an fp16 min after d, Q5_0 / Q5_1 add 4 bytes of fifth bits, Q8_0 = fp16 d + 32 int8. The K-quants (Q2_K ..
Q6_K) hold 256-weight super-blocks of 16- or 32-weight sub-blocks with 4..8-bit scales. All scalars little-endian.

Every type is decoded here in vectorised numpy, with ggml's float32 operations in ggml's order (a product, then a
sum, each rounded once), so the values equal the gguf package's and the C++ reference's bit for bit
(tests/python/test_quants.py checks both). Our quantizers for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 reproduce ggml's
reference (non-SIMD) quantizers bit for bit: same float32 arithmetic in the same order, same truncation/rounding,
so a file quantized here equals one quantized by llama.cpp. The K-quant quantizers (Q4_K, Q5_K, Q6_K) are simple
(per sub-block min/max fitting, no search): valid files for tests and synthetic models, not llama.cpp's output.
Q2_K and Q3_K are read, not written.
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


def _q5_high_bits(q: np.ndarray) -> np.ndarray:
    """uint8 codes [n, 32] (0..31) -> [n, 4]: bit j of the little-endian uint32 is bit 4 of code j."""
    return np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=1, bitorder="little")


def _quantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    # As Q4_0 with 32 levels: d = (signed value of largest magnitude) / -16, code = min(31, (int)(x*id + 16.5f)).
    n = blocks.shape[0]
    signed_max = blocks[np.arange(n), np.abs(blocks).argmax(axis=1)]
    d = signed_max / np.float32(-16.0)
    inv = _safe_reciprocal(d)
    q = np.minimum(np.trunc(blocks * inv[:, None] + np.float32(16.5)), 31).astype(np.uint8)
    out = np.empty((n, 22), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:6] = _q5_high_bits(q)
    out[:, 6:] = _pack_nibbles(q & np.uint8(0x0F))
    return out


def _quantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    # As Q4_1 with 32 levels; ggml truncates (x - min)*id + 0.5f without a clamp (it cannot pass 31.5).
    n = blocks.shape[0]
    lo = blocks.min(axis=1)
    d = (blocks.max(axis=1) - lo) / np.float32(31.0)
    inv = _safe_reciprocal(d)
    q = np.minimum(np.trunc((blocks - lo[:, None]) * inv[:, None] + np.float32(0.5)), 31).astype(np.uint8)
    out = np.empty((n, 24), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:4] = _fp16_bytes(lo)
    out[:, 4:8] = _q5_high_bits(q)
    out[:, 8:] = _pack_nibbles(q & np.uint8(0x0F))
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
    quantizers = {Q4_0: _quantize_q4_0, Q4_1: _quantize_q4_1, Q8_0: _quantize_q8_0, Q5_0: _quantize_q5_0,
                  Q5_1: _quantize_q5_1, Q4_K: lambda b: _quantize_q45_k(b, 4),
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


# ---------------------------------------------------------------- dequantizers, one per block type
# Each takes uint8 blocks [n, block_bytes] and returns float32 weights [n, block_elems], rounding as ggml does.


def _half(b: np.ndarray) -> np.ndarray:
    """uint8 [n, 2] -> float32 [n, 1]."""
    return _fp16_from_bytes(b)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: qh [n, 4], qs [n, 16] -> codes [n, 32] (0..31): the nibble plus bit j of qh as bit 4."""
    high = np.unpackbits(qh, axis=1, bitorder="little")          # [n, 32]: bit j of the uint32
    return _unpack_nibbles(qs) | (high << np.uint8(4))


def _dequantize_q4_0(b):
    return _half(b[:, :2]) * (_unpack_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)


def _dequantize_q4_1(b):
    # Two float32 roundings (multiply, then add), the way ggml's scalar code computes it.
    return _half(b[:, :2]) * _unpack_nibbles(b[:, 4:]).astype(np.float32) + _half(b[:, 2:4])


def _dequantize_q5_0(b):
    return _half(b[:, :2]) * (_q5_codes(b[:, 2:6], b[:, 6:]).astype(np.int8) - np.int8(16)).astype(np.float32)


def _dequantize_q5_1(b):
    return _half(b[:, :2]) * _q5_codes(b[:, 4:8], b[:, 8:]).astype(np.float32) + _half(b[:, 2:4])


def _dequantize_q8_0(b):
    return _half(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K / Q5_K [n, 12] -> 6-bit scales and mins [n, 8] (layout in quant.h)."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _two_bit_fields(v: np.ndarray) -> np.ndarray:
    """[n, h, 32] bytes -> [n, h, 4, 32]: field f = bits 2f, 2f+1 (Q2_K / Q3_K / Q6_K pack 2-bit fields this way)."""
    return (v[:, :, None, :] >> (np.arange(4, dtype=np.uint8) * 2)[None, None, :, None]) & np.uint8(3)


def _dequantize_q45_k(b, five: bool):
    # Sub-block j (weights 32j .. 32j+31): d*sc[j] and dmin*m[j] rounded first, then d*sc*q - dmin*m.
    n = b.shape[0]
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    qs = b[:, 48:176] if five else b[:, 16:144]
    # qs[32c + l]: low nibble = weight l of sub-block 2c, high nibble = weight l of sub-block 2c + 1.
    q = np.stack([qs.reshape(n, 4, 32) & np.uint8(0x0F), qs.reshape(n, 4, 32) >> np.uint8(4)], axis=2).reshape(n, 8, 32)
    if five:  # bit j of qh[l] is bit 4 of weight l of sub-block j
        q = q | (((b[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & np.uint8(1)).transpose(0, 2, 1) << np.uint8(4))
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * mn.astype(np.float32))[:, :, None]
    return (dl * q.astype(np.float32) - ml).reshape(n, QK_K)


def _dequantize_q6_k(b):
    # Weight 128h + 32f + l: 4 low bits in ql[64h + 32(f % 2) + l] (low nibble for f < 2, high for f >= 2), 2 high
    # bits in field f of qh[32h + l]; value q - 32 times d * scales[i / 16], d * scale rounded first.
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)                                      # [n, h, f % 2, l]
    low = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=2)     # [n, h, f, l]
    high = _two_bit_fields(b[:, 128:192].reshape(n, 2, 32))                    # [n, h, f, l]
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 16, 16)
    scale = _half(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    return (scale[:, :, None] * q).reshape(n, QK_K)


def _dequantize_q3_k(b):
    # 16 sub-blocks of 16; 6-bit scales (low 4 bits: nibble s % 8 of byte s % 8 (low nibble for s < 8), high 2 bits:
    # field s / 4 of byte 8 + s % 4), stored + 32. Weight 128h + 32f + l: 2 bits = field f of qs[32h + l], minus 4
    # unless bit 4h + f of hmask[l] is set.
    n = b.shape[0]
    hmask, qs, packed, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _half(b[:, 108:110])
    low = np.concatenate([packed[:, 0:8] & np.uint8(0x0F), packed[:, 0:8] >> np.uint8(4)], axis=1)  # [n, 16]
    high = _two_bit_fields(packed[:, None, 8:12])[:, 0].reshape(n, 16)         # field s // 4 of byte 8 + s % 4
    sc = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    bits = _two_bit_fields(qs.reshape(n, 2, 32))                               # [n, h, f, l]
    hbit = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)  # [n, 4h + f, l]
    q = (bits.reshape(n, 8, 32).astype(np.int8) - ((hbit ^ np.uint8(1)) << np.uint8(2)).astype(np.int8))
    dl = d * sc.astype(np.float32)                                            # [n, 16]
    return (dl[:, :, None] * q.astype(np.float32).reshape(n, 16, 16)).reshape(n, QK_K)


def _dequantize_q2_k(b):
    # 16 sub-blocks of 16: scales[s] low nibble = scale, high nibble = min; weight 128h + 32f + l = field f of
    # qs[32h + l]; d*sc and dmin*m rounded first, then d*sc*q - dmin*m.
    n = b.shape[0]
    scales, qs, d, dmin = b[:, 0:16], b[:, 16:80], _half(b[:, 80:82]), _half(b[:, 82:84])
    dl = (d * (scales & np.uint8(0x0F)).astype(np.float32))[:, :, None]
    ml = (dmin * (scales >> np.uint8(4)).astype(np.float32))[:, :, None]
    q = _two_bit_fields(qs.reshape(n, 2, 32)).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


_DEQUANTIZERS = {Q4_0: _dequantize_q4_0, Q4_1: _dequantize_q4_1, Q5_0: _dequantize_q5_0, Q5_1: _dequantize_q5_1,
                 Q8_0: _dequantize_q8_0, Q2_K: _dequantize_q2_k, Q3_K: _dequantize_q3_k,
                 Q4_K: lambda b: _dequantize_q45_k(b, five=False), Q5_K: lambda b: _dequantize_q45_k(b, five=True),
                 Q6_K: _dequantize_q6_k}


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
    blocks = raw.reshape(-1, _BLOCK_BYTES[t])
    out = np.empty((blocks.shape[0], block_elems(t)), np.float32)
    # Slabs keep the integer/float temporaries small for big matrices (token_embd is 28M+ weights). Non-finite
    # scales (random bytes in tests) give inf/nan weights exactly as in ggml; numpy need not warn about them.
    slab = 1 << 16 if block_elems(t) == BLOCK else 1 << 13
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, blocks.shape[0], slab):
            out[start:start + slab] = _DEQUANTIZERS[t](blocks[start:start + slab])
    return out.reshape(rows, cols)
