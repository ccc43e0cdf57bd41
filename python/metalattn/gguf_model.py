"""Load a Llama-family GGUF file: hyperparameters, metadata, and zero-copy views of the weights on the mmap.

`load_gguf(path)` validates everything the engine relies on (architecture, keys, tensor presence, shapes, types and
byte ranges) and raises GGUFError / UnsupportedModelError naming the file and the offending key or tensor, so the C++
core never sees a malformed model.
"""
from __future__ import annotations

import math
import os
import stat
import sys
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
class Architecture:
    """What one `general.architecture` adds to the plain Llama layer. Both backends read the resulting ModelConfig
    (as the C++ ModelSpec), so a new architecture is one entry here, not branches in the kernels."""
    rope_style: str = "interleaved"   # "interleaved": pairs (2i, 2i+1), llama's GGUF layout; "neox": (i, i + d/2)
    activation: str = "silu"          # gated FFN activation: "silu" or "gelu_tanh"
    attn_bias: bool = False           # attn_q/k/v.bias tensors
    qk_norm: bool = False             # attn_q_norm / attn_k_norm: RMSNorm over each head before RoPE
    post_norms: bool = False          # post_attention_norm / post_ffw_norm before each residual add
    embed_scale_sqrt_d: bool = False  # token embeddings multiplied by sqrt(d_model)
    swa_pattern: int = 0              # with a sliding window: every swa_pattern-th layer is global, the rest windowed
    swa_rope_base: float = 10000.0    # RoPE base of the windowed layers unless the file states one


ARCHITECTURES: Dict[str, Architecture] = {
    "llama": Architecture(),
    "qwen2": Architecture(rope_style="neox", attn_bias=True),
    "qwen3": Architecture(rope_style="neox", qk_norm=True),
    "gemma3": Architecture(rope_style="neox", activation="gelu_tanh", qk_norm=True, post_norms=True,
                           embed_scale_sqrt_d=True, swa_pattern=6),
}
ROPE_STYLES = {"interleaved": 0, "neox": 1}     # metalattn::RopeStyle
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}       # metalattn::Activation


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
    arch: str = "llama"
    rope_style: str = "interleaved"
    activation: str = "silu"
    attn_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: float = 1.0
    attn_scale: float = 0.0   # 0: 1/sqrt(head_dim)
    # Per layer (rope_base, rope_scale, window); window 0 = full attention.
    layers: Tuple[Tuple[float, float, int], ...] = ()

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.attn_scale if self.attn_scale > 0 else 1.0 / float(np.sqrt(self.head_dim))

    def layer(self, index: int) -> Tuple[float, float, int]:
        """(rope_base, rope_scale, window) of one layer."""
        return self.layers[index] if self.layers else (self.rope_base, 1.0, 0)

    def engine_spec(self) -> Dict[str, Any]:
        """The keys the C++ Engine reads (metalattn::ModelSpec), less n_ctx."""
        return dict(n_layers=self.n_layers, d_model=self.d_model, d_ff=self.d_ff, n_heads=self.n_heads,
                    n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
                    rope_base=self.rope_base, rms_eps=self.rms_eps, rope_style=ROPE_STYLES[self.rope_style],
                    activation=ACTIVATIONS[self.activation], embed_scale=self.embed_scale,
                    attn_scale=self.attn_scale, attn_bias=self.attn_bias, qk_norm=self.qk_norm,
                    post_norms=self.post_norms, layers=[tuple(x) for x in self.layers] or None)


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

    def close(self) -> None:
        """Drops every view of the memory map (weights, the reader), so the file is unmapped once no caller holds
        one of its arrays."""
        self.tensors = {}
        self._dequant_cache.clear()
        self._reader = None

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
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        raise GGUFError(f"{path}: metadata key {key!r} should be {kind.__name__} ({what}), got {value!r}") from None


