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


class InvalidArgumentError(MetalattnError, ValueError):
    """An argument of a metalattn call is out of its domain (n_ctx <= 0, max_tokens < 0, top_p outside (0, 1], ...)."""


class NonFiniteError(MetalattnError, ValueError):
    """A model produced or holds non-finite numbers: every logit of a step is NaN (at run time; almost always corrupt
    or non-finite weights: `load(path, check_tensors=True)` or `metalattn info --check` names the tensor)."""


class NonFiniteWeightsError(NonFiniteError, GGUFError):
    """check_tensors found a weight tensor holding NaN or infinity; the message names the tensor and the element."""


class ModelClosedError(MetalattnError, RuntimeError):
    """The Model was closed (close() or the end of its `with` block); load it again to use it."""


class ContextChangedError(MetalattnError, RuntimeError):
    """A suspended stream() found that another call used the model's KV cache since its last step. A stream holds
    the model's lock only while it computes each token; to stream while other threads use the model, hold
    `model.lock` around the whole loop (other callers then wait)."""
