"""Chat templates (metalattn.chat): the GGUF's own template rendered in a sandbox, the built-in fallbacks, errors."""
import pytest

from metalattn.chat import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplateError, builtin_template, render
from metalattn.errors import MetalattnError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]


def test_chatml_fallback():
    text = render(CHATML_TEMPLATE, MESSAGES[1:2])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(CHATML_TEMPLATE, MESSAGES[1:2], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_gemma_fallback_turns_and_system_message():
    text = render(GEMMA_TEMPLATE, MESSAGES, bos_token="<bos>")
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n")


def test_builtin_template_follows_the_vocabulary():
    gemma_vocab = {"<start_of_turn>": 105, "<end_of_turn>": 106}
    assert builtin_template(gemma_vocab.get) is GEMMA_TEMPLATE
    assert builtin_template({}.get) is CHATML_TEMPLATE


def test_hf_style_template_features():
    # trim_blocks/lstrip_blocks, loop controls, tojson, raise_exception, namespace, bos/eos variables, tools.
    template = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\n"
                "{{ bos_token }}[{{ m.role }}]{{ m.content | tojson }}{{ eos_token }}\n{% endfor %}"
                "{% if tools is not none %}{{ raise_exception('no tools here') }}{% endif %}")
    assert render(template, MESSAGES[:2], bos_token="<s>", eos_token="</s>") == '<s>[user]"Hi"</s>\n'
    with pytest.raises(ChatTemplateError, match="no tools here"):
        render(template, MESSAGES[:2], tools=[{"name": "f"}])
    assert "strftime_now" in render("{{ 'strftime_now' if strftime_now('%Y') | int > 2000 }}", [])


def test_sandbox_stops_unsafe_templates():
    # Reaching Python internals through attributes is how template injection escapes; the sandbox refuses it.
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render(evil, MESSAGES)
    with pytest.raises(ChatTemplateError, match="unsafe"):  # immutable: the template may not change the messages
        render("{% set _ = messages.append(1) %}", MESSAGES)


def test_template_errors_are_metalattn_errors():
    with pytest.raises(ChatTemplateError, match="TemplateSyntaxError"):
        render("{% for %}", MESSAGES)
    with pytest.raises(MetalattnError, match="dict with a string 'role'"):
        render(CHATML_TEMPLATE, [{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="list of"):
        render(CHATML_TEMPLATE, "just a string")


def test_model_uses_the_files_template_and_drops_a_double_bos(synthetic_factory):
    import metalattn

    model = metalattn.load(synthetic_factory(), device="cpu")  # the synthetic file carries a ChatML template
    text = model.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = model.tokenize(text)
    assert ids[0] == model.tokenizer.token_to_id("<|im_start|>")  # a special token, not its characters