def _read_config(metadata: Dict[str, Any], path: str, embd_rows: Optional[int],
                 n_tensors: Optional[int] = None) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{path}: missing metadata key 'general.architecture'")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: metadata key 'general.architecture' should be a string, got {arch!r}"[:300])
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported (metalattn runs: {', '.join(sorted(ARCHITECTURES))})")
    spec = ARCHITECTURES[arch]

    def key(name: str) -> str:
        return f"{arch}.{name}"

    n_layers = _require(metadata, key("block_count"), path, int, "number of layers")
    d_model = _require(metadata, key("embedding_length"), path, int, "model width")
    d_ff = _require(metadata, key("feed_forward_length"), path, int, "FFN width")
    n_heads = _require(metadata, key("attention.head_count"), path, int, "attention heads")
    n_kv_heads = n_heads
    if key("attention.head_count_kv") in metadata:
        n_kv_heads = _require(metadata, key("attention.head_count_kv"), path, int, "KV heads")
    n_ctx = _require(metadata, key("context_length"), path, int, "training context length")
    rope_base = 10000.0
    if key("rope.freq_base") in metadata:
        rope_base = _require(metadata, key("rope.freq_base"), path, float, "RoPE base")
    rms_eps = _require(metadata, key("attention.layer_norm_rms_epsilon"), path, float, "RMSNorm epsilon")
    if not (math.isfinite(rope_base) and rope_base > 0):
        raise GGUFError(f"{path}: metadata key {key('rope.freq_base')!r} must be a positive number, got {rope_base}")
    if not (math.isfinite(rms_eps) and rms_eps >= 0):
        raise GGUFError(f"{path}: metadata key {key('attention.layer_norm_rms_epsilon')!r} must be a finite number "
                        f">= 0, got {rms_eps}")

    for k, value in ((key("block_count"), n_layers), (key("embedding_length"), d_model),
                     (key("feed_forward_length"), d_ff), (key("attention.head_count"), n_heads),
                     (key("attention.head_count_kv"), n_kv_heads), (key("context_length"), n_ctx)):
        if value <= 0:
            raise GGUFError(f"{path}: metadata key {k!r} must be positive, got {value}")
    # A layer count the tensor table cannot hold (every layer has 9 or more tensors) is corrupt, and is refused
    # before anything loops over the layers; a few layers too many are named by their first missing tensor below.
    if n_tensors is not None and n_layers > n_tensors:
        raise GGUFError(f"{path}: {key('block_count')} = {n_layers} layers, but the file holds only {n_tensors} "
                        "tensors")
    if n_heads % n_kv_heads:
        raise GGUFError(f"{path}: {key('attention.head_count')} {n_heads} is not a multiple of "
                        f"{key('attention.head_count_kv')} {n_kv_heads}")
    # The head size is stated (Gemma 3, Qwen 3: not d_model / heads) or implied.
    if key("attention.key_length") in metadata:
        head_dim = _require(metadata, key("attention.key_length"), path, int, "head size")
        if head_dim <= 0 or head_dim % 2:
            raise GGUFError(f"{path}: {key('attention.key_length')} must be positive and even, got {head_dim}")
    else:
        if d_model % n_heads:
            raise UnsupportedModelError(f"{path}: {key('embedding_length')} {d_model} is not a multiple of "
                                        f"{key('attention.head_count')} {n_heads} and no key_length is given")
        head_dim = d_model // n_heads
    if key("attention.value_length") in metadata and \
            _require(metadata, key("attention.value_length"), path, int, "value head size") != head_dim:
        raise UnsupportedModelError(f"{path}: {key('attention.value_length')} = "
                                    f"{metadata[key('attention.value_length')]} differs from the key head size "
                                    f"{head_dim}; only equal sizes are supported")
    if key("rope.dimension_count") in metadata:
        rope_dims = _require(metadata, key("rope.dimension_count"), path, int, "rotary dimensions")
        if rope_dims != head_dim:
            raise UnsupportedModelError(f"{path}: {key('rope.dimension_count')} = {rope_dims} but head_dim = "
                                        f"{head_dim}; partial RoPE is not supported")
    rope_scale = 1.0
    scaling = metadata.get(key("rope.scaling.type"))
    if scaling == "linear":
        factor = _require(metadata, key("rope.scaling.factor"), path, float, "linear RoPE scaling factor")
        if not (math.isfinite(factor) and factor > 0):
            raise GGUFError(f"{path}: {key('rope.scaling.factor')} must be positive, got {factor}")
        rope_scale = 1.0 / factor
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"{path}: {key('rope.scaling.type')} = {scaling!r} is not supported "
                                    "(none and linear are; Llama 3 scaling comes as the rope_freqs tensor)")
    softcap = metadata.get(key("final_logit_softcapping"))
    if softcap not in (None, 0, 0.0):
        raise UnsupportedModelError(f"{path}: {key('final_logit_softcapping')} = {softcap} is not supported")

    # Per-layer RoPE and attention window (Gemma 3: windowed layers with their own RoPE base beside global ones).
    window = 0
    if spec.swa_pattern and key("attention.sliding_window") in metadata:
        window = _require(metadata, key("attention.sliding_window"), path, int, "sliding window")
        if window < 0:
            raise GGUFError(f"{path}: {key('attention.sliding_window')} must be >= 0, got {window}")
    layers: Tuple[Tuple[float, float, int], ...] = ()
    if window > 0:
        pattern = metadata.get(key("attention.sliding_window_pattern"), spec.swa_pattern)
        if isinstance(pattern, list):
            if len(pattern) != n_layers:
                raise GGUFError(f"{path}: {key('attention.sliding_window_pattern')} has {len(pattern)} entries "
                                f"for {n_layers} layers")
            windowed = [bool(x) for x in pattern]
        else:
            n_pattern = _require(metadata, key("attention.sliding_window_pattern"), path, int,
                                 "sliding window pattern") if key("attention.sliding_window_pattern") in metadata \
                else int(pattern)
            windowed = [n_pattern == 0 or (i % n_pattern) < n_pattern - 1 for i in range(n_layers)]
        swa_base = spec.swa_rope_base
        if key("rope.freq_base_swa") in metadata:
            swa_base = _require(metadata, key("rope.freq_base_swa"), path, float, "RoPE base of windowed layers")
            if not (math.isfinite(swa_base) and swa_base > 0):
                raise GGUFError(f"{path}: metadata key {key('rope.freq_base_swa')!r} must be a positive number, "
                                f"got {swa_base}")
        layers = tuple((swa_base, 1.0, window) if w else (rope_base, rope_scale, 0) for w in windowed)
    elif rope_scale != 1.0:
        layers = tuple((rope_base, rope_scale, 0) for _ in range(n_layers))

    attn_scale = 0.0
    if arch == "gemma3" and n_layers == 62:  # Gemma 3 27B scales by its d_model / heads, not the head size
        attn_scale = 1.0 / float(np.sqrt(d_model / n_heads))

    if key("vocab_size") in metadata:
        vocab = _require(metadata, key("vocab_size"), path, int, "vocabulary size")
    elif isinstance(metadata.get("tokenizer.ggml.tokens"), list):
        vocab = len(metadata["tokenizer.ggml.tokens"])
    elif embd_rows is not None:
        vocab = embd_rows
    else:
        raise GGUFError(f"{path}: cannot tell the vocabulary size: no {key('vocab_size')!r}, no "
                        "'tokenizer.ggml.tokens' and no 'token_embd.weight'")
    return ModelConfig(n_layers=n_layers, d_model=d_model, d_ff=d_ff, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, vocab_size=vocab, n_ctx_train=n_ctx, rope_base=rope_base, rms_eps=rms_eps,
                       arch=arch, rope_style=spec.rope_style, activation=spec.activation, attn_bias=spec.attn_bias,
                       qk_norm=spec.qk_norm, post_norms=spec.post_norms,
                       embed_scale=float(np.sqrt(np.float32(d_model))) if spec.embed_scale_sqrt_d else 1.0,
                       attn_scale=attn_scale, layers=layers)


