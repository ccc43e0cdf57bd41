"""Tokenizers read from GGUF metadata: byte-level BPE (tokenizer model "gpt2": GPT-2, SmolLM, Llama 3, Qwen 2) and
SentencePiece-style (tokenizer model "llama": Llama 2, Gemma), as llama.cpp's converters write them.

Pure Python: needs only `regex` (and `gguf` for `Tokenizer.from_gguf_path`), never the C++ extension.

The BPE pipeline matches Hugging Face `tokenizers` for the same vocab and merges:
  1. control and user-defined tokens written literally in the text are cut out first and become their ids;
  2. each stretch between them is split into pre-tokens by the regexes that `tokenizer.ggml.pre` names;
  3. each pre-token's UTF-8 bytes become GPT-2 byte-level symbols, which are merged by merge rank (lowest first,
     leftmost first among equal ranks, one merge at a time, exactly as `tokenizers`' BPE model does).
The SentencePiece pipeline is llama.cpp's: specials are cut out the same way; each stretch between them (with a
space in front when the file asks for a space prefix and the stretch follows a special or starts the text) has its
spaces written as U+2581, is split into characters, and adjacent symbols are merged while their concatenation is a
vocabulary entry, highest score first (leftmost among equal scores); a symbol that is no entry falls back to its
UTF-8 bytes as <0xXX> tokens.
"""

from __future__ import annotations

import codecs
import heapq
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

import regex

from .errors import GGUFError, TokenError, UnsupportedModelError

__all__ = ["Tokenizer", "StreamDecoder", "TokenType", "SUPPORTED_PRE_TOKENIZERS"]


class TokenType:
    """Values of `tokenizer.ggml.token_type` (llama.cpp's llama_token_type)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_TOKEN_TYPE = "tokenizer.ggml.token_type"
KEY_BOS = "tokenizer.ggml.bos_token_id"
KEY_EOS = "tokenizer.ggml.eos_token_id"
KEY_EOT = "tokenizer.ggml.eot_token_id"
KEY_EOM = "tokenizer.ggml.eom_token_id"
KEY_PAD = "tokenizer.ggml.padding_token_id"
KEY_UNK = "tokenizer.ggml.unknown_token_id"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_ADD_EOS = "tokenizer.ggml.add_eos_token"
KEY_SCORES = "tokenizer.ggml.scores"
KEY_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
SPM_SPACE = "\u2581"  # SentencePiece's visible space

# Token texts that llama.cpp's vocabulary loader (the version llama-cpp-python 0.3.36 vendors) treats as control
# tokens whatever type the file gives them, logging "control-looking token ... its type will be overridden": the
# end-of-generation markers (which also end generation) and the fill-in-the-middle markers (of which the pad, repo and
# file-separator ones end generation too). Applying the same override keeps token ids identical to llama.cpp's, e.g.
# "</s>" written in text is one token in Qwen2.5 (a normal-typed entry there) and plain text in Gemma 3 when special
# tokens are not parsed (a user-defined entry there, which would otherwise always match).
_END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
    "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
)
_FILL_IN_THE_MIDDLE_TEXTS = (
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
    "<|code_prefix|>", "<|prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
    "<|code_suffix|>", "<|suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
    "<|code_middle|>", "<|middle|>",
)
# ... except that "</s>" stays a normal token in vocabularies that end turns with one of these.
_KEEPS_END_TAG_NORMAL = ("<|tool_response>", "<|plamo:eos|>")


def _bytes_to_unicode() -> List[str]:
    """GPT-2's reversible byte -> printable character map (byte b is drawn as table[b]).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, NBSP, soft hyphen) take the
    characters from U+0100 on, in byte order, so every byte has a visible, non-whitespace stand-in.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table = []
    next_free = 0x100
    for byte in range(256):
        if byte in printable:
            table.append(chr(byte))
        else:
            table.append(chr(next_free))
            next_free += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
# Maps each stand-in character back to the Latin-1 character of its byte, so `.translate(...).encode("latin-1")`
# turns a byte-level string back into bytes in C.
_CHAR_TO_LATIN1 = {ord(char): chr(byte) for byte, char in enumerate(_BYTE_TO_CHAR)}


