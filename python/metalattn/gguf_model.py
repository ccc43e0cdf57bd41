"""Load a Llama-family GGUF file: hyperparameters, metadata, and zero-copy views of the weights on the mmap.

`load_gguf(path)` validates everything the engine relies on (architecture, keys, tensor presence, shapes, types and
byte ranges) and raises GGUFError / UnsupportedModelError naming the file and the offending key or tensor, so the C++
core never sees a malformed model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import quants
from .errors import GGUFError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_NORMS = ("attn_norm", "ffn_norm")
NORM_TYPES = (quants.F32, quants.F16, quants.BF16)  # 1-D tensors are read into float32


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass
class WeightTensor:
    """One weight. 2-D matrices: `data` is a read-only uint8 [rows, row_bytes] view on the file's mmap (no copy).
    1-D norm weights: rows == 1 and `data` is float32 [cols] (a view when stored F32, converted otherwise)."""
    name: str
    ggml_type: int
    rows: int
    cols: int
    data: np.ndarray

    @property
    def type_name(self) -> str:
        return quants.type_name(self.ggml_type)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols] (1-D weights: [cols])."""
        if self.data.ndim == 1:
            return self.data.astype(np.float32)
        return quants.dequantize(self.data, self.ggml_type, self.rows, self.cols)


@dataclass
class GGUFModel:
    path: str
    config: ModelConfig
    tensors: Dict[str, WeightTensor]
    metadata: Dict[str, Any]
    tied_output: bool
    file_type_name: str
    version: int = 3
    _reader: Any = field(default=None, repr=False)
    _all_tensors: List[Tuple[str, str, Tuple[int, ...], int]] = field(default_factory=list, repr=False)
    _dequant_cache: Dict[Any, np.ndarray] = field(default_factory=dict, repr=False)

    def tensor_table(self) -> List[Tuple[str, str, Tuple[int, ...], int]]:
        """Every tensor in the file, in file order: (name, type name, shape in row-major order (rows, cols), bytes)."""
        return list(self._all_tensors)

    def layer(self, index: int, part: str) -> WeightTensor:
        """tensors['blk.{index}.{part}.weight'], e.g. model.layer(0, 'attn_q')."""
        return self.tensors[f"blk.{index}.{part}.weight"]

    def dequantized(self, name: str) -> np.ndarray:
        """float32 copy of a weight, cached on this object (the float64 reference and tests reuse it)."""
        tensor = self.tensors[name]
        key = tensor.name  # 'output.weight' of a tied model shares token_embd's entry
        if key not in self._dequant_cache:
            arr = tensor.dequantize()
            arr.flags.writeable = False
            self._dequant_cache[key] = arr
        return self._dequant_cache[key]

    @property
    def tokenizer_metadata(self) -> Dict[str, Any]:
        return {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}


def _field_value(f) -> Any:
    value = f.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _read_metadata(reader, path: str) -> Dict[str, Any]:
    metadata = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's pseudo-fields for the header counts, not stored keys
            continue
        try:
            metadata[key] = _field_value(f)
        except Exception as e:  # bad UTF-8, unknown nested array types, ...
            raise GGUFError(f"{path}: metadata key {key!r} is corrupt: {type(e).__name__}: {e}") from e
    return metadata


def _require(metadata: Dict[str, Any], key: str, path: str, kind, what: str):
    if key not in metadata:
        raise GGUFError(f"{path}: missing metadata key {key!r} ({what})")
    value = metadata[key]
    try:
        if isinstance(value, (bool, str, list)):
            raise ValueError
        if kind is int:
            if int(value) != value:
                raise ValueError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise GGUFError(f"{path}: metadata key {key!r} should be {kind.__name__} ({what}), got {value!r}") from None