def _expected_shapes(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """name -> (rows, cols) for matrices, (n,) for vectors (norm weights, biases)."""
    d, q, kv, ff, hd = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff, cfg.head_dim
    shapes: Dict[str, Tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    per_layer = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
                 "ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
    if cfg.qk_norm:
        per_layer.update({"attn_q_norm": (hd,), "attn_k_norm": (hd,)})
    if cfg.post_norms:
        per_layer.update({"post_attention_norm": (d,), "post_ffw_norm": (d,)})
    for layer in range(cfg.n_layers):
        for part, shape in per_layer.items():
            shapes[f"blk.{layer}.{part}.weight"] = shape
        if cfg.attn_bias:
            for part, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                shapes[f"blk.{layer}.{part}.bias"] = (n,)
    return shapes


def _block_elems(ggml_type: int) -> int:
    """Weights per block of a ggml type (gguf's own table)."""
    import gguf

    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)][0])


def _fmt_shape(shape) -> str:
    return "[" + " x ".join(str(int(s)) for s in shape) + "]"


def _row_major_shape(ne) -> Tuple[int, ...]:
    """GGUF stores ne innermost first; trailing size-1 dimensions carry no meaning."""
    dims = [int(x) for x in ne]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(reversed(dims))


# Items of one metadata array: 16x the largest vocabulary of a real model (Gemma 3: 262,144 tokens); the gguf reader
# walks arrays item by item in Python (~2 us each), so this also bounds the time a corrupt count can cost.
MAX_METADATA_ARRAY = 1 << 22


