"""Every architecture feature of gguf_model.ARCHITECTURES, each on a synthetic model against the float64 reference:
Llama 3 rope_freqs and linear RoPE scaling, Qwen 2 biases, Qwen 3 QK-norm with a stated head size, Gemma 3 (embedding
scale, QK-norm, post-norms, GELU, sliding-window layers with their own RoPE base), on every CPU dispatch path, as a
prompt and token by token. Then the reference's own structure for the new features, and the errors."""

import math

import numpy as np
import pytest

import metalattn
from metalattn import _core
from metalattn.gguf_model import load_gguf
from metalattn.testing import _rope, reference_forward, write_synthetic_gguf

REL_L2 = 1e-3  # as test_engine: scalar float path and int16-activation SIMD paths alike

CASES = {
    "llama3-rope-freqs": dict(arch="llama", rope_freqs=True, tied=False),
    "llama-linear-rope": dict(arch="llama", rope_scale=0.25),
    "qwen2": dict(arch="qwen2", tied=False, rope_base=1e6),
    "qwen3": dict(arch="qwen3", d_model=64, head_dim=32, n_heads=4, n_kv_heads=2),
    # 3 layers with pattern 3: two windowed layers (window 8, RoPE base 10000) and one global (base 1e6);
    # 40 tokens run well past the window.
    "gemma3": dict(arch="gemma3", d_model=64, head_dim=32, n_heads=4, n_kv_heads=1, n_layers=3, sliding_window=8,
                   swa_pattern=3, rope_base=1e6),
    "gemma3-no-window": dict(arch="gemma3", d_model=64, head_dim=32, n_heads=2, n_kv_heads=1),
}


def isas():
    best = {"scalar": 0, "avx2": 1, "avx512": 2}[_core.cpu_isa()]
    return ["scalar", "avx2", "avx512"][: best + 1]


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch")
    return {name: write_synthetic_gguf(root / f"{name}.gguf", quant="q8_0", n_ctx=64, seed=11, **kw)
            for name, kw in CASES.items()}


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("case", list(CASES))
def test_prompt_and_decode_match_reference(models, monkeypatch, case, isa):
    monkeypatch.setenv("METALATTN_CPU_ISA", isa)
    model = metalattn.load(models[case], device="cpu", n_threads=2)
    tokens = np.random.default_rng(1).integers(0, model.vocab_size, 40).tolist()
    ref = reference_forward(model.gguf, tokens)
    prompt = model.forward_prompt_logits(tokens, all_tokens=True)
    model.reset()
    decode = np.stack([model.forward_token(t) for t in tokens])
    for i in range(len(tokens)):
        assert rel_l2(prompt[i], ref[i]) <= REL_L2, f"prompt, position {i}"
        assert rel_l2(decode[i], ref[i]) <= REL_L2, f"decode, position {i}"
    assert (prompt.argmax(1) == ref.argmax(1)).mean() >= 0.95


def test_configs_describe_each_architecture(models):
    cfg = {name: load_gguf(p).config for name, p in models.items()}
    assert cfg["qwen2"].rope_style == "neox" and cfg["qwen2"].attn_bias and not cfg["qwen2"].qk_norm
    assert cfg["qwen3"].head_dim == 32 and cfg["qwen3"].q_dim == 128 and cfg["qwen3"].qk_norm
    g = cfg["gemma3"]
    assert g.activation == "gelu_tanh" and g.post_norms and g.qk_norm
    assert g.embed_scale == pytest.approx(8.0)  # sqrt(64)
    assert g.layers == ((10000.0, 1.0, 8), (10000.0, 1.0, 8), (1e6, 1.0, 0))
    assert cfg["gemma3-no-window"].layers == ()
    assert cfg["llama-linear-rope"].layers == ((10000.0, 0.25, 0),) * 2
    assert "rope_freqs.weight" in load_gguf(models["llama3-rope-freqs"]).tensors


def test_reference_sliding_window_forgets(models):
    # With every layer windowed (8), each layer reaches 7 positions further back: after 3 layers a token can only
    # influence the next 21 positions. (The synthetic file's global third layer is swapped for a windowed one.)
    model = load_gguf(models["gemma3"])
    cfg = model.config
    windowed = cfg.__class__(**{**cfg.__dict__, "layers": tuple((10000.0, 1.0, 8) for _ in range(cfg.n_layers))})
    model.config = windowed
    try:
        a = np.random.default_rng(2).integers(0, 512, 30).tolist()
        b = [a[0] + 1] + a[1:]
        la, lb = reference_forward(model, a), reference_forward(model, b)
        assert np.abs(la[-1] - lb[-1]).max() == 0.0            # position 29: out of reach
        assert np.abs(la[5] - lb[5]).max() > 1e-6               # position 5 still sees token 0
    finally:
        model.config = cfg


def test_reference_neox_rope_pairs_halves():
    x = np.zeros((2, 1, 8))
    x[:, 0, 0] = 1.0  # dim 0 pairs with dim 4 in the NeoX layout
    out = _rope(x, np.array([0, 1]), 10000.0, style="neox")
    np.testing.assert_allclose(out[1, 0, [0, 4]], [math.cos(1.0), math.sin(1.0)], atol=1e-12)
    assert np.all(out[1, 0, [1, 2, 3, 5, 6, 7]] == 0.0)


def test_missing_architecture_tensor_is_named(tmp_path):
    import gguf

    src = write_synthetic_gguf(tmp_path / "q.gguf", arch="qwen2", quant="f32")
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(tmp_path / "broken.gguf", "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        sub = field.types[-1] if field.types and field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name != "blk.1.attn_k.bias":
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(metalattn.GGUFError, match="blk.1.attn_k.bias"):
        load_gguf(tmp_path / "broken.gguf")


def test_unsupported_architecture_names_what_runs(tmp_path):
    import gguf

    w = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi2")
    w.add_uint32("phi2.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(metalattn.UnsupportedModelError, match=r"phi2.*gemma3.*llama.*qwen2.*qwen3"):
        load_gguf(tmp_path / "phi.gguf")
