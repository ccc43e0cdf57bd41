"""Chat prompts: the GGUF's own `tokenizer.chat_template`, rendered with Jinja2 in a sandbox.

A chat template inside a downloaded file is untrusted code, so it runs in Jinja2's ImmutableSandboxedEnvironment
(no attribute access to Python internals, no mutation of the values passed in). It sees what Hugging Face templates
expect: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `raise_exception`, `strftime_now`
and the `tojson` filter. A file without a template gets a built-in one chosen from its vocabulary: Gemma's turn
format where `<start_of_turn>` exists, ChatML otherwise.
"""
from __future__ import annotations

import datetime
import functools
import json
import re
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
# A template is code from the file: bounds on what it may build, so a hostile one cannot exhaust memory or time
# ('a' * 10**9, 9 ** 9 ** 9, a namespace string doubled in a loop). Real templates make a few kB.
MAX_TEMPLATE_CHARS = 1 << 20


def _environment():
    global _ENV
    if _ENV is None:
        from jinja2.compiler import CodeGenerator
        from jinja2.exceptions import SecurityError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class BoundedCodeGenerator(CodeGenerator):
            def visit_Concat(self, node, frame):  # `a ~ b`: checked after each join
                self.write("environment.bounded(")
                super().visit_Concat(node, frame)
                self.write(")")

        class BoundedSandbox(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset(["*", "**", "+", "%"])
            code_generator_class = BoundedCodeGenerator

            @staticmethod
            def bounded(value):
                if len(value) > MAX_TEMPLATE_CHARS:
                    raise SecurityError("a concatenation past the template size limit")
                return value

            def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
                # Widths and counts (center, ljust, indent, ...): no template needs millions.
                _check_args(args, kwargs)
                if getattr(__obj, "__name__", "") in ("format", "format_map") and isinstance(
                        getattr(__obj, "__self__", None), str):
                    _check_format(__obj.__self__)
                return super().call(__context, __obj, *args, **kwargs)

            def call_binop(self, context, operator, left, right):
                if operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)) \
                        and abs(left) > 1 and abs(right) > 256:
                    raise SecurityError(f"the power {left!r} ** {right!r} is too large")
                if operator == "*":
                    for seq, n in ((left, right), (right, left)):
                        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_CHARS:
                            raise SecurityError(f"a sequence of {len(seq)} repeated {n} times is too large")
                if operator == "%" and isinstance(left, str):
                    _check_format(left)
                if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                        and len(left) + len(right) > MAX_TEMPLATE_CHARS:
                    raise SecurityError("a concatenation past the template size limit")
                return super().call_binop(context, operator, left, right)

        def _check_args(args, kwargs):
            for a in (*args, *kwargs.values()):
                if isinstance(a, int) and abs(a) > MAX_TEMPLATE_CHARS:
                    raise SecurityError(f"a call with the argument {a} is past the template size limit")

        def _check_format(fmt: str):  # '%1000000000d' % x, '{:>1000000000}'.format(x)
            if re.search(r"\d{7,}", fmt):
                raise SecurityError("a format width past the template size limit")

        def _bounded_filter(f):
            @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
            def call(*args, **kwargs):
                _check_args(args, kwargs)
                return f(*args, **kwargs)

            return call

        _ENV = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        for name, f in list(_ENV.filters.items()):
            _ENV.filters[name] = _bounded_filter(f)
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
        parts, size = [], 0
        for part in compiled.generate(messages=msgs, add_generation_prompt=add_generation_prompt,
                                      bos_token=bos_token, eos_token=eos_token, **{"tools": None, **extra}):
            size += len(part)
            if size > MAX_TEMPLATE_CHARS:
                raise ChatTemplateError(f"the chat template's output passed {MAX_TEMPLATE_CHARS} characters: stopped")
            parts.append(part)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an unsafe operation and was stopped: {e}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # a template can raise anything a Python expression can (TypeError, KeyError, ...)
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