class _ShortRead(Exception):
    pass


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

        def _get_field_parts(self, orig_offs, raw_type):
            # The stock reader slices past the end of the map without complaint and gets 0-byte items back, so a
            # count planted in a corrupt header would loop over "items" for as long as it says: an array's count is
            # checked against the bytes that could hold its items first (nested arrays at each level).
            if raw_type == 9:  # gguf.GGUFValueType.ARRAY (a plain int: this runs once per item of every array)
                item_type = int(self._get(orig_offs, np.uint32)[0])
                count = int(self._get(orig_offs + 4, np.uint64)[0])
                try:
                    item_type = gguf.GGUFValueType(item_type)
                except ValueError:
                    item_type = None  # the stock code names the bad type
                np_type = self.gguf_scalar_to_np.get(item_type)
                least = np.dtype(np_type).itemsize if np_type is not None else \
                    8 if item_type == gguf.GGUFValueType.STRING else 12
                if count > MAX_METADATA_ARRAY or count * least > len(self.data) - orig_offs - 12:
                    raise _ShortRead(f"a metadata array at offset {orig_offs} claims {count} items, more than "
                                     f"{'the file can hold' if count <= MAX_METADATA_ARRAY else MAX_METADATA_ARRAY}")
                if getattr(self, "byte_order", None) == "I" and (np_type is not None or
                                                                 item_type == gguf.GGUFValueType.STRING):
                    return self._array_parts(orig_offs, item_type, np_type, count)
            return super()._get_field_parts(orig_offs, raw_type)

        def _array_parts(self, orig_offs, item_type, np_type, count):
            # The stock reader parses an array one item at a time through _get_field_parts (~8 us an item: 3.5 of a
            # 262,144-token vocabulary's 4.9 s load). The same parts, built in one pass: the items of a scalar array
            # are 1-item views of one read, a string array's lengths are walked in plain Python. Files in their own
            # byte order only (byte_order "I"); a byte-swapped file takes the stock path.
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            offs = orig_offs + 12
            types = [gguf.GGUFValueType.ARRAY] + ([item_type] if count else [])
            if np_type is not None:
                values = self._get(offs, np_type, count)
                parts += [values[i:i + 1] for i in range(count)]
                return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types
            data, end = self.data, len(self.data)
            idxs = []
            with memoryview(data) as mv:  # released here, also when a corrupt length raises (the map stays closable)
                for _ in range(count):
                    if offs + 8 > end:
                        raise _ShortRead(f"a metadata string at offset {offs} runs past the end of the file")
                    n = int.from_bytes(mv[offs:offs + 8], sys.byteorder)  # the file's order is the host's ("I")
                    if n > end - offs - 8:
                        raise _ShortRead(f"a metadata string at offset {offs} claims {n} bytes, more than the file "
                                         f"holds")
                    parts.append(data[offs:offs + 8].view(np.uint64))
                    idxs.append(len(parts))
                    parts.append(data[offs + 8:offs + 8 + n])
                    offs += 8 + n
            return offs - orig_offs, parts, idxs, types

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
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot open: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise GGUFError(f"{path}: not a GGUF file ({kind})")
    size = st.st_size
    if size < 24:  # magic + version + tensor count + kv count
        raise GGUFError(f"{path}: not a GGUF file ({size} bytes, too short for a GGUF header)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from e
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
    config = _read_config(metadata, path, embd_rows, len(all_tensors))
    expected = _expected_shapes(config)
    if "rope_freqs.weight" in infos:  # Llama 3.1+ RoPE scaling: pair i turns by theta_i / rope_freqs[i]
        expected["rope_freqs.weight"] = (config.head_dim // 2,)
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
        elif shape[1] % _block_elems(ggml_type):
            raise UnsupportedModelError(f"{path}: tensor {name!r} is {info.tensor_type.name} with {shape[1]} columns, "
                                        f"not a multiple of its {_block_elems(ggml_type)}-weight blocks")
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
        except (ValueError, TypeError, OverflowError):  # an unknown id, a string, a list, inf
            return f"file_type {ftype}"
    # No declared file type: name the type most of the layer matrices use.
    counts: Dict[str, int] = {}
    for t in tensors.values():
        if t.data.ndim == 2:
            counts[t.type_name] = counts.get(t.type_name, 0) + t.rows * t.cols
    return max(counts, key=counts.get) if counts else "unknown"
