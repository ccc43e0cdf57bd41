"""The real Gemma 3 270M and Qwen2.5-Coder-0.5B Q4_K_M files (when their packages are installed: see README),
against llama.cpp's reading of the same files: perplexity on tests/data/english_prose.txt (ctx 512, as llama.cpp's
perplexity tool counts it) within 1%, and greedy text that is the model's, not noise."""
from pathlib import Path

import pytest

import metalattn
from metalattn import registry
from metalattn.errors import MetalattnError
from metalattn.perplexity import perplexity

# llama.cpp's llama-perplexity -c 512 -t 2 on the same file and text, this VM, 2026-11-24 (benchmarks/RESULTS.md).
LLAMA_CPP_PPL = {"gemma3-270m": 20.4703, "qwen2.5-coder-0.5b": 32.5848}
PROSE = Path(__file__).resolve().parents[1] / "data" / "english_prose.txt"


def installed(name):
    try:
        return registry.resolve(name, progress=False)
    except MetalattnError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", list(LLAMA_CPP_PPL))
def test_perplexity_within_one_percent_of_llama_cpp(name):
    model = metalattn.load(installed(name), device="cpu", n_ctx=512)
    result = perplexity(model, PROSE.read_text(), ctx=512, progress=False)
    assert result["chunks"] == 7
    assert abs(result["perplexity"] / LLAMA_CPP_PPL[name] - 1) <= 0.01, result


@pytest.mark.parametrize("name,prompt,expect", [
    ("gemma3-270m", "Question: What is the capital of France?\nAnswer:", "Paris"),
    ("qwen2.5-coder-0.5b", "def fibonacci(n):", "return"),
])
def test_greedy_continuation(name, prompt, expect):
    model = metalattn.load(installed(name), device="cpu", n_ctx=512)
    assert expect in model.generate(prompt, max_tokens=16)


def test_qwen_chat_through_its_own_template():
    model = metalattn.load(installed("qwen2.5-coder-0.5b"), device="cpu", n_ctx=512)
    prompt = model.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.startswith("<|im_start|>system\nYou are Qwen")  # the file's template, with its default system turn
    answer = model.generate(prompt, max_tokens=32)
    assert "Paris" in answer and model.last_stats.finish_reason == "stop"  # <|im_end|> ends the turn