def _read_config(metadata: Dict[str, Any], path: str, embd_rows: Optional[int]) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{path}: missing metadata key 'general.architecture'")
    if arch != "llama":
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported (general.architecture must be 'llama')")

    n_layers = _require(metadata, "llama.block_count", path, int, "number of layers")
    d_model = _require(metadata, "llama.embedding_length", path, int, "model width")
    d_ff = _require(metadata, "llama.feed_forward_length", path, int, "FFN width")
    n_heads = _require(metadata, "llama.attention.head_count", path, int, "attention heads")
    n_kv_heads = n_heads
    if "llama.attention.head_count_kv" in metadata:
        n_kv_heads = _require(metadata, "llama.attention.head_count_kv", path, int, "KV heads")
    n_ctx = _require(metadata, "llama.context_length", path, int, "training context length")
    rope_base = 10000.0
    if "llama.rope.freq_base" in metadata:
        rope_base = _require(metadata, "llama.rope.freq_base", path, float, "RoPE base")
    rms_eps = _require(metadata, "llama.attention.layer_norm_rms_epsilon", path, float, "RMSNorm epsilon")

    for key, value in (("llama.block_count", n_layers), ("llama.embedding_length", d_model),
                       ("llama.feed_forward_length", d_ff), ("llama.attention.head_count", n_heads),
                       ("llama.attention.head_count_kv", n_kv_heads), ("llama.context_length", n_ctx)):
        if value <= 0:
            raise GGUFError(f"{path}: metadata key {key!r} must be positive, got {value}")
    if d_model % n_heads:
        raise UnsupportedModelError(
            f"{path}: llama.embedding_length {d_model} is not a multiple of llama.attention.head_count {n_heads}")
    if n_heads % n_kv_heads:
        raise GGUFError(f"{path}: llama.attention.head_count {n_heads} is not a multiple of "
                        f"llama.attention.head_count_kv {n_kv_heads}")
    head_dim = d_model // n_heads
    for key in ("llama.attention.key_length", "llama.attention.value_length"):
        if key in metadata and _require(metadata, key, path, int, "head size") != head_dim:
            raise UnsupportedModelError(f"{path}: {key} = {metadata[key]} differs from "
                                        f"embedding_length / head_count = {head_dim}; only that head size is supported")
    if "llama.rope.dimension_count" in metadata:
        rope_dims = _require(metadata, "llama.rope.dimension_count", path, int, "rotary dimensions")
        if rope_dims != head_dim:
            raise UnsupportedModelError(f"{path}: llama.rope.dimension_count = {rope_dims} but head_dim = {head_dim}; "
                                        "partial RoPE is not supported")
    scaling = metadata.get("llama.rope.scaling.type")
    if scaling not in (None, "none") and not (scaling == "linear" and
                                              float(metadata.get("llama.rope.scaling.factor", 1.0)) == 1.0):
        raise UnsupportedModelError(f"{path}: llama.rope.scaling.type = {scaling!r} is not supported")

    if "llama.vocab_size" in metadata:
        vocab = _require(metadata, "llama.vocab_size", path, int, "vocabulary size")
    elif isinstance(metadata.get("tokenizer.ggml.tokens"), list):
        vocab = len(metadata["tokenizer.ggml.tokens"])
    elif embd_rows is not None:
        vocab = embd_rows
    else:
        raise GGUFError(f"{path}: cannot tell the vocabulary size: no 'llama.vocab_size', no "
                        "'tokenizer.ggml.tokens' and no 'token_embd.weight'")
    return ModelConfig(n_layers=n_layers, d_model=d_model, d_ff=d_ff, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, vocab_size=vocab, n_ctx_train=n_ctx, rope_base=rope_base, rms_eps=rms_eps)


def _expected_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """name -> (rows, cols) for matrices, (n,) for norm vectors."""
    d, q, kv, ff = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff
    shapes: Dict[str, Tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    per_layer = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
                 "ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
    for layer in range(cfg.n_layers):
        for part, shape in per_layer.items():
            shapes[f"blk.{layer}.{part}.weight"] = shape
    return shapes


def _fmt_shape(shape) -> str:
    return "[" + " x ".join(str(int(s)) for s in shape) + "]"


def _row_major_shape(ne) -> Tuple[int, ...]:
    """GGUF stores ne innermost first; trailing size-1 dimensions carry no meaning."""
    dims = [int(x) for x in ne]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(reversed(dims))


class _TruncatedTensor(Exception):
    def __init__(self, name: str, start: int, end: int):
        super().__init__(name)
        self.name, self.start, self.end = name, start, end


def _make_reader_class(gguf):
    """GGUFReader that names the first tensor running past the end of the file (the stock reader fails on such a
    file with a bare reshape error, because it builds every tensor's array while parsing), and that parses through
    a plain ndarray view of its memory map."""

    class Reader(gguf.GGUFReader):
        # The reader slices its np.memmap once per metadata element (~250k slices for a 49k-token vocabulary);
        # each memmap slice pays for the subclass's __getitem__/__array_finalize__, which was over half of the load
        # time. A plain ndarray view of the same map reads the same bytes, and the views it hands out (tensor data
        # included) still share the mapped memory and keep the map alive.
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, mapped):
            self._mapped = mapped
            self._plain_data = mapped.view(np.ndarray)

        def _build_tensors(self, start_offs, fields):
            try:
                for f in fields:
                    # parts: name length, name bytes, n_dims, dims, type, offset (the reader's tensor-info layout)
                    name = bytes(f.parts[1]).decode("utf-8", "replace")
                    qtype = gguf.GGMLQuantizationType(int(f.parts[4][0]))
                    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                    n_bytes = int(np.prod([int(x) for x in f.parts[3]])) * type_size // block
                    start = int(start_offs) + int(f.parts[5][0])
                    if start + n_bytes > len(self.data):
                        raise _TruncatedTensor(name, start, start + n_bytes)
            except _TruncatedTensor:
                raise
            except Exception:
                pass  # layout not as expected (another gguf version?): let the stock code decide
            super()._build_tensors(start_offs, fields)

    return Reader


