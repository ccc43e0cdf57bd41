"""Finding non-finite weights in a GGUF file without dequantizing it.

A quantized block's weights are its fp16 scale (and fp16 min) times small integers, and every product and sum the
dequantizers form from finite scales is finite in float32 (at most 65504 * 127 * 32 for the largest codes), while a
non-finite scale makes every weight of its block inf or NaN (inf * 0 is NaN). So a block holds a non-finite weight
exactly when one of its fp16 fields has all exponent bits set; F16 / BF16 / F32 elements are checked the same way.
That reads 2-4 bytes of each block (the Qwen2.5-0.5B file's 400 MB in well under a second) instead of
dequantizing 500M weights; tests/python/test_reliability.py checks the equivalence against full dequantization on
random blocks of every type. The first tensor flagged is then dequantized row by row to name the element.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import numpy as np

from . import quants
from .errors import NonFiniteWeightsError

# Byte offsets of the fp16 fields (scale d, min m / dmin) inside one block (cpp/include/metalattn/quant.h).
FP16_FIELDS = {quants.Q4_0: (0,), quants.Q4_1: (0, 2), quants.Q5_0: (0,), quants.Q5_1: (0, 2), quants.Q8_0: (0,),
               quants.Q2_K: (80, 82), quants.Q3_K: (108,), quants.Q4_K: (0, 2), quants.Q5_K: (0, 2),
               quants.Q6_K: (208,)}
# (element dtype, exponent mask) of the float types.
_FLOAT_BITS = {quants.F32: ("<u4", 0x7F800000), quants.F16: ("<u2", 0x7C00), quants.BF16: ("<u2", 0x7F80)}
_FP16_EXP = np.uint16(0x7C00)
_SLAB = 1 << 22  # blocks or elements per step: bounded temporaries on big tensors


def nonfinite_blocks(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """bool per block (quantized types) or element (float types) of the uint8 bytes `raw`: holds a NaN or inf."""
    t = int(ggml_type)
    flat = np.asarray(raw).reshape(-1)
    if t in _FLOAT_BITS:
        dtype, mask = _FLOAT_BITS[t]
        values = flat.view(dtype)
        m = values.dtype.type(mask)
        return (values & m) == m
    size = quants._BLOCK_BYTES[t]
    blocks = flat.reshape(-1, size)
    bad = np.zeros(blocks.shape[0], dtype=bool)
    for off in FP16_FIELDS[t]:
        # One strided pass per field: bytes off, off+1 of every block as a little-endian uint16.
        lo = blocks[:, off].astype(np.uint16)
        hi = blocks[:, off + 1].astype(np.uint16)
        bad |= ((lo | (hi << np.uint16(8))) & _FP16_EXP) == _FP16_EXP
    return bad


def first_nonfinite(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> Optional[Tuple[int, int, float]]:
    """(row, col, value) of the first non-finite weight of a [rows, cols] tensor in its file bytes, or None."""
    t = int(ggml_type)
    flat = np.asarray(raw).reshape(-1)
    per = quants.block_elems(t)  # weights per block (1 for float types)
    unit = quants._BLOCK_BYTES.get(t, None) or quants._ELEMENT_BYTES[t]
    n_units = flat.size // unit
    for start in range(0, n_units, _SLAB):
        bad = nonfinite_blocks(flat[start * unit:min(n_units, start + _SLAB) * unit], t)
        if bad.any():
            unit_index = start + int(np.argmax(bad))
            row = unit_index * per // cols
            rb = quants.row_bytes(t, cols)
            values = quants.dequantize(flat[row * rb:(row + 1) * rb], t, 1, cols)[0]
            bad_cols = np.flatnonzero(~np.isfinite(values))
            col = int(bad_cols[0]) if bad_cols.size else (unit_index * per) % cols
            return row, col, float(values[col])
    return None


def tensor_shape(shape: Tuple[int, ...]) -> Tuple[int, int]:
    """(rows, cols) of a row-major shape: the last dimension is the row."""
    cols = int(shape[-1]) if shape else 1
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return rows, cols


def check_tensors(model, progress: bool = False) -> int:
    """Scans every tensor of a loaded GGUFModel of a type metalattn reads, in file order; raises
    NonFiniteWeightsError naming the first one holding NaN or infinity (and the element). Returns the number of
    tensors scanned."""
    from .gguf_model import _row_major_shape

    reader = model._reader
    entries: Iterable = reader.tensors
    if progress:
        from tqdm import tqdm

        entries = tqdm(list(entries), desc="checking tensors", unit="tensor", leave=False)
    scanned = 0
    for info in entries:
        t = int(info.tensor_type)
        if t not in quants.TYPE_NAMES:
            continue  # types metalattn does not read are reported by load_gguf when a model needs them
        start, n_bytes = int(info.data_offset), int(info.n_bytes)
        raw = np.asarray(reader.data[start:start + n_bytes])
        rows, cols = tensor_shape(_row_major_shape(info.shape))
        found = first_nonfinite(raw, t, rows, cols)
        scanned += 1
        if found is not None:
            row, col, value = found
            where = f"row {row}, column {col}" if rows > 1 else f"element {col}"
            raise NonFiniteWeightsError(
                f"{model.path}: tensor {info.name!r} ({quants.type_name(t)} [{rows} x {cols}]) holds a non-finite "
                f"weight: {value} at {where}; the file is corrupt or was written from a diverged model")
    return scanned