# ---------------------------------------------------------------------------------------------------------------
# Pre-tokenizers
# ---------------------------------------------------------------------------------------------------------------

# GPT-2's split, as `tokenizers`' ByteLevel(use_regex=True) applies it.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's split (tokenizer.json: Split(Isolated) with this pattern, then ByteLevel(use_regex=False)).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizerSpec:
    # Applied in order; each splits every piece of the previous step, keeping both matches and the text between them.
    patterns: Tuple[str, ...]
    # When a whole pre-token is itself a vocab entry, take it without merging (Llama 3's `ignore_merges`).
    ignore_merges: bool = False


# Qwen 2 / 2.5: Llama 3's split with single digits, and merges always applied.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SMOLLM = _PreTokenizerSpec((r"\p{N}", _GPT2_SPLIT))  # Digits(individual_digits=True), then ByteLevel
_LLAMA3 = _PreTokenizerSpec((_LLAMA3_SPLIT,), ignore_merges=True)

_PRE_TOKENIZERS: Dict[str, _PreTokenizerSpec] = {
    "gpt2": _PreTokenizerSpec((_GPT2_SPLIT,)),
    "smollm": _SMOLLM,
    "starcoder": _SMOLLM,  # SmolLM inherits StarCoder's tokenizer pipeline
    "qwen2": _PreTokenizerSpec((_QWEN2_SPLIT,)),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    # What llama.cpp does for a BPE vocab whose converter recognised no pre-tokenizer: isolate punctuation runs,
    # GPT-2 split, isolate number runs, then cut three-digit groups off the front of each number.
    "default": _PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")),
}

SUPPORTED_PRE_TOKENIZERS: FrozenSet[str] = frozenset(_PRE_TOKENIZERS)


class _PreTokenizer:
    def __init__(self, spec: _PreTokenizerSpec):
        self.patterns = tuple(regex.compile(pattern) for pattern in spec.patterns)

    def split(self, text: str) -> List[str]:
        pieces = [text]
        for pattern in self.patterns:
            split_pieces: List[str] = []
            for piece in pieces:
                end_of_previous = 0
                for match in pattern.finditer(piece):
                    start, end = match.span()
                    if start > end_of_previous:
                        split_pieces.append(piece[end_of_previous:start])
                    if end > start:
                        split_pieces.append(piece[start:end])
                    end_of_previous = end
                if end_of_previous < len(piece):
                    split_pieces.append(piece[end_of_previous:])
            pieces = split_pieces
        return pieces


# ---------------------------------------------------------------------------------------------------------------
# GGUF field reading and validation
# ---------------------------------------------------------------------------------------------------------------


def _field_value(field: Any) -> Any:
    """A GGUFReader field as a Python value (older gguf releases lack ReaderField.contents())."""
    if hasattr(field, "contents"):
        return field.contents()
    import gguf  # only reached with an old gguf release

    if not field.types:
        return None

    def to_python(part: Any, value_type: Any) -> Any:
        if value_type == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [to_python(field.parts[index], field.types[-1]) for index in field.data]
    return to_python(field.parts[field.data[0]], field.types[0])


def _require(fields: Mapping[str, Any], key: str) -> Any:
    if key not in fields or fields[key] is None:
        raise GGUFError(f"GGUF metadata lacks the tokenizer key '{key}'")
    return fields[key]


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise GGUFError(f"GGUF key '{key}' should be an integer, got {value!r}")
    try:
        return int(value.__index__())
    except (AttributeError, TypeError):
        raise GGUFError(f"GGUF key '{key}' should be an integer, got {value!r}") from None


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # some writers store flags as u8
        return bool(value)
    raise GGUFError(f"GGUF key '{key}' should be a boolean, got {value!r}")


