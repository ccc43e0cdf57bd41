"""gguf_model.load_gguf, the synthetic writer and convert.quantize_file: valid files, zero-copy views, every
class of bad file, and re-quantization."""
import os
import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from metalattn import quants  # noqa: E402
from metalattn.convert import _copy_metadata, quantize_file  # noqa: E402
from metalattn.errors import GGUFError, UnsupportedModelError  # noqa: E402
from metalattn.gguf_model import load_gguf  # noqa: E402
from metalattn.testing import (SMOLLM2_135M, build_bpe_vocab, bytes_to_unicode, find_smollm2_gguf,  # noqa: E402
                               write_synthetic_gguf)


def real_model_path():
    return find_smollm2_gguf()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=1)


def rewrite(src, dst, *, arch="llama", drop_keys=(), set_keys=None, drop_tensors=(), replace_tensors=None):
    """Copy a GGUF with edits: set_keys = {key: (value, GGUFValueType)}, replace_tensors = {name: (uint8 or float
    array, GGMLQuantizationType or None)}. Lets the tests build exactly one defect per file."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(os.fspath(dst), arch)
    fields = {k: f for k, f in reader.fields.items() if k not in drop_keys}

    class FilteredReader:  # _copy_metadata only reads .fields
        pass

    filtered = FilteredReader()
    filtered.fields = fields
    _copy_metadata(filtered, writer, os.fspath(src), dict(set_keys or {}))
    replace_tensors = replace_tensors or {}
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        if t.name in replace_tensors:
            data, raw_dtype = replace_tensors[t.name]
            writer.add_tensor(t.name, data, raw_dtype=raw_dtype)
        else:
            raw = np.asarray(reader.data[t.data_offset:t.data_offset + t.n_bytes])
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if t.tensor_type == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(t.name, raw.view(np.float32).reshape(shape))
            else:
                writer.add_tensor(t.name, raw.reshape(shape[0] if len(shape) == 2 else 1, -1),
                                  raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ------------------------------------------------------------------------------------------------ valid files

def test_synthetic_config_and_tensors(synthetic):
    m = load_gguf(synthetic)
    c = m.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim) == (2, 64, 128, 4, 2, 16)
    assert (c.vocab_size, c.n_ctx_train, c.rope_base) == (512, 256, 10000.0)
    assert c.rms_eps == pytest.approx(1e-5, rel=1e-6)
    assert m.tied_output and m.tensors["output.weight"] is m.tensors["token_embd.weight"]
    assert m.file_type_name == "Q4_0"
    q = m.tensors["blk.1.attn_k.weight"]
    assert (q.ggml_type, q.rows, q.cols, q.data.shape) == (quants.Q4_0, 32, 64, (32, 36))
    down = m.layer(0, "ffn_down")
    assert (down.rows, down.cols) == (64, 128)
    norm = m.tensors["blk.0.attn_norm.weight"]
    assert norm.data.dtype == np.float32 and norm.data.shape == (64,)
    assert 0.9 <= norm.data.min() and norm.data.max() <= 1.1 and norm.data.std() > 0.01
    names = {row[0] for row in m.tensor_table()}
    assert len(m.tensor_table()) == 1 + 1 + 2 * 9 and "output.weight" not in names
    assert sum(row[3] for row in m.tensor_table()) < os.path.getsize(synthetic)
    assert m.metadata["tokenizer.ggml.pre"] == "smollm" and len(m.metadata["tokenizer.ggml.tokens"]) == 512


def test_weights_are_zero_copy_views_on_the_mmap(synthetic):
    m = load_gguf(synthetic)
    mmap = m._reader.data
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output_norm.weight"):
        data = m.tensors[name].data
        assert np.shares_memory(data, mmap), name
        assert not data.flags.writeable, name
    # The view holds exactly the bytes of the tensor's range in the file.
    info = next(t for t in m._reader.tensors if t.name == "blk.0.attn_q.weight")
    with open(synthetic, "rb") as f:
        f.seek(info.data_offset)
        on_disk = np.frombuffer(f.read(info.n_bytes), np.uint8)
    np.testing.assert_array_equal(m.tensors["blk.0.attn_q.weight"].data.reshape(-1), on_disk)


def write_arrays_gguf(path, words):
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    rng = np.random.default_rng(3)
    writer.add_array("test.strings", words)
    writer.add_array("test.floats", rng.standard_normal(7000).astype(np.float32).tolist())
    writer.add_array("test.ints", rng.integers(-1000, 1000, 3000).tolist())
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.scalar", "plain")
    writer.add_tensor("t", np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


ARRAY_WORDS = (["", "a", "h\u00e9llo", "\u65e5\u672c\u8a9e", "\U0001f642 emoji", "x" * 300] +
               [f"tok{i}" for i in range(5000)])


def test_metadata_arrays_parse_as_the_stock_reader(tmp_path):
    """The reader builds a metadata array's parts in one pass (the stock reader parses one item at a time: 3.5 s of
    a 262,144-token vocabulary's load); every field must be the stock reader's, part for part."""
    from metalattn.gguf_model import _open_reader

    path = write_arrays_gguf(tmp_path / "arrays.gguf", ARRAY_WORDS)
    stock = gguf.GGUFReader(os.fspath(path), "r")
    ours, _ = _open_reader(os.fspath(path))
    assert list(ours.fields) == list(stock.fields)
    for key, a in stock.fields.items():
        b = ours.fields[key]
        assert (b.offset, b.name, list(b.types), list(b.data)) == (a.offset, a.name, list(a.types), list(a.data)), key
        assert len(b.parts) == len(a.parts), key
        for pa, pb in zip(a.parts, b.parts):
            assert pb.dtype == pa.dtype and pb.shape == pa.shape and pb.tobytes() == pa.tobytes(), key
        assert b.contents() == a.contents(), key
    assert ours.fields["test.strings"].contents() == ARRAY_WORDS
    assert [t.name for t in ours.tensors] == ["t"]


def test_metadata_string_past_the_end(tmp_path):
    path = write_arrays_gguf(tmp_path / "arrays.gguf", ARRAY_WORDS)
    data = bytearray(path.read_bytes())
    at = data.index(b"tok4242") - 8  # that string's length
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"bad\.gguf.*corrupt.*metadata string.*claims"):
        load_gguf(bad)


def test_per_tensor_types_untied_and_scales(tmp_path):
    path = write_synthetic_gguf(tmp_path / "m.gguf", n_layers=3, d_model=96, d_ff=160, n_heads=6, n_kv_heads=3,
                                vocab_size=700, quant="q4_1", embd_quant="q8_0", tied=False, seed=5)
    m = load_gguf(path)
    assert not m.tied_output and m.tensors["output.weight"] is not m.tensors["token_embd.weight"]
    assert m.tensors["token_embd.weight"].ggml_type == quants.Q8_0
    assert m.tensors["output.weight"].ggml_type == quants.Q8_0
    assert {m.layer(i, p).ggml_type for i in range(3) for p in ("attn_q", "ffn_up")} == {quants.Q4_1}
    assert m.config.head_dim == 16 and m.config.kv_dim == 48
    # Weights are N(0, 1/fan_in): the dequantized matrices have that spread (quantization adds a little).
    w = m.dequantized("blk.2.ffn_down.weight")
    assert w.shape == (96, 160) and abs(w.std() * np.sqrt(160) - 1) < 0.1
    assert m.dequantized("output.weight") is not m.dequantized("token_embd.weight")


def test_synthetic_tokenizer_is_a_valid_bpe():
    tokens, types, merges = build_bpe_vocab(1000)
    assert len(tokens) == 1000 == len(types) and len(set(tokens)) == 1000
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[:3] == [3, 3, 3]
    table = bytes_to_unicode()
    assert tokens[3:259] == [table[b] for b in range(256)] and len(set(table.values())) == 256
    ids = {t: i for i, t in enumerate(tokens)}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ")
        assert ids[left] < 259 + rank and ids[right] < 259 + rank, merge   # both halves exist before the merge
        assert ids[left + right] == 259 + rank, merge                      # the result is the next token

    tokenizers = pytest.importorskip("tokenizers")
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(ids, [tuple(m.split(" ")) for m in merges]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    text = "The capital of France is Paris, zqx! ünïcode"
    assert tk.decode(tk.encode(text).ids) == text
    # Every word of the list that made it into the vocabulary is reachable as one token, with or without a space.
    words = " the capital of france is paris"
    assert tk.encode(words).ids == [ids[w] for w in ["Ġthe", "Ġcapital", "Ġof", "Ġfrance", "Ġis", "Ġparis"]]
    assert tk.encode("hello").ids == [ids["hello"]]

    # In a bigger vocabulary, every merged token (word or word prefix) tokenizes to exactly itself.
    tokens, _, merges = build_bpe_vocab(8000)
    ids = {t: i for i, t in enumerate(tokens)}
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(ids, [tuple(m.split(" ")) for m in merges]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_of = {ch: b for b, ch in table.items()}
    texts = [bytes(byte_of[ch] for ch in t).decode() for t in tokens[259:]]
    assert [e.ids for e in tk.encode_batch(texts)] == [[i] for i in range(259, 8000)]


def test_smollm2_shaped_synthetic_writes_fast(tmp_path):
    import time

    start = time.perf_counter()
    path = write_synthetic_gguf(tmp_path / "smol.gguf", **SMOLLM2_135M)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"writing the 135M synthetic model took {elapsed:.1f} s"
    m = load_gguf(path)
    c = m.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.vocab_size, c.n_ctx_train) == \
        (30, 576, 1536, 9, 3, 49152, 8192)
    assert c.rope_base == 100000.0 and m.tied_output
    assert m.tensors["token_embd.weight"].ggml_type == quants.Q8_0
    assert m.layer(29, "ffn_gate").ggml_type == quants.Q4_0
    assert 80 * 2**20 < os.path.getsize(path) < 95 * 2**20


@pytest.mark.skipif(real_model_path() is None, reason="SmolLM2-135M GGUF not installed")
def test_real_smollm2_config():
    m = load_gguf(real_model_path())
    c = m.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert (c.vocab_size, c.n_ctx_train, c.rope_base) == (49152, 8192, 100000.0)
    assert c.rms_eps == pytest.approx(1e-5, rel=1e-6)
    assert m.tied_output and m.file_type_name == "Q4_1"
    assert m.tensors["token_embd.weight"].ggml_type == quants.Q8_0
    assert {m.layer(i, "attn_v").ggml_type for i in range(30)} == {quants.Q4_1}
    assert np.shares_memory(m.layer(7, "ffn_up").data, m._reader.data)
    assert len(m.metadata["tokenizer.ggml.tokens"]) == 49152 and m.metadata["tokenizer.ggml.bos_token_id"] == 1
    assert len(m.tensor_table()) == 272


# ------------------------------------------------------------------------------------------------ bad files

def test_not_a_gguf_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("just some text that is long enough to have a header\n" * 4)
    with pytest.raises(GGUFError, match=r"notes\.txt.*not a GGUF file.*magic"):
        load_gguf(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match=r"empty\.gguf.*not a GGUF file"):
        load_gguf(empty)
    with pytest.raises(GGUFError, match=r"missing\.gguf.*cannot open"):
        load_gguf(tmp_path / "missing.gguf")


def test_truncated_in_the_data(synthetic, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = synthetic.read_bytes()
    cut.write_bytes(data[:len(data) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf.*truncated.*tensor '[^']+'.*file has only"):
        load_gguf(cut)


@pytest.mark.parametrize("keep", [30, 200, 2000, 9000])
def test_truncated_in_the_header(synthetic, tmp_path, keep):
    cut = tmp_path / f"head{keep}.gguf"
    cut.write_bytes(synthetic.read_bytes()[:keep])
    with pytest.raises(GGUFError, match=rf"head{keep}\.gguf.*(corrupt|truncated)"):
        load_gguf(cut)


@pytest.mark.parametrize("offset,value", [(16, 2**40), (24, 0xFFFF), (8, 99)],
                         ids=["kv_count", "key_len", "tensor_count"])
def test_corrupt_header(synthetic, tmp_path, offset, value):
    bad = tmp_path / "bad.gguf"
    data = bytearray(synthetic.read_bytes())
    data[offset:offset + 8] = int(value).to_bytes(8, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"bad\.gguf.*(corrupt|truncated)"):
        load_gguf(bad)


def test_random_garbage_after_magic(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(5):
        p = tmp_path / f"garbage{i}.gguf"
        p.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
        with pytest.raises(GGUFError, match=rf"garbage{i}\.gguf"):
            load_gguf(p)


def test_wrong_architecture(synthetic, tmp_path):
    path = rewrite(synthetic, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"gpt2\.gguf.*architecture 'gpt2'"):
        load_gguf(path)


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ2_XXS"])
def test_unsupported_tensor_type(tmp_path, qtype):
    # d_model 256 so that attn_q rows fit IQ2_XXS's 256-wide blocks too: the type is the file's only defect.
    src = write_synthetic_gguf(tmp_path / "wide.gguf", d_model=256, d_ff=256, n_heads=4, n_kv_heads=2, seed=2)
    t = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[t]
    raw = np.random.default_rng(0).integers(0, 256, (256, 256 // block * type_size), dtype=np.uint8)
    path = rewrite(src, tmp_path / "odd.gguf", replace_tensors={"blk.1.attn_q.weight": (raw, t)})
    with pytest.raises(UnsupportedModelError,
                       match=rf"odd\.gguf.*'blk\.1\.attn_q\.weight'.*type {qtype}.*supported types: .*Q4_0.*Q8_0"):
        load_gguf(path)


def test_missing_tensor(synthetic, tmp_path):
    path = rewrite(synthetic, tmp_path / "holes.gguf", drop_tensors={"blk.1.ffn_up.weight"})
    with pytest.raises(GGUFError, match=r"holes\.gguf.*missing tensor 'blk\.1\.ffn_up\.weight'.*\[128 x 64\]"):
        load_gguf(path)
    path = rewrite(synthetic, tmp_path / "nonorm.gguf", drop_tensors={"output_norm.weight"})
    with pytest.raises(GGUFError, match=r"missing tensor 'output_norm\.weight'"):
        load_gguf(path)


def test_wrong_shape(synthetic, tmp_path):
    wide = quants.quantize(np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32), quants.Q4_0)
    path = rewrite(synthetic, tmp_path / "shape.gguf",
                   replace_tensors={"blk.0.attn_q.weight": (wide, gguf.GGMLQuantizationType.Q4_0)})
    with pytest.raises(GGUFError, match=r"shape\.gguf.*'blk\.0\.attn_q\.weight'.*\[64 x 128\].*expected \[64 x 64\]"):
        load_gguf(path)
    short_norm = np.ones(32, np.float32)
    path = rewrite(synthetic, tmp_path / "norm.gguf", replace_tensors={"blk.1.ffn_norm.weight": (short_norm, None)})
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_norm\.weight'.*\[32\].*expected \[64\]"):
        load_gguf(path)


def test_missing_and_bad_keys(synthetic, tmp_path):
    path = rewrite(synthetic, tmp_path / "nokey.gguf", drop_keys={"llama.block_count"})
    with pytest.raises(GGUFError, match=r"nokey\.gguf.*missing metadata key 'llama\.block_count'"):
        load_gguf(path)
    path = rewrite(synthetic, tmp_path / "noeps.gguf", drop_keys={"llama.attention.layer_norm_rms_epsilon"})
    with pytest.raises(GGUFError, match=r"'llama\.attention\.layer_norm_rms_epsilon'"):
        load_gguf(path)
    path = rewrite(synthetic, tmp_path / "strkey.gguf",
                   set_keys={"llama.embedding_length": ("wide", gguf.GGUFValueType.STRING)})
    with pytest.raises(GGUFError, match=r"'llama\.embedding_length' should be int"):
        load_gguf(path)
    path = rewrite(synthetic, tmp_path / "rope.gguf",
                   set_keys={"llama.rope.dimension_count": (8, gguf.GGUFValueType.UINT32)})
    with pytest.raises(UnsupportedModelError, match=r"rope\.gguf.*dimension_count = 8.*head_dim = 16.*partial"):
        load_gguf(path)
    # More layers declared than stored: the first absent layer is named.
    path = rewrite(synthetic, tmp_path / "deep.gguf", set_keys={"llama.block_count": (3, gguf.GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.2\.attn_norm\.weight'"):
        load_gguf(path)


def test_optional_keys_have_defaults(tmp_path):
    src = write_synthetic_gguf(tmp_path / "mha.gguf", n_heads=4, n_kv_heads=4, rope_base=10000.0)
    path = rewrite(src, tmp_path / "lean.gguf", drop_keys={"llama.attention.head_count_kv", "llama.rope.freq_base",
                                                           "llama.vocab_size", "llama.rope.dimension_count"})
    c = load_gguf(path).config
    assert c.n_kv_heads == 4 and c.rope_base == 10000.0 and c.vocab_size == 512


# ------------------------------------------------------------------------------------------------ quantize_file

@pytest.mark.parametrize("target", ["q4_0", "q4_1", "q8_0", "f16"])
def test_quantize_file(tmp_path, target):
    src = write_synthetic_gguf(tmp_path / "src.gguf", quant="f32", tied=False, seed=3, d_model=64, d_ff=96)
    dst = quantize_file(src, tmp_path / f"out_{target}.gguf", target, progress=False)
    a, b = load_gguf(src), load_gguf(dst)
    assert b.config == a.config
    want = quants.parse_type(target)
    embd_want = quants.Q8_0 if target in ("q4_0", "q4_1") else want
    assert b.file_type_name == target.upper()
    assert b.metadata["general.file_type"] == {"q4_0": 2, "q4_1": 3, "q8_0": 7, "f16": 1}[target]
    for key, value in a.metadata.items():
        if key != "general.file_type":
            assert b.metadata[key] == value, key
    assert [r[0] for r in a.tensor_table()] == [r[0] for r in b.tensor_table()]
    for name, ta in a.tensors.items():
        tb = b.tensors[name]
        x, y = a.dequantized(name), b.dequantized(name)
        if ta.data.ndim == 1:
            assert tb.ggml_type == quants.F32
            np.testing.assert_array_equal(x, y)
            continue
        assert tb.ggml_type == (embd_want if name in ("token_embd.weight", "output.weight") else want), name
        # Identical to quantizing the source ourselves, hence within that type's round-trip error.
        np.testing.assert_array_equal(tb.data, quants.quantize(x, tb.ggml_type))
        step = np.abs(x).max() / {quants.Q4_0: 7, quants.Q4_1: 7, quants.Q8_0: 120, quants.F16: 1000}[tb.ggml_type]
        assert np.abs(x - y).max() <= step, name
        assert np.abs(x - y).max() > 0


def test_quantize_file_same_type_copies_bytes(tmp_path):
    src = write_synthetic_gguf(tmp_path / "q4.gguf", quant="q4_0", embd_quant="q8_0", seed=4)
    dst = quantize_file(src, tmp_path / "again.gguf", "q4_0", progress=False)
    a, b = load_gguf(src), load_gguf(dst)
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name].data, b.tensors[name].data)


def test_quantize_file_errors(synthetic, tmp_path):
    with pytest.raises(GGUFError, match="overwrite"):
        quantize_file(synthetic, synthetic, "q4_0", progress=False)
    link = tmp_path / "alias.gguf"
    os.symlink(synthetic, link)
    with pytest.raises(GGUFError, match="overwrite"):
        quantize_file(synthetic, link, "q8_0", progress=False)
    with pytest.raises(ValueError, match="q4_k"):  # K-quant targets are not offered (our K quantizers are simple)
        quantize_file(synthetic, tmp_path / "x.gguf", "q4_k", progress=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all" * 10)
    with pytest.raises(GGUFError, match=r"bad\.gguf.*not a GGUF"):
        quantize_file(bad, tmp_path / "y.gguf", "q4_0", progress=False)
    assert not (tmp_path / "y.gguf").exists()


def test_quantize_file_progress_bar(synthetic, tmp_path, capsys):
    shutil.copy(synthetic, tmp_path / "in.gguf")
    quantize_file(tmp_path / "in.gguf", tmp_path / "out.gguf", "q8_0", progress=True)
    err = capsys.readouterr().err
    assert "quantize q8_0" in err and "20/20" in err


def test_quantize_file_keeps_unused_tensors_of_other_types(synthetic, tmp_path):
    # Tensors of types metalattn does not read (here an IQ4_NL matrix and an I32 vector) are copied as they are.
    q5 = gguf.GGMLQuantizationType.IQ4_NL
    block, type_size = gguf.GGML_QUANT_SIZES[q5]
    raw = np.random.default_rng(1).integers(0, 256, (8, 64 // block * type_size), dtype=np.uint8)
    ints = np.arange(7, dtype=np.int32)
    src = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(os.fspath(src), "llama")
    _copy_metadata(gguf.GGUFReader(synthetic), writer, os.fspath(synthetic), {})
    reader = gguf.GGUFReader(synthetic)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type if t.data.dtype == np.uint8 else None)
    writer.add_tensor("extra.q5", raw, raw_dtype=q5)
    writer.add_tensor("extra.ids", ints)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = gguf.GGUFReader(quantize_file(src, tmp_path / "out.gguf", "q8_0", progress=False))
    by_name = {t.name: t for t in out.tensors}
    assert by_name["extra.q5"].tensor_type == q5 and list(by_name["extra.q5"].shape) == [64, 8]
    np.testing.assert_array_equal(by_name["extra.q5"].data, raw)
    np.testing.assert_array_equal(by_name["extra.ids"].data, ints)
    assert load_gguf(tmp_path / "out.gguf").tensors["blk.0.attn_q.weight"].ggml_type == quants.Q8_0
