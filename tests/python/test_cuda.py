"""The CUDA backend against the CPU engine on identical weights (the real model does not travel to the GPU
machine, so a synthetic SmolLM2-shaped model stands in). Skips cleanly where no GPU is present."""

import numpy as np
import pytest

import metalattn
from metalattn import _core

from test_sampling import host_could_draw

pytestmark = pytest.mark.skipif(not (_core.cuda_compiled() and _core.cuda_device_count() > 0),
                                reason="no CUDA device (or this build has no CUDA backend)")

REL_L2 = 1e-3  # CUDA (float activations) vs the scalar CPU reference path, per logits row


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    from metalattn.testing import SMOLLM2_135M, write_synthetic_gguf

    path = tmp_path_factory.mktemp("cuda") / "smollm2_shape_q4_0.gguf"
    write_synthetic_gguf(path, **SMOLLM2_135M)
    return path


@pytest.fixture(scope="module")
def pair(smollm2_shaped):
    mp = pytest.MonkeyPatch()
    mp.setenv("METALATTN_CPU_ISA", "scalar")
    cpu = metalattn.load(smollm2_shaped, device="cpu", n_ctx=2048)
    mp.undo()
    gpu = metalattn.load(smollm2_shaped, device="cuda", n_ctx=2048)
    return cpu, gpu


def test_decode_logits_match_cpu(pair):
    cpu, gpu = pair
    cpu.reset()
    gpu.reset()
    for t in np.random.default_rng(0).integers(0, cpu.vocab_size, size=8):
        a, b = gpu.forward_token(t), cpu.forward_token(t)
        assert rel_l2(a, b) <= REL_L2
        assert int(np.argmax(a)) == int(np.argmax(b))


def test_greedy_generation_identical_to_cpu(pair):
    cpu, gpu = pair
    prompt = list(np.random.default_rng(1).integers(300, cpu.vocab_size, size=32))
    a = [c.token for c in gpu.stream(prompt, max_tokens=128)]
    b = [c.token for c in cpu.stream(prompt, max_tokens=128)]
    assert a == b


def test_sampled_decoding_draws_on_the_device(pair):
    """Sampled decoding draws on the GPU (forward_token_sample, 8 bytes back): top_k=1 is greedy, and every step's
    draw is what the host's sample_logits draws from that step's logits with the same uniform, up to a uniform or
    top_p within 1e-6 of a boundary (expf on the device, the host's vectorised exp). The synthetic model's rows are
    flat, so its top_p nuclei hold thousands of tokens and take the device's token-id-order draw."""
    _, gpu = pair
    prompt = list(np.random.default_rng(2).integers(300, gpu.vocab_size, size=32))
    greedy = [c.token for c in gpu.stream(prompt, max_tokens=64)]
    assert [c.token for c in gpu.stream(prompt, max_tokens=64, temperature=0.8, top_k=1, seed=3)] == greedy
    for kw in [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 40}, {"temperature": 1.0, "top_p": 0.9},
               {"temperature": 0.5, "top_k": 300, "top_p": 0.7},
               {"temperature": 1.0, "top_k": 2000},  # past the device's 1,024: drawn on the host
               {"temperature": 1.0, "top_k": gpu.vocab_size + 5}]:  # the whole vocabulary or more: no filter
        got = [c.token for c in gpu.stream(prompt, max_tokens=48, seed=4, **kw)]
        assert len(got) == 48
        args = (kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))
        rng = np.random.default_rng(4)
        gpu.reset()
        logits = gpu._engine.forward_prompt_logits(np.asarray(prompt, np.int32), False)
        boundary = 0
        for i, tok in enumerate(got):  # the stream's own tokens fed back: its draws must follow from them
            u = rng.random()
            want = _core.sample_logits(logits, *args, u)
            if want != tok:
                boundary += 1
                assert host_could_draw(logits, *args, u, tok), f"step {i}: drew {tok}, the host {want} ({kw})"
            if i + 1 < len(got):
                logits = gpu._engine.forward_token(tok)
        assert boundary <= 2, kw
    assert [c.token for c in gpu.stream(prompt, max_tokens=64)] == greedy


