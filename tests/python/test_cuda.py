"""The CUDA backend against the CPU engine on identical weights (the real model does not travel to the GPU
machine, so a synthetic SmolLM2-shaped model stands in). Skips cleanly where no GPU is present."""

import numpy as np
import pytest

import metalattn
from metalattn import _core

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


def test_debug_hidden_states_match_cpu(smollm2_shaped, pair):
    cpu, _ = pair
    dbg = metalattn.load(smollm2_shaped, device="cuda", n_ctx=64, debug=True)
    cpu.reset()
    hg, lg = dbg.forward_token_debug(17)
    hc, lc = cpu.forward_token_debug(17)
    for layer in range(hc.shape[0]):
        assert rel_l2(hg[layer], hc[layer]) <= 1e-4, f"hidden state after layer {layer - 1}"
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
        metalattn.load(gpu.path, device="cuda", n_ctx=2_000_000)  # ~92 GB of float KV cache: more than the GPU
