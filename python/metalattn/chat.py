"""Chat prompts: the GGUF's own `tokenizer.chat_template`, rendered with Jinja2 in a sandbox.

A chat template inside a downloaded file is untrusted code, so it runs in Jinja2's ImmutableSandboxedEnvironment
(no attribute access to Python internals, no mutation of the values passed in). It sees what Hugging Face templates
expect: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `raise_exception`, `strftime_now`
and the `tojson` filter. A file without a template gets a built-in one chosen from its vocabulary: Gemma's turn
format where `<start_of_turn>` exists, ChatML otherwise.
"""
from __future__ import annotations

import datetime
import json
from typing import Any, Mapping, Optional, Sequence

from .errors import MetalattnError


class ChatTemplateError(MetalattnError, ValueError):
    """The chat template failed to render (a syntax error, an unsafe operation, or the template's own
    raise_exception), or the messages are malformed."""


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Gemma's turns: 'assistant' is 'model', a system message opens the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] | trim + '\n\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% if role == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def builtin_template(token_to_id) -> str:
    """The fallback for a file without a template: Gemma's format when its vocabulary has the turn markers."""
    if token_to_id("<start_of_turn>") is not None and token_to_id("<end_of_turn>") is not None:
        return GEMMA_TEMPLATE
    return CHATML_TEMPLATE


def _raise(message: str):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_ENV = None


def _environment():
    global _ENV
    if _ENV is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        _ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                             extensions=["jinja2.ext.loopcontrols"])
        _ENV.filters["tojson"] = _tojson
        _ENV.globals["raise_exception"] = _raise
        _ENV.globals["strftime_now"] = _strftime_now
    return _ENV


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ChatTemplateError(f"message {i} must be a dict with a string 'role' and a 'content'")
        out.append(dict(m))
    return out


def render(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """The prompt text the template makes of `messages` (extra keyword arguments reach the template, e.g. tools)."""
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError

    msgs = _check_messages(messages)
    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                               eos_token=eos_token, **{"tools": None, **extra})
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an unsafe operation and was stopped: {e}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # a template can raise anything a Python expression can (TypeError, KeyError, ...)
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