def test_debug_hidden_states_match_cpu(smollm2_shaped, pair):
    cpu, _ = pair
    dbg = metalattn.load(smollm2_shaped, device="cuda", n_ctx=64, debug=True)
    cpu.reset()
    hg, lg = dbg.forward_token_debug(17)
    hc, lc = cpu.forward_token_debug(17)
    for layer in range(hc.shape[0]):
        # 2e-4 since the K/V cache is fp16 on both backends (was 1e-4): where the two backends' fp32 k or v differ in
        # the last bit across a rounding boundary, the cached values differ by an fp16 ulp. Measured 1.01e-4 (H100).
        err = rel_l2(hg[layer], hc[layer])
        assert err <= 2e-4, f"hidden state after layer {layer - 1}: rel L2 {err:.2e}"
    assert rel_l2(lg, lc) <= REL_L2


@pytest.mark.parametrize("n", [1, 7, 32, 129, 512, 2048])
def test_prompt_matches_token_by_token(pair, n):
    _, gpu = pair
    tokens = np.random.default_rng(n).integers(0, gpu.vocab_size, size=n)
    gpu.reset()
    step = None
    for t in tokens:
        step = gpu.forward_token(t)
    gpu.reset()
    prompt = gpu.forward_prompt_logits(tokens)
    assert rel_l2(prompt, step) <= REL_L2
    assert int(np.argmax(prompt)) == int(np.argmax(step))
    gpu.reset()
    assert gpu.forward_prompt(tokens) == int(np.argmax(step))
    assert gpu.pos == n


def test_memory_info_and_no_growth(smollm2_shaped):
    m = metalattn.load(smollm2_shaped, device="cuda", n_ctx=256)
    info = m.memory_info()
    assert info["weights"] > 50e6 and info["kv_cache"] > 0 and info["scratch"] > 0
    before = _core.cuda_device_memory_used()
    for _ in range(100):  # load (a fresh engine over the parsed file), generate, reset, free
        m._engine = m._make_engine()
        m.generate([1, 2, 3], max_tokens=4)
        m.reset()
    m._engine = None
    m._engine = m._make_engine()
    after = _core.cuda_device_memory_used()
    assert after - before <= 4 << 20, f"device memory grew by {(after - before) / 2**20:.1f} MiB"


def test_errors(pair):
    _, gpu = pair
    gpu.reset()
    with pytest.raises(metalattn.TokenError):
        gpu.forward_token_greedy(gpu.vocab_size)
    with pytest.raises(metalattn.ContextOverflowError):
        gpu.forward_prompt([1] * 2049)
    with pytest.raises(metalattn.DeviceError, match="memory"):
        metalattn.load(gpu.path, device="cuda", n_ctx=8_000_000)  # ~184 GB of fp16 KV cache: more than the GPU


# ---------------------------------------------------------------- every architecture on the CUDA general path
# Synthetic models of each architecture ModelSpec describes, the CUDA backend against the scalar CPU backend (and the
# float64 reference) on identical weights: decode and prompt logits at every position (well past the sliding
# windows), the residual stream, and 64 greedy tokens. Then the real models' layer shapes (fewer layers, a smaller
# vocabulary) across Gemma 3's 512-position window.

ARCH_CASES = {
    "qwen2": dict(arch="qwen2", d_model=128, d_ff=256, n_heads=4, n_kv_heads=2, tied=False, rope_base=1e6),
    "qwen2-hd64-group7": dict(arch="qwen2", d_model=448, d_ff=512, n_heads=7, n_kv_heads=1, rope_base=1e6),
    "qwen3": dict(arch="qwen3", d_model=128, head_dim=128, n_heads=4, n_kv_heads=2, tied=False),
    # 3 layers, pattern 3: two windowed layers (window 16, base 10000), one global (base 1e6); head_dim 256.
    "gemma3": dict(arch="gemma3", d_model=128, d_ff=256, head_dim=256, n_heads=4, n_kv_heads=1, n_layers=3,
                   sliding_window=16, swa_pattern=3, rope_base=1e6),
    "gemma3-no-window": dict(arch="gemma3", d_model=64, head_dim=32, n_heads=2, n_kv_heads=1),
    "llama-linear-rope": dict(arch="llama", n_heads=2, n_kv_heads=1, rope_scale=0.25, tied=False),
    # The plain Llama layer with Llama 3 RoPE factors runs the fused path, the factors in its RoPE table.
    "llama3-rope-freqs": dict(arch="llama", d_model=128, d_ff=256, n_heads=2, n_kv_heads=1, rope_freqs=True,
                              tied=False),
}
ARCH_TOKENS = 96


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    from metalattn.testing import write_synthetic_gguf

    root = tmp_path_factory.mktemp("cuda_arch")
    return {name: write_synthetic_gguf(root / f"{name}.gguf", quant="q8_0", n_ctx=256, seed=11, **kw)
            for name, kw in ARCH_CASES.items()}