def _open_reader(path: str):
    import gguf  # deferred: importing gguf costs ~0.1 s and is only needed here

    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot open: {e.strerror or e}") from e
    if size < 24:  # magic + version + tensor count + kv count
        raise GGUFError(f"{path}: not a GGUF file ({size} bytes, too short for a GGUF header)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _make_reader_class(gguf)(path, "r")
    except _TruncatedTensor as e:
        raise GGUFError(f"{path}: truncated file: tensor {e.name!r} needs bytes [{e.start}, {e.end}) "
                        f"but the file has only {size} bytes") from None
    except Exception as e:  # the reader raises whatever numpy/struct/enum raise on short or garbled headers
        raise GGUFError(f"{path}: corrupt or truncated GGUF header "
                        f"(file is {size} bytes): {type(e).__name__}: {e}") from e
    return reader, size


def load_gguf(path) -> GGUFModel:
    """Open `path` memory-mapped and validate it as a Llama model metalattn can run."""
    path = os.fspath(path)
    reader, file_size = _open_reader(path)
    metadata = _read_metadata(reader, path)

    try:
        infos = {t.name: t for t in reader.tensors}
    except Exception as e:
        raise GGUFError(f"{path}: corrupt tensor table: {type(e).__name__}: {e}") from e

    # Byte ranges first: a truncated file can still parse (the reader silently returns short arrays).
    all_tensors = []
    for t in reader.tensors:
        start, n_bytes = int(t.data_offset), int(t.n_bytes)
        if start + n_bytes > file_size:
            raise GGUFError(f"{path}: truncated file: tensor {t.name!r} needs bytes [{start}, {start + n_bytes}) "
                            f"but the file has only {file_size} bytes")
        all_tensors.append((t.name, t.tensor_type.name, _row_major_shape(t.shape), n_bytes))

    embd = infos.get("token_embd.weight")
    embd_rows = _row_major_shape(embd.shape)[0] if embd is not None and len(embd.shape) == 2 else None
    config = _read_config(metadata, path, embd_rows)
    if "rope_freqs.weight" in infos:
        raise UnsupportedModelError(f"{path}: tensor 'rope_freqs.weight' (per-frequency RoPE scaling, Llama 3.1 "
                                    "style) is not supported")

    expected = _expected_shapes(config)
    tied = "output.weight" not in infos
    if not tied:
        expected["output.weight"] = (config.vocab_size, config.d_model)

    supported = ", ".join(quants.TYPE_NAMES.values())
    tensors: Dict[str, WeightTensor] = {}
    for name, shape in expected.items():
        info = infos.get(name)
        if info is None:
            raise GGUFError(f"{path}: missing tensor {name!r} (expected shape {_fmt_shape(shape)})")
        actual = _row_major_shape(info.shape)
        if actual != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {_fmt_shape(actual)}, expected {_fmt_shape(shape)} "
                            f"(rows x cols, from the model's metadata)")
        ggml_type = int(info.tensor_type)
        if len(shape) == 1:
            if ggml_type not in NORM_TYPES:
                raise UnsupportedModelError(
                    f"{path}: tensor {name!r} has type {info.tensor_type.name}; 1-D weights must be F32, F16 or BF16")
        elif ggml_type not in quants.SUPPORTED_TYPES:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has type {info.tensor_type.name}, which metalattn "
                                        f"does not run; supported types: {supported}")
        tensors[name] = _make_weight(reader, info, name, shape, ggml_type)

    if tied:
        tensors["output.weight"] = tensors["token_embd.weight"]

    return GGUFModel(path=path, config=config, tensors=tensors, metadata=metadata, tied_output=tied,
                     file_type_name=_file_type_name(metadata, tensors),
                     version=int(reader.fields["GGUF.version"].parts[0][0]),
                     _reader=reader, _all_tensors=all_tensors)


def _make_weight(reader, info, name: str, shape: Tuple[int, ...], ggml_type: int) -> WeightTensor:
    start, n_bytes = int(info.data_offset), int(info.n_bytes)
    raw = np.asarray(reader.data[start:start + n_bytes])  # plain ndarray view on the memmap
    if len(shape) == 1:
        (n,) = shape
        if ggml_type == quants.F32:
            values = raw.view("<f4")
        else:
            values = quants.dequantize(raw, ggml_type, 1, n).reshape(n)
        return WeightTensor(name=name, ggml_type=ggml_type, rows=1, cols=n, data=values)
    rows, cols = shape
    return WeightTensor(name=name, ggml_type=ggml_type, rows=rows, cols=cols,
                        data=raw.reshape(rows, quants.row_bytes(ggml_type, cols)))


def _file_type_name(metadata: Dict[str, Any], tensors: Dict[str, WeightTensor]) -> str:
    ftype = metadata.get("general.file_type")
    if ftype is not None:
        try:
            import gguf

            return gguf.LlamaFileType(int(ftype)).name.replace("MOSTLY_", "")
        except (ValueError, TypeError):
            return f"file_type {ftype}"
    # No declared file type: name the type most of the layer matrices use.
    counts: Dict[str, int] = {}
    for t in tensors.values():
        if t.data.ndim == 2:
            counts[t.type_name] = counts.get(t.type_name, 0) + t.rows * t.cols
    return max(counts, key=counts.get) if counts else "unknown"
