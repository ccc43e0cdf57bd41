"""Exceptions raised by metalattn. Every one derives from MetalattnError (and from the builtin that fits)."""


class MetalattnError(Exception):
    """Base class of every error metalattn raises on purpose."""


class GGUFError(MetalattnError, ValueError):
    """A GGUF file is unreadable, truncated, corrupt, or lacks a key or tensor the model needs."""


class UnsupportedModelError(MetalattnError, ValueError):
    """The file is valid GGUF but holds an architecture or tensor type metalattn does not run."""


class TokenError(MetalattnError, ValueError):
    """A token id is out of range, or a prompt is empty."""


class ContextOverflowError(MetalattnError, ValueError):
    """The tokens would run past the context length the model was loaded with."""


class DeviceError(MetalattnError, RuntimeError):
    """The requested device is unavailable, or it failed (for example out of GPU memory)."""


class BackendUnsupportedError(UnsupportedModelError):
    """The model is valid, but the chosen backend cannot run one of its features or tensor types yet
    (device="auto" then falls back to the CPU)."""