def arch_pair(path, n_ctx=256):
    mp = pytest.MonkeyPatch()
    mp.setenv("METALATTN_CPU_ISA", "scalar")
    cpu = metalattn.load(path, device="cpu", n_ctx=n_ctx)
    mp.undo()
    gpu = metalattn.load(path, device="cuda", n_ctx=n_ctx)
    assert gpu.device == "cuda"
    return cpu, gpu


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_arch_decode_and_prompt_match_cpu(arch_models, case):
    from metalattn.testing import reference_forward

    cpu, gpu = arch_pair(arch_models[case])
    tokens = np.random.default_rng(3).integers(0, cpu.vocab_size, ARCH_TOKENS).tolist()
    want = np.stack([cpu.forward_token(t) for t in tokens])
    got = np.stack([gpu.forward_token(t) for t in tokens])
    gpu.reset()
    prompt = gpu.forward_prompt_logits(tokens, all_tokens=True)
    ref = reference_forward(gpu.gguf, tokens)
    for i in range(len(tokens)):
        assert rel_l2(got[i], want[i]) <= REL_L2, f"decode, position {i}"
        assert rel_l2(prompt[i], want[i]) <= REL_L2, f"prompt, position {i}"
        assert rel_l2(prompt[i], ref[i]) <= REL_L2, f"prompt vs float64 reference, position {i}"
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.97
    assert (prompt.argmax(1) == want.argmax(1)).mean() >= 0.97
    # The same tokens in two prompt pieces, the second continuing from the cache.
    gpu.reset()
    gpu.forward_prompt(tokens[:41])
    rest = gpu.forward_prompt_logits(tokens[41:])
    assert rel_l2(rest, want[-1]) <= REL_L2


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_arch_greedy_64_identical_to_cpu(arch_models, case):
    cpu, gpu = arch_pair(arch_models[case])
    prompt = list(np.random.default_rng(5).integers(3, cpu.vocab_size, size=16))
    a = [c.token for c in gpu.stream(prompt, max_tokens=64)]
    b = [c.token for c in cpu.stream(prompt, max_tokens=64)]
    assert a == b


@pytest.mark.parametrize("case", ["gemma3", "qwen2", "qwen3"])
def test_arch_debug_hidden_states_match_cpu(arch_models, case):
    cpu, _ = arch_pair(arch_models[case])
    dbg = metalattn.load(arch_models[case], device="cuda", n_ctx=64, debug=True)
    for t in (5, 17, 300, 42):
        hg, lg = dbg.forward_token_debug(t)
        hc, lc = cpu.forward_token_debug(t)
        for layer in range(hc.shape[0]):
            assert rel_l2(hg[layer], hc[layer]) <= 1e-4, f"hidden state after layer {layer - 1}"
        assert rel_l2(lg, lc) <= REL_L2


def test_arch_kernels_per_token_and_auto_device(arch_models):
    # embedding + per layer (QKV, finish+attention, O, gate/up + GLU, down) + lm_head; post-norms fold into the next
    # layer's kernels, except the last layer's (one more launch)
    expect = {
        "qwen3": 2 + 5 * 2, "gemma3": 2 + 5 * 3 + 1, "llama-linear-rope": 2 + 5 * 2,
        "llama3-rope-freqs": 5 * 2 + 1,  # the plain Llama layer keeps its fused five kernels
        "qwen2": 5 * 2 + 1,  # biases and NeoX pairs: decode on the fused kernels too (prompts on the plain path's)
    }
    for case, n in expect.items():
        m = metalattn.load(arch_models[case], device="auto", n_ctx=64)
        assert m.device == "cuda", case
        assert m._engine.kernels_per_token == n, case


