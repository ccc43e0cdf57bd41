"""The GGUF mutation fuzzer (tests/fuzz/fuzz_gguf.py): a short seeded run, its determinism, and one regression test
per bug it found (each a minimal file built here, with the exact exception class and the file named)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import metalattn
from metalattn.errors import GGUFError, MetalattnError, UnsupportedModelError

FUZZ = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_gguf.py"


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_gguf", FUZZ)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_gguf"] = mod
    spec.loader.exec_module(mod)
    return mod


fz = _fuzz_module()


def test_short_fuzz_run_has_no_crash_hang_or_foreign_exception(tmp_path):
    """300 cases over every seed file (2 workers, ~1 minute): only ok or MetalattnError."""
    out = tmp_path / "summary.json"
    run = subprocess.run([sys.executable, str(FUZZ), "--seed", "20261124", "--cases", "300", "--jobs", "2",
                          "--timeout", "60", "--mem", "2048", "--json", str(out), "-q",
                          "--corpus", str(tmp_path / "corpus")], capture_output=True, text=True, timeout=600)
    summary = json.loads(out.read_text())
    assert run.returncode == 0, run.stdout + run.stderr
    o = summary["outcomes"]
    assert sum(o.values()) == 300
    assert not any(o.get(k) for k in fz.BAD_OUTCOMES), summary["failures"]
    assert o.get("ok", 0) > 10 and o.get("metalattn", 0) > 100  # both kinds of outcome are exercised
    names = {name for name, _ in fz._seed_specs()}
    assert names <= set(summary["seed_files"])


def test_cases_are_reproducible(tmp_path):
    corpus = fz.build_corpus(tmp_path / "corpus")
    for index in (0, 7, 123):
        a = fz.make_case(5, index, corpus, {}, str(tmp_path / "a.gguf"))
        b = fz.make_case(5, index, corpus, {}, str(tmp_path / "b.gguf"))
        assert a == b
        assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    c = fz.make_case(6, 7, corpus, {}, str(tmp_path / "c.gguf"))
    d = fz.make_case(5, 7, corpus, {}, str(tmp_path / "d.gguf"))
    assert (c, (tmp_path / "c.gguf").read_bytes()) != (d, (tmp_path / "d.gguf").read_bytes())


def test_unmutated_seeds_load_and_generate(tmp_path):
    """Every seed file round-trips through the fuzzer's parser and writer and runs (so mutations start from valid
    files of every architecture and type)."""
    corpus = fz.build_corpus(tmp_path / "corpus")
    corpus.pop("real_smollm2", None)
    for name, path in corpus.items():
        g = fz.parse(path)
        header, _, start, n = fz.serialize(g)
        out = tmp_path / f"{name}.gguf"
        out.write_bytes(header + g.data)
        assert out.read_bytes() == Path(path).read_bytes(), name
        fz.run_case(str(out), dict(check_tensors=True, n_ctx=None, sample=True, chat=True), "cpu")


# ------------------------------------------------------------------------------------------------ regressions

def _mutated(tmp_path, seed_name, mutate, name="case.gguf"):
    """A seed file with `mutate(GGUF)` applied, written to tmp_path/name."""
    corpus = fz.build_corpus(tmp_path / "corpus")
    g = fz.parse(corpus[seed_name])
    mutate(g)
    header, _, _, _ = fz.serialize(g)
    path = tmp_path / name
    path.write_bytes(header + g.data)
    return path


def _set(g, key, value, vtype=None):
    for kv in g.kvs:
        if kv[0] == key.encode():
            kv[2] = value
            if vtype is not None:
                kv[1] = vtype
            return
    g.kvs.append([key.encode(), vtype, value])


def _load_fails(path, cls, *words):
    with pytest.raises(cls) as e:
        metalattn.load(path, device="cpu", n_threads=1).generate("hello", max_tokens=2)
    assert type(e.value) is cls, repr(e.value)
    msg = str(e.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return e.value


@pytest.mark.parametrize("seed_name", ["llama_q4_0", "gemma3"])
def test_huge_block_count_is_refused_before_looping_over_layers(tmp_path, seed_name):
    # Found by seed 1 case 91: block_count 2^32-1 made load_gguf build per-layer tables until it ran out of memory.
    arch = "gemma3" if seed_name == "gemma3" else "llama"
    path = _mutated(tmp_path, seed_name, lambda g: _set(g, f"{arch}.block_count", 2**32 - 1))
    _load_fails(path, GGUFError, f"{arch}.block_count", "tensors")


@pytest.mark.parametrize("vtype,value", [(fz.ARRAY, (fz.STRING, [b"llama"])), (fz.U32, 7), (fz.F32, 1.5)])
def test_architecture_of_the_wrong_type(tmp_path, vtype, value):
    # Found by seed 2 case 110: an array-valued general.architecture reached `arch in ARCHITECTURES` (TypeError).
    path = _mutated(tmp_path, "llama_f16", lambda g: _set(g, "general.architecture", value, vtype))
    _load_fails(path, GGUFError, "'general.architecture' should be a string")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 64.5])
def test_integer_key_holding_a_non_integral_float(tmp_path, value):
    # Found by seed 3 cases 1338 / 1427: an F64 inf in embedding_length / head_count reached int(inf) (OverflowError).
    path = _mutated(tmp_path, "llama_bf16", lambda g: _set(g, "llama.embedding_length", value, fz.F64))
    _load_fails(path, GGUFError, "'llama.embedding_length' should be int")


def test_fewer_tokens_than_the_vocabulary(tmp_path):
    # A tokens array shorter than token_embd: ids the model can emit would not decode (a TokenError mid-generation,
    # not naming the file); now refused at load.
    def cut(g):
        for kv in g.kvs:
            if kv[0] == b"tokenizer.ggml.tokens":
                kv[2] = (kv[2][0], kv[2][1][:-10])
            if kv[0] in (b"tokenizer.ggml.token_type", b"tokenizer.ggml.scores"):
                kv[2] = (kv[2][0], kv[2][1][:-10])

    path = _mutated(tmp_path, "llama_q4_0", cut)
    _load_fails(path, GGUFError, "tokenizer.ggml.tokens holds 310 tokens", "320")


@pytest.mark.parametrize("vtype,value", [(fz.F64, float("inf")), (fz.F32, float("nan")), (fz.STRING, b"Q4_0"),
                                         (fz.U32, 2**32 - 1)])
def test_odd_general_file_type_is_only_a_label(tmp_path, vtype, value):
    # Found by seed 1 case 4144 of the long run: general.file_type = F64 inf reached int(inf) (OverflowError).
    # The key only names the file's type for `metalattn info`: an odd value is shown as it is, and the model runs.
    path = _mutated(tmp_path, "llama_q4_0", lambda g: _set(g, "general.file_type", value, vtype))
    with metalattn.load(path, device="cpu", n_threads=1) as model:
        assert model.gguf.file_type_name.startswith("file_type ")
        assert model.generate("hello", max_tokens=2) is not None


@pytest.mark.parametrize("key,value", [("llama.rope.freq_base", 0.0), ("llama.rope.freq_base", float("nan")),
                                       ("llama.rope.freq_base", -1e4),
                                       ("llama.attention.layer_norm_rms_epsilon", float("inf")),
                                       ("llama.attention.layer_norm_rms_epsilon", -1e-5)])
def test_rope_base_and_epsilon_out_of_domain(tmp_path, key, value):
    # Found by the 10,000-case run (seed 1): 29 files with a zero / negative / NaN RoPE base got past the loader and
    # were refused by the C++ engine as a bare MetalattnError ("could not set up the cpu backend"); now a GGUFError
    # naming the key.
    path = _mutated(tmp_path, "llama_q4_0", lambda g: _set(g, key, value, fz.F32))
    _load_fails(path, GGUFError, repr(key))


def test_rope_scaling_factor_and_windowed_base_out_of_domain(tmp_path):
    path = _mutated(tmp_path, "llama_q4_0", lambda g: (_set(g, "llama.rope.scaling.type", b"linear", fz.STRING),
                                                       _set(g, "llama.rope.scaling.factor", float("nan"), fz.F32)),
                    name="factor.gguf")
    _load_fails(path, GGUFError, "llama.rope.scaling.factor must be positive")
    path = _mutated(tmp_path, "gemma3", lambda g: _set(g, "gemma3.rope.freq_base_swa", 0.0, fz.F32), name="swa.gguf")
    _load_fails(path, GGUFError, "'gemma3.rope.freq_base_swa' must be a positive number")


@pytest.mark.parametrize("count", [2**40, 2**63, 5000])
def test_metadata_array_count_past_the_end_of_the_file(tmp_path, count):
    # Found by seed 4 case 4973 of a 10,000-case run (a hang): the gguf reader slices past the end of the map and
    # gets 0-byte items, so an array count planted in the header looped "forever". Now refused up front.
    corpus = fz.build_corpus(tmp_path / "corpus")
    g = fz.parse(corpus["llama_q4_0"])
    g.kvs.insert(0, [b"x.big", fz.ARRAY, (fz.U8, [1, 2, 3])])
    header, fields, _, _ = fz.serialize(g)
    buf = bytearray(header + g.data)
    kind, off, size = next(f for f in fields if f[0] == "arrlen")  # the first array is ours
    buf[off:off + 8] = count.to_bytes(8, "little")
    path = tmp_path / "count.gguf"
    path.write_bytes(bytes(buf[:3000]))  # and cut short, as the fuzzer's case was
    t = __import__("time").perf_counter()
    _load_fails(path, GGUFError, "claims", str(count))
    assert __import__("time").perf_counter() - t < 5