def _as_str_list(value: Any, key: str) -> List[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise GGUFError(f"GGUF key '{key}' should be an array of strings, got {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise GGUFError(f"GGUF key '{key}'[{index}] should be a string, got {type(item).__name__}")
    return list(value)


def _optional_token_id(fields: Mapping[str, Any], key: str, vocab_size: int) -> Optional[int]:
    if fields.get(key) is None:
        return None
    token_id = _as_int(fields[key], key)
    if not 0 <= token_id < vocab_size:
        raise GGUFError(f"GGUF key '{key}' = {token_id} is outside the vocabulary of {vocab_size} tokens")
    return token_id


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------

_NO_MERGE = 1 << 62  # rank of a pair that has no merge rule: larger than any real rank
# Pre-tokens with more symbols than this merge through a heap (n log n) rather than repeated scans (n^2).
_LONG_WORD_SYMBOLS = 48


class _Literals:
    """The literal texts (special tokens) written in a text: leftmost first, the longest one starting there, none
    overlapping, as a regex alternation of them sorted longest first finds them, but by a scan for their first
    characters and set lookups: Gemma 3's alternation of 6,414 control tokens took 280 ms over 17,000 characters."""

    def __init__(self, texts: Iterable[str]):
        self._texts = frozenset(text for text in texts if text)
        self._singles = frozenset(text for text in self._texts if len(text) == 1)
        # The lengths of the literals each two-character prefix starts, longest first: at a space (Gemma 3's
        # whitespace runs make it a first character) only a space run's own prefix is tried.
        lengths: Dict[str, set] = {}
        for text in self._texts:
            if len(text) > 1:
                lengths.setdefault(text[:2], set()).add(len(text))
        self._lengths = {prefix: sorted(ls, reverse=True) for prefix, ls in lengths.items()}
        firsts = "".join(sorted({text[0] for text in self._texts}))
        self._first = regex.compile(f"[{regex.escape(firsts)}]") if firsts else None

    def finditer(self, text: str) -> Iterable[Tuple[int, int]]:
        """(start, end) of each match."""
        if self._first is None:
            return
        texts, singles, lengths_of, search, n = self._texts, self._singles, self._lengths, self._first.search, len(text)
        match = search(text)
        while match is not None:
            at = match.start()
            end = 0
            for length in lengths_of.get(text[at : at + 2], ()):
                if at + length <= n and text[at : at + length] in texts:
                    end = at + length
                    break
            if not end and text[at] in singles:
                end = at + 1
            if end:
                yield at, end
            match = search(text, end or at + 1)


class Tokenizer:
    """Byte-level BPE tokenizer of a GGUF model. Build it with `from_gguf_path` or `from_gguf_fields`.

    Encoding keeps an LRU cache of pre-token -> ids, which tolerates several threads encoding at once (an entry
    evicted by another thread between two steps is recomputed; tests/python/test_reliability.py).
    """

    def __init__(
        self,
        tokens: List[str],
        token_types: List[int],
        merges: List[str],
        pre: str,
        bos_id: Optional[int],
        eos_id: Optional[int],
        eot_ids: Iterable[int] = (),
        pad_id: Optional[int] = None,
        unk_id: Optional[int] = None,
        add_bos: bool = False,
        add_eos: bool = False,
        cache_size: int = 1 << 16,
        model: str = "gpt2",
        scores: Optional[List[float]] = None,
        add_space_prefix: bool = False,
    ):
        """Prefer `from_gguf_fields`: it validates the GGUF values before they get here."""
        self.model = model
        self.spm = model == "llama"
        if not self.spm and pre not in _PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"unknown pre-tokenizer '{pre}' ({KEY_PRE}); supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
            )
        self.pre = pre
        self.add_space_prefix = add_space_prefix
        self._scores = scores
        self._tokens = tokens
        # llama.cpp's control-type override (see _END_OF_GENERATION_TEXTS); the file's own types stay as they were.
        forced = set(_END_OF_GENERATION_TEXTS) | set(_FILL_IN_THE_MIDDLE_TEXTS)
        if any(text in tokens for text in _KEEPS_END_TAG_NORMAL):
            forced.discard("</s>")
        forced_ids = [token_id for token_id, text in enumerate(tokens) if text in forced]
        if forced_ids:
            token_types = list(token_types)
            for token_id in forced_ids:
                token_types[token_id] = TokenType.CONTROL
        self._token_types = token_types
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.add_bos = add_bos
        self.add_eos = add_eos

        self._token_to_id: Dict[str, int] = {}
        for token_id, text in enumerate(tokens):
            self._token_to_id.setdefault(text, token_id)

        if self.spm:
            # <0xXX> tokens, for the bytes of a symbol that is no vocabulary entry.
            self._byte_ids = [self._token_to_id.get(f"<0x{byte:02X}>") for byte in range(256)]
            self._spm_words = self._spm_word_pattern(tokens)
        else:
            spec = _PRE_TOKENIZERS[pre]
            self._pre_tokenizer = _PreTokenizer(spec)
            self._ignore_merges = spec.ignore_merges
            self._byte_ids = self._find_byte_ids()
            self._has_missing_bytes = None in self._byte_ids
            self._merge_ranks, self._merge_results = self._build_merges(merges)
        self._token_bytes = [self._bytes_of(token_id) for token_id in range(len(tokens))]

        # Tokens written literally in text: control (and unknown-type) ones only when special parsing is on,
        # user-defined ones always, as llama.cpp partitions them.
        control = {}
        user_defined = {}
        for token_id, (text, token_type) in enumerate(zip(tokens, token_types)):
            if not text:
                continue
            if token_type == TokenType.CONTROL or (self.spm and token_type == TokenType.UNKNOWN):
                control.setdefault(text, token_id)
            elif token_type == TokenType.USER_DEFINED:
                user_defined.setdefault(text, token_id)
        self._literal_ids = {**control, **user_defined}
        self._literal_pattern = self._alternation(self._literal_ids)
        self._user_defined_pattern = self._alternation(user_defined)

        ends = set(eot_ids)
        if eos_id is not None:
            ends.add(eos_id)
        for text in _END_OF_GENERATION_TEXTS:
            token_id = self._literal_ids.get(text)
            if token_id is not None and self._token_types[token_id] == TokenType.CONTROL:
                ends.add(token_id)
        self.eot_ids: FrozenSet[int] = frozenset(ends)

        self._cache: "OrderedDict[str, Tuple[int, ...]]" = OrderedDict()
        self._cache_size = cache_size

    # -- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata given as {key: Python value} (only the tokenizer.ggml.* keys are read)."""
        model = _require(fields, KEY_MODEL)
        if not isinstance(model, str):
            raise GGUFError(f"GGUF key '{KEY_MODEL}' should be a string, got {model!r}")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"tokenizer model '{model}' ({KEY_MODEL}) is not supported: 'gpt2' (byte-level BPE) and 'llama' "
                "(SentencePiece) are"
            )
        # llama.cpp reads a missing pre-tokenizer as "default"; files from old converters lack the key.
        pre = fields.get(KEY_PRE)
        if pre is None:
            pre = "default"
        if not isinstance(pre, str):
            raise GGUFError(f"GGUF key '{KEY_PRE}' should be a string, got {pre!r}")
        if model == "gpt2" and pre not in _PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"unknown pre-tokenizer '{pre}' ({KEY_PRE}); supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
            )

        tokens = _as_str_list(_require(fields, KEY_TOKENS), KEY_TOKENS)
        if not tokens:
            raise GGUFError(f"GGUF key '{KEY_TOKENS}' is empty")
        scores = None
        add_space_prefix = False
        if model == "gpt2":
            merges = _as_str_list(_require(fields, KEY_MERGES), KEY_MERGES)
        else:  # SentencePiece: merge order comes from the scores
            merges = []
            raw_scores = _require(fields, KEY_SCORES)
            if isinstance(raw_scores, (str, bytes)) or not isinstance(raw_scores, Sequence) or \
                    len(raw_scores) != len(tokens):
                raise GGUFError(f"GGUF key '{KEY_SCORES}' should be an array of {len(tokens)} numbers")
            try:
                scores = [float(x) for x in raw_scores]
            except (TypeError, ValueError):
                raise GGUFError(f"GGUF key '{KEY_SCORES}' should hold numbers") from None
            prefix = fields.get(KEY_ADD_SPACE_PREFIX)
            add_space_prefix = True if prefix is None else _as_bool(prefix, KEY_ADD_SPACE_PREFIX)

        raw_types = fields.get(KEY_TOKEN_TYPE)
        if raw_types is None:
            token_types = [TokenType.NORMAL] * len(tokens)
        else:
            if isinstance(raw_types, (str, bytes)) or not isinstance(raw_types, Sequence):
                raise GGUFError(f"GGUF key '{KEY_TOKEN_TYPE}' should be an array of integers")
            token_types = [_as_int(value, KEY_TOKEN_TYPE) for value in raw_types]
            if len(token_types) != len(tokens):
                raise GGUFError(
                    f"GGUF key '{KEY_TOKEN_TYPE}' has {len(token_types)} entries but '{KEY_TOKENS}' has {len(tokens)}"
                )

        vocab_size = len(tokens)
        extra_ends = [
            token_id
            for token_id in (_optional_token_id(fields, key, vocab_size) for key in (KEY_EOT, KEY_EOM))
            if token_id is not None
        ]
        add_bos = fields.get(KEY_ADD_BOS)
        add_eos = fields.get(KEY_ADD_EOS)
        return cls(
            tokens=tokens,
            token_types=token_types,
            merges=merges,
            pre=pre,
            bos_id=_optional_token_id(fields, KEY_BOS, vocab_size),
            eos_id=_optional_token_id(fields, KEY_EOS, vocab_size),
            eot_ids=extra_ends,
            pad_id=_optional_token_id(fields, KEY_PAD, vocab_size),
            unk_id=_optional_token_id(fields, KEY_UNK, vocab_size),
            add_bos=(model == "llama") if add_bos is None else _as_bool(add_bos, KEY_ADD_BOS),
            add_eos=False if add_eos is None else _as_bool(add_eos, KEY_ADD_EOS),
            model=model,
            scores=scores,
            add_space_prefix=add_space_prefix,
        )

    @classmethod
    def from_gguf_path(cls, path: "os.PathLike[str] | str") -> "Tokenizer":
        """Read the tokenizer.ggml.* metadata of a GGUF file (tensor data is not touched), through gguf_model's
        reader (metadata arrays in one pass: the stock reader took seconds over a 262,144-token vocabulary)."""
        from .gguf_model import _open_reader

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise GGUFError(f"GGUF file not found: {path}")
        reader, _ = _open_reader(path)  # GGUFError on a truncated or corrupt file, naming it
        try:
            fields = {
                key: _field_value(field) for key, field in reader.fields.items() if key.startswith("tokenizer.ggml.")
            }
        except Exception as error:  # gguf raises assorted builtin errors on truncated or corrupt files
            raise GGUFError(f"cannot read GGUF metadata from {path}: {error}") from error
        return cls.from_gguf_fields(fields)

    def _find_byte_ids(self) -> List[Optional[int]]:
        # Vocabs trained on a restricted alphabet lack some bytes (SmolLM2 has no token for 0x04, 0xC0, 0xFF, ...).
        # Such bytes are dropped before merging, as `tokenizers` does for a BPE model without unk_token.
        return [self._token_to_id.get(char) for char in _BYTE_TO_CHAR]

    def _build_merges(self, merges: List[str]) -> Tuple[Dict[int, int], List[int]]:
        """Pair key (left * vocab_size + right) -> rank, and rank -> merged token id."""
        vocab_size = len(self._tokens)
        ranks: Dict[int, int] = {}
        results: List[int] = []
        for index, merge in enumerate(merges):
            # The left part may itself start with a space (not in byte-level vocabs, but allowed by the format).
            split_at = merge.find(" ", 1)
            if split_at < 1 or split_at == len(merge) - 1:
                raise GGUFError(f"GGUF key '{KEY_MERGES}'[{index}] = {merge!r} is not of the form 'left right'")
            left = self._token_to_id.get(merge[:split_at])
            right = self._token_to_id.get(merge[split_at + 1 :])
            merged = self._token_to_id.get(merge[:split_at] + merge[split_at + 1 :])
            if left is None or right is None or merged is None:
                continue  # a rule that can build no vocab token can never fire
            key = left * vocab_size + right
            if key not in ranks:  # the first (highest-priority) rule for a pair wins
                ranks[key] = len(results)
                results.append(merged)
        return ranks, results

    @staticmethod
    def _alternation(literal_ids: Mapping[str, int]) -> Optional["_Literals"]:
        return _Literals(literal_ids) if literal_ids else None

    def _bytes_of(self, token_id: int) -> bytes:
        text = self._tokens[token_id]
        if self.spm:
            token_type = self._token_types[token_id]
            if token_type == TokenType.BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:5], 16)])
            if token_type in (TokenType.NORMAL, TokenType.UNUSED, TokenType.USER_DEFINED):
                return text.replace(SPM_SPACE, " ").encode("utf-8")
            return text.encode("utf-8")
        if self._token_types[token_id] in (TokenType.NORMAL, TokenType.UNUSED):
            try:
                return text.translate(_CHAR_TO_LATIN1).encode("latin-1")
            except UnicodeEncodeError:
                pass  # not a byte-level string: fall through and render it as text
        return text.encode("utf-8")

    # -- queries ------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def _check_id(self, token_id: Any) -> int:
        try:
            index = token_id.__index__()
        except (AttributeError, TypeError):
            raise TokenError(f"token id should be an integer, got {token_id!r}") from None
        if isinstance(token_id, bool) or not 0 <= index < len(self._tokens):
            raise TokenError(f"token id {token_id!r} is outside the vocabulary of {len(self._tokens)} tokens")
        return index

    def token_text(self, token_id: int) -> str:
        """The vocab entry as stored in the GGUF (byte-level form, e.g. 'Ġthe')."""
        return self._tokens[self._check_id(token_id)]

    def token_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes this token stands for (a token may hold part of a UTF-8 character)."""
        return self._token_bytes[self._check_id(token_id)]

    def token_to_piece(self, token_id: int) -> str:
        """The token as text on its own; bytes of a split character show as U+FFFD."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def token_to_id(self, text: str) -> Optional[int]:
        """Id of the vocab entry spelled exactly `text` (byte-level form for normal tokens), or None."""
        return self._token_to_id.get(text)

    def token_type(self, token_id: int) -> int:
        return self._token_types[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (<|im_start|>, <|endoftext|>, ...): the ones `skip_special` leaves out."""
        return self._token_types[self._check_id(token_id)] == TokenType.CONTROL

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, vocab_size={self.vocab_size}, pre={self.pre!r}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id})")

    # -- encoding -----------------------------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        add_bos: Optional[bool] = None,
        parse_special: bool = True,
        add_eos: Optional[bool] = None,
    ) -> List[int]:
        """Token ids of `text`. add_bos/add_eos default to the GGUF's add_bos_token/add_eos_token.

        With parse_special, control tokens written in the text (e.g. '<|im_start|>') become their ids; without it they
        are tokenized as plain text. User-defined tokens are always matched, as in `tokenizers` and llama.cpp.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids: List[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenError(f"a BOS token was asked for but the GGUF has no '{KEY_BOS}'")
            ids.append(self.bos_id)

        literal_pattern = self._literal_pattern if parse_special else self._user_defined_pattern
        encode_stretch = self._encode_spm if self.spm else self._encode_ordinary
        if literal_pattern is None:
            encode_stretch(text, ids, True)
        else:
            end_of_previous = 0
            for start, end in literal_pattern.finditer(text):
                encode_stretch(text[end_of_previous:start], ids, True)
                ids.append(self._literal_ids[text[start:end]])
                end_of_previous = end
            encode_stretch(text[end_of_previous:], ids, True)

        if self.add_eos if add_eos is None else add_eos:
            if self.eos_id is None:
                raise TokenError(f"an EOS token was asked for but the GGUF has no '{KEY_EOS}'")
            ids.append(self.eos_id)
        return ids

    @staticmethod
    def _spm_word_pattern(tokens: List[str]) -> "regex.Pattern[str]":
        """Where a SentencePiece stretch can be cut into words that merge alone: before a space marker whose previous
        character is neither a marker nor one that precedes a marker inside some vocabulary entry. No entry spans
        such a cut, and every merged symbol is an entry, so no merge crosses it; merging each word alone then gives
        the stretch's merges (the same candidates, in the same order within each word), and words repeat, so their
        ids are cached as BPE pre-tokens are."""
        joined = "\0".join(tokens)  # one regex pass over every entry, NUL between them (no entry holds one)
        if joined.count("\0") == len(tokens) - 1:
            before = set(regex.findall(f"([^{SPM_SPACE}\0]){SPM_SPACE}", joined))
        else:
            before = {t[j - 1] for t in tokens for j in range(1, len(t)) if t[j] == SPM_SPACE and t[j - 1] != SPM_SPACE}
        excluded = regex.escape("".join(sorted(before | {SPM_SPACE})))
        return regex.compile(f"(?<=[^{excluded}])(?={SPM_SPACE})")

    def _encode_spm(self, text: str, ids: List[int], after_special: bool) -> None:
        """SentencePiece merging of one stretch of text between specials (llama.cpp's SPM tokenizer), word by word
        (see _spm_word_pattern), each word's ids cached."""
        if not text:
            return
        if self.add_space_prefix and after_special:
            text = " " + text
        text = text.replace(" ", SPM_SPACE)
        for word in self._spm_words.split(text):
            if word:
                ids.extend(self._cached(word, self._spm_merge))

    def _cached(self, key: str, compute: Callable[[str], Tuple[int, ...]]) -> Tuple[int, ...]:
        """The ids of a pre-token (BPE) or word (SentencePiece) from the LRU cache, computed on a miss. Another
        thread may evict between two of these calls (each is atomic under the GIL, the pair is not): a miss then
        only costs a recomputation."""
        cache = self._cache
        key_ids = cache.get(key)
        if key_ids is None:
            key_ids = compute(key)
            cache[key] = key_ids
            if len(cache) > self._cache_size:
                try:
                    cache.popitem(last=False)
                except KeyError:
                    pass
        else:
            try:
                cache.move_to_end(key)
            except KeyError:
                pass
        return key_ids

    def _spm_merge(self, text: str) -> Tuple[int, ...]:
        """The ids of one word: symbols merged by score (the highest first, the leftmost among equal ones)."""
        ids: List[int] = []
        token_to_id, scores = self._token_to_id, self._scores
        n = len(text)
        # Symbols are character spans [start[i], start[i] + size[i]) linked in a list; size 0 marks a merged-away one.
        start = list(range(n))
        size = [1] * n
        prev_of = list(range(-1, n - 1))
        next_of = list(range(1, n + 1))
        next_of[-1] = -1
        heap: List[Tuple[float, int, int, int]] = []  # (-score, left, right, length) of a candidate merge

        def add_bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            token_id = token_to_id.get(text[start[left] : start[left] + size[left] + size[right]])
            if token_id is not None:
                heapq.heappush(heap, (-scores[token_id], left, right, size[left] + size[right]))

        for i in range(1, n):
            add_bigram(i - 1, i)
        while heap:
            _, left, right, length = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # one side was merged since this candidate was queued
            size[left] += size[right]
            size[right] = 0
            next_of[left] = next_of[right]
            if next_of[right] >= 0:
                prev_of[next_of[right]] = left
            add_bigram(prev_of[left], left)
            add_bigram(left, next_of[left])

        # Every merged symbol is a vocabulary entry; a character that never merged and is no entry falls back to its
        # UTF-8 bytes as <0xXX> tokens (the unknown token where the vocabulary lacks one).
        i = 0
        while i != -1:
            span = text[start[i] : start[i] + size[i]]
            token_id = token_to_id.get(span)
            if token_id is not None:
                ids.append(token_id)
            else:
                for byte in span.encode("utf-8"):
                    byte_id = self._byte_ids[byte] if self._byte_ids[byte] is not None else self.unk_id
                    if byte_id is not None:
                        ids.append(byte_id)
            i = next_of[i]
        return tuple(ids)

    def _encode_ordinary(self, text: str, ids: List[int], after_special: bool = True) -> None:
        if not text:
            return
        for piece in self._pre_tokenizer.split(text):
            ids.extend(self._cached(piece, self._bpe))

    def _bpe(self, piece: str) -> Tuple[int, ...]:
        data = piece.encode("utf-8")
        if self._ignore_merges:
            whole = self._token_to_id.get("".join([_BYTE_TO_CHAR[byte] for byte in data]))
            if whole is not None:
                return (whole,)
        byte_ids = self._byte_ids
        symbols = [byte_ids[byte] for byte in data]
        if self._has_missing_bytes:
            symbols = [symbol for symbol in symbols if symbol is not None]
        if len(symbols) > _LONG_WORD_SYMBOLS:
            return self._merge_long(symbols)
        return self._merge_short(symbols)

    def _merge_short(self, symbols: List[int]) -> Tuple[int, ...]:
        """Merge by rescanning: the lowest-rank pair, leftmost among ties, one merge at a time."""
        ranks_of = self._merge_ranks
        results = self._merge_results
        vocab_size = len(self._tokens)
        pair_ranks = [
            ranks_of.get(left * vocab_size + right, _NO_MERGE) for left, right in zip(symbols, symbols[1:])
        ]
        while pair_ranks:
            best = min(pair_ranks)
            if best == _NO_MERGE:
                break
            at = pair_ranks.index(best)
            merged = results[best]
            symbols[at] = merged
            del symbols[at + 1]
            del pair_ranks[at]
            if at > 0:
                pair_ranks[at - 1] = ranks_of.get(symbols[at - 1] * vocab_size + merged, _NO_MERGE)
            if at < len(pair_ranks):
                pair_ranks[at] = ranks_of.get(merged * vocab_size + symbols[at + 1], _NO_MERGE)
        return tuple(symbols)

    def _merge_long(self, symbols: List[int]) -> Tuple[int, ...]:
        """Same merge order as `_merge_short`, kept in a heap over a linked list so long pre-tokens stay n log n.

        Symbols are named by the index of their first byte; a heap entry is stale once either side has changed, which
        the stored ids reveal (a merged symbol never has the id of either of its parts).
        """
        ranks_of = self._merge_ranks
        results = self._merge_results
        vocab_size = len(self._tokens)
        count = len(symbols)
        next_of = list(range(1, count + 1))
        next_of[-1] = -1
        prev_of = list(range(-1, count - 1))
        heap = []
        for at in range(count - 1):
            rank = ranks_of.get(symbols[at] * vocab_size + symbols[at + 1])
            if rank is not None:
                heap.append((rank, at, symbols[at], symbols[at + 1]))
        heapq.heapify(heap)
        while heap:
            rank, at, left, right = heapq.heappop(heap)
            after = next_of[at]
            if symbols[at] != left or after == -1 or symbols[after] != right:
                continue
            merged = results[rank]
            symbols[at] = merged
            symbols[after] = -1
            next_of[at] = next_of[after]
            if next_of[at] != -1:
                prev_of[next_of[at]] = at
            before = prev_of[at]
            if before != -1:
                new_rank = ranks_of.get(symbols[before] * vocab_size + merged)
                if new_rank is not None:
                    heapq.heappush(heap, (new_rank, before, symbols[before], merged))
            after = next_of[at]
            if after != -1:
                new_rank = ranks_of.get(merged * vocab_size + symbols[after])
                if new_rank is not None:
                    heapq.heappush(heap, (new_rank, at, merged, symbols[after]))
        return tuple(symbol for symbol in symbols if symbol != -1)

    # -- decoding -----------------------------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """The bytes the tokens stand for, before UTF-8 decoding."""
        token_bytes = self._token_bytes
        token_types = self._token_types
        parts = []
        for token_id in ids:
            index = self._check_id(token_id)
            if skip_special and token_types[index] == TokenType.CONTROL:
                continue
            parts.append(token_bytes[index])
        return b"".join(parts)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of the tokens; invalid UTF-8 becomes U+FFFD. Control tokens show as their text unless skip_special."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Turns tokens into text one at a time, holding back the bytes of a character split across tokens.

    The concatenation of every `push` and the final `flush` equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_to_bytes(token_id), final=False)

    def flush(self) -> str:
        """Whatever is held back, with an unfinished character shown as U+FFFD; the decoder can then go on."""
        return self._utf8.decode(b"", final=True)