# The real models' layer shapes (layers and vocabulary cut down; Q8_0 unless stated, and once the Gemma 3 270M
# Q4_K_M file's tensor types).
_GEMMA3_270M_LAYERS = dict(arch="gemma3", n_layers=6, d_model=640, d_ff=2048, n_heads=4, n_kv_heads=1, head_dim=256,
                           rope_base=1e6, rms_eps=1e-6, sliding_window=512, swa_pattern=6, tied=True)
REAL_SHAPES = {
    # Gemma 3 270M: 6 layers so that layer 5 is global (pattern 6), window 512.
    "gemma3-270m": _GEMMA3_270M_LAYERS,
    "gemma3-270m-q4_k_m-types": dict(
        _GEMMA3_270M_LAYERS, quant="q5_0", embd_quant="q8_0",
        quants_by_part={"attn_output": "q4_k", "attn_v": ["q8_0", "q5_0", "q5_0", "q8_0", "q5_0", "q8_0"],
                        "ffn_down": ["q6_k", "q4_k", "q4_k", "q6_k", "q4_k", "q6_k"]}),
    "qwen2.5-0.5b": dict(arch="qwen2", n_layers=3, d_model=896, d_ff=4864, n_heads=14, n_kv_heads=2, rope_base=1e6,
                         rms_eps=1e-6, tied=False),
    "qwen3-0.6b": dict(arch="qwen3", n_layers=3, d_model=1024, d_ff=3072, n_heads=16, n_kv_heads=8, head_dim=128,
                       rope_base=1e6, rms_eps=1e-6, tied=True),
}


@pytest.mark.parametrize("case", list(REAL_SHAPES))
def test_arch_real_shapes_across_the_window(tmp_path_factory, case):
    from metalattn.testing import write_synthetic_gguf

    kw = {"quant": "q8_0", **REAL_SHAPES[case]}
    path = write_synthetic_gguf(tmp_path_factory.mktemp("real") / f"{case}.gguf", vocab_size=8192, n_ctx=1024, seed=2,
                                **kw)
    cpu = metalattn.load(path, device="cpu", n_ctx=1024)  # the SIMD paths: this is the larger model
    gpu = metalattn.load(path, device="cuda", n_ctx=1024)
    n = 600
    tokens = np.random.default_rng(9).integers(0, cpu.vocab_size, n).tolist()
    want = cpu.forward_prompt_logits(tokens, all_tokens=True)
    got = gpu.forward_prompt_logits(tokens, all_tokens=True)
    gpu.reset()
    dec = np.stack([gpu.forward_token(t) for t in tokens])
    for i in (0, 1, 100, 510, 511, 512, 513, 599):
        assert rel_l2(got[i], want[i]) <= REL_L2, f"prompt vs CPU, position {i}"
        assert rel_l2(dec[i], want[i]) <= REL_L2, f"decode vs CPU, position {i}"
        assert rel_l2(dec[i], got[i]) <= REL_L2, f"decode vs prompt, position {i}"
    assert (dec.argmax(1) == want.argmax(1)).mean() >= 0.97
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.97


# ---------------------------------------------------------------- the tensor types of real Q4_K_M files
# Synthetic models whose per-layer tensor types follow the real files (metalattn.testing's presets and llama.cpp's
# Q4_K_M choices), on the CUDA backend against the scalar CPU backend: Q5_0 / Q8_0 rows where the row length is not a
# multiple of 256, Q4_K / Q6_K where it is (a Q4_K q, k with a Q6_K v stack as the wide int8 layout on the GPU).

def _more_bits(n, big, small):
    return [big if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2 else small for i in range(n)]


