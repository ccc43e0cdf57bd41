"""Re-quantize a Llama GGUF file (`metalattn quantize`): every key copied, the weight matrices converted.

Layout written for the 4- and 5-bit targets: layer matrices in the target type, token_embd (and an untied output) in
Q8_0, the layout our benchmarks use (the embedding/lm_head is the most quantization-sensitive matrix).
1-D tensors (norm weights) are always F32.
"""
from __future__ import annotations

import os

import numpy as np

from . import quants
from .errors import GGUFError
from .gguf_model import _row_major_shape, load_gguf

TARGETS = {"q4_0": quants.Q4_0, "q4_1": quants.Q4_1, "q5_0": quants.Q5_0, "q5_1": quants.Q5_1, "q8_0": quants.Q8_0,
           "f16": quants.F16}
# general.file_type values (gguf.LlamaFileType) of each target.
FILE_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q8_0": 7, "f16": 1}
EMBEDDING_TENSORS = ("token_embd.weight", "output.weight")


def output_type(name: str, target: str) -> int:
    """The ggml type a 2-D tensor called `name` gets when converting to `target`."""
    if name in EMBEDDING_TENSORS and target in ("q4_0", "q4_1", "q5_0", "q5_1"):
        return quants.Q8_0
    return TARGETS[target]


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def _copy_metadata(reader, writer, path: str, overrides: dict) -> None:
    """Copy every key with its stored type; keys in `overrides` (key -> (value, type)) keep their place but get
    the new value; overrides the source lacks are appended."""
    import gguf

    VT = gguf.GGUFValueType
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # written by GGUFWriter itself
            continue
        if key == "general.alignment":
            writer.add_custom_alignment(int(f.contents()))
            continue
        if key in overrides:
            writer.add_key_value(key, *overrides[key])
            continue
        main_type = f.types[0]
        if main_type == VT.ARRAY:
            if len(f.types) != 2:  # arrays of arrays: no Llama key uses them
                raise GGUFError(f"{path}: metadata key {key!r} is a nested array, which cannot be copied")
            value = f.contents()
            if not value:
                continue  # GGUFWriter refuses empty arrays
            writer.add_key_value(key, value, VT.ARRAY, f.types[1])
        else:
            writer.add_key_value(key, f.contents(), main_type)
    for key, (value, vtype) in overrides.items():
        if key not in reader.fields:
            writer.add_key_value(key, value, vtype)


def quantize_file(src, dst, target: str, progress: bool = True) -> str:
    """Write `dst`, a copy of the GGUF model `src` with its weight matrices converted to `target`
    ("q4_0", "q4_1", "q8_0" or "f16"). Matrices already in their output type are copied byte for byte
    (re-quantizing Q4 data would lose precision for nothing). Returns dst."""
    import gguf

    src, dst = os.fspath(src), os.fspath(dst)
    target = target.lower()
    if target not in TARGETS:
        raise ValueError(f"unknown quantization target {target!r}; choose one of {sorted(TARGETS)}")
    if _same_file(src, dst):
        raise GGUFError(f"{dst}: the output would overwrite the input model {src}")
    model = load_gguf(src)  # validates src: raises GGUFError / UnsupportedModelError
    reader = model._reader

    writer = gguf.GGUFWriter(dst, "llama")
    try:
        uint32 = gguf.GGUFValueType.UINT32
        _copy_metadata(reader, writer, src, {"general.file_type": (FILE_TYPES[target], uint32),
                                             "general.quantization_version": (2, uint32)})

        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(reader.tensors), desc=f"quantize {target}", unit="tensor")
        for info in reader.tensors:
            name, src_type = info.name, int(info.tensor_type)
            shape = _row_major_shape(info.shape)
            start, n_bytes = int(info.data_offset), int(info.n_bytes)
            raw = np.asarray(reader.data[start:start + n_bytes])
            if src_type not in quants.SUPPORTED_TYPES:
                # Only tensors the model does not use can get here (load_gguf checked the rest): keep them as they are.
                # info.data is the reader's view: byte rows for block types, elements (I32, F64, ...) otherwise.
                writer.add_tensor(name, info.data, raw_dtype=info.tensor_type if info.data.dtype == np.uint8 else None)
            elif len(shape) == 1:
                values = quants.dequantize(raw, src_type, 1, shape[0]).reshape(shape)
                writer.add_tensor(name, values)
            else:
                cols = shape[-1]
                rows = int(np.prod(shape[:-1]))
                dst_type = output_type(name, target)
                if dst_type == src_type:
                    data = raw.reshape(rows, quants.row_bytes(src_type, cols))
                else:
                    data = quants.quantize(quants.dequantize(raw, src_type, rows, cols), dst_type)
                writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(dst_type))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        if os.path.exists(dst):
            os.remove(dst)
        raise
    writer.close()
    return dst