QUANT_CASES = {
    # SmolLM2-135M Q4_K_M: 576-wide rows fall back to Q5_0 / Q8_0, the 1536-wide down projection is a K-quant.
    "smollm2-q4_k_m": dict(n_layers=4, d_model=576, d_ff=1536, n_heads=9, n_kv_heads=3, rope_base=100000.0,
                           quant="q5_0", embd_quant="q8_0", tied=True,
                           quants_by_part={"attn_v": _more_bits(4, "q8_0", "q5_0"),
                                           "ffn_down": _more_bits(4, "q6_k", "q4_k")}),
    # Llama 3.2 1B Q4_K_M (narrower): Q4_K everywhere, Q6_K v and down in some layers, tied Q6_K embedding.
    "llama-q4_k_m": dict(n_layers=4, d_model=512, d_ff=1536, n_heads=8, n_kv_heads=2, rope_base=500000.0,
                         quant="q4_k", embd_quant="q6_k", tied=True,
                         quants_by_part={"attn_v": _more_bits(4, "q6_k", "q4_k"),
                                         "ffn_down": _more_bits(4, "q6_k", "q4_k")}),
    # Q5_K_M-like with Q5_1 attention output, an untied Q6_K output.
    "llama-q5_k_m": dict(n_layers=3, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=4, quant="q5_k",
                         embd_quant="q5_k", output_quant="q6_k", tied=False,
                         quants_by_part={"attn_v": "q6_k", "attn_output": "q5_1", "ffn_down": "q6_k"}),
    # Qwen2.5-0.5B's shapes and per-layer types (qwen2: the fused decode kernels and the plain path's prompt kernels),
    # fewer layers.
    "qwen2.5-0.5b-q4_k_m": dict(arch="qwen2", n_layers=3, d_model=896, d_ff=4864, n_heads=14, n_kv_heads=2,
                                rope_base=1e6, rms_eps=1e-6, quant="q5_0", embd_quant="q5_0", output_quant="q8_0",
                                tied=False, quants_by_part={"attn_v": ["q8_0", "q5_0", "q8_0"],
                                                            "ffn_down": ["q6_k", "q4_k", "q6_k"]}),
}
QUANT_TOKENS = 48


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory):
    from metalattn.testing import write_synthetic_gguf

    root = tmp_path_factory.mktemp("cuda_quants")
    return {name: write_synthetic_gguf(root / f"{name}.gguf", vocab_size=2048, n_ctx=256, seed=7, **kw)
            for name, kw in QUANT_CASES.items()}


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quant_types_decode_and_prompt_match_cpu(quant_models, case):
    cpu, gpu = arch_pair(quant_models[case])
    tokens = np.random.default_rng(4).integers(0, cpu.vocab_size, QUANT_TOKENS).tolist()
    want = np.stack([cpu.forward_token(t) for t in tokens])
    got = np.stack([gpu.forward_token(t) for t in tokens])
    gpu.reset()
    prompt = gpu.forward_prompt_logits(tokens, all_tokens=True)
    for i in range(len(tokens)):
        assert rel_l2(got[i], want[i]) <= REL_L2, f"decode, position {i}"
        assert rel_l2(prompt[i], want[i]) <= REL_L2, f"prompt, position {i}"
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.97
    assert (prompt.argmax(1) == want.argmax(1)).mean() >= 0.97
    gpu.reset()
    gpu.forward_prompt(tokens[:20])
    rest = gpu.forward_prompt_logits(tokens[20:])
    assert rel_l2(rest, want[-1]) <= REL_L2


@pytest.mark.parametrize("case", ["smollm2-q4_k_m", "llama-q4_k_m"])
def test_quant_types_greedy_identical_to_cpu(quant_models, case):
    cpu, gpu = arch_pair(quant_models[case])
    prompt = list(np.random.default_rng(6).integers(3, cpu.vocab_size, size=16))
    a = [c.token for c in gpu.stream(prompt, max_tokens=48)]
    b = [c.token for c in cpu.stream(prompt, max_tokens=48)]
    assert a == b


def test_quant_types_load_on_auto_device(quant_models):
    for case, path in quant_models.items():
        m = metalattn.load(path, device="auto", n_ctx=64)
        assert m.device == "cuda", case


def test_device_name_is_reported():
    name = _core.cuda_device_name()
    assert isinstance(name, str) and name  # e.g. "NVIDIA H100 80GB HBM3"; bench's JSON carries it as "hardware"
