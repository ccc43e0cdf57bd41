"""Regenerates tests/data/tokenizer_llamacpp.json: llama.cpp's token ids for a varied corpus, for each named model.

    python tests/data/make_tokenizer_fixture.py /path/to/llama.cpp/build/bin/llama-tokenize

Each text is written to a file and tokenized twice by llama.cpp's own tool:
  ids:         llama-tokenize -m MODEL -f TEXT --no-escape --ids --log-disable
               (the file's add_bos; special tokens written in the text are parsed)
  ids_plain:   the same with --no-bos --no-parse-special (specials are plain text)
The test (tests/python/test_tokenizer.py) compares metalattn's Tokenizer with both, wherever the model is installed.
Models are found through metalattn.registry (assembling chunked ones into the cache on first use).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")

CORPUS = [
    # English prose, punctuation, contractions
    "Hello world",
    " Hello  world",
    "The capital of France is Paris.",
    "Don't you'll we've I'M THEY'RE she'd it's",
    "don’t “curly quotes” and ‘single’ ones…",
    "Well... maybe?! (Yes); no: [perhaps] {or} <not>.",
    "mixed Café123αβγ — “quotes” ‘single’ …",
    # whitespace: leading/trailing runs, tabs, newlines, CR
    "  leading spaces and trailing   ",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "tabs\tand\nnewlines\n\n\nmany",
    "\t\t\tindented with tabs\n\t\t\t\tdeeper",
    "windows\r\nline\r\nendings\r\n",
    "trailing spaces before newline   \nnext",
    "    \n    \n",
    "a" + " " * 17 + "b" + " " * 40 + "c",
    " \t \n \t\n",
    "\u00a0nbsp\u2003em space",
    "ＦＵＬＬＷＩＤＴＨ\u3000ｔｅｘｔ",
    # digits and numbers
    "numbers 1 12 123 1234 12345 3.14159 1,000,000 2024-11-24",
    "12345678901234567890123456789",
    "0x1F3A 0b1011 1e-10 6.022e23 -42 +7 1_000_000 99.9% $19.99 €5",
    "v1.2.3-rc4 ipv4 192.168.0.1 tel +1 (555) 010-9999",
    # unicode, scripts, combining marks
    "Ünïcödé façade naïve café résumé Ångström",
    "e\u0301 combining vs é precomposed; A\u030a",
    "日本語のテキストと中文文本，还有한국어 텍스트",
    "السلام عليكم",
    "Привет, мир!",
    "Ελληνικά και עברית και नमस्ते दुनिया और สวัสดีครับ",
    "𝕳𝖊𝖑𝖑𝖔 𝔀𝓸𝓻𝓵𝓭 𠀀𠀁 rare CJK",
    "∑_{i=1}^{n} x_i² ≤ √2 ± ∞ ≠ ∂f/∂x",
    "zero\u200bwidth\u200cjoin\u200ders\ufeffbom",
    "ctrl \x01\x02\x7f chars",
    # emoji
    "emoji 😀👍🏽🇫🇷 and ❤️ combined 👨\u200d👩\u200d👧",
    "keycaps 1️⃣ #️⃣ flags 🇯🇵🇺🇸 and 🏳️\u200d🌈",
    # code
    "def f(x):\n    return x ** 2  # square\n\tif x: pass",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b\\n"}}',
    "x=1;y=2;z=x+y",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "<html><body><table><tr><td>cell</td></tr></table></body></html>",
    "## Title\n\n- item one\n- item two\n\n```python\nprint('hi')\n```\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "URL https://example.com/path?q=1&r=2#frag",
    "C:\\Users\\me\\file.txt and /usr/local/bin",
    # repetition
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ab" * 40,
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "=" * 30 + "\n" + "-" * 30,
    "QmFzZTY0IGVuY29kZWQgdGV4dCBpcyBoZXJlIQ==",
    # SentencePiece corner cases
    "\u2581already\u2581marked\u2581spaces",
    "<0x41> written as text",
    "<unk> and <s> and </s> and <pad> as text",
    # special tokens written in text (each model knows some of them)
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n",
    "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn> user",
    "<end_of_turn><start_of_turn><end_of_turn>",
    "<start_of_turn",
    "text<|endoftext|>more",
    "<|fim_prefix|>def f():<|fim_suffix|>\n    return 1<|fim_middle|>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|eot_id|><|begin_of_text|>",
    "<eos>",
]


def _tokenize(binary: str, model: Path, text: str, plain: bool) -> list:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        name = f.name
    command = [binary, "-m", str(model), "-f", name, "--no-escape", "--ids", "--log-disable"]
    if plain:
        command += ["--no-bos", "--no-parse-special"]
    try:
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    finally:
        Path(name).unlink()
    line = [line for line in out.splitlines() if line.startswith("[")][-1]
    return json.loads(line)


def main(binary: str) -> None:
    from metalattn import registry

    corpus = CORPUS + [(HERE / "english_prose.txt").read_text(encoding="utf-8")]
    fixture = {
        "source": "llama.cpp llama-tokenize (the llama.cpp vendored in llama-cpp-python 0.3.36); regenerate with "
                  "tests/data/make_tokenizer_fixture.py",
        "commands": {"ids": "llama-tokenize -m MODEL -f TEXT --no-escape --ids --log-disable",
                     "ids_plain": "llama-tokenize -m MODEL -f TEXT --no-escape --ids --log-disable --no-bos "
                                  "--no-parse-special"},
        "corpus": corpus,
        "ids": {},
        "ids_plain": {},
    }
    for name in MODELS:
        model = registry.resolve(name)
        fixture["ids"][name] = [_tokenize(binary, model, text, plain=False) for text in corpus]
        fixture["ids_plain"][name] = [_tokenize(binary, model, text, plain=True) for text in corpus]
        print(f"{name}: {len(corpus)} texts", file=sys.stderr)
    out = HERE / "tokenizer_llamacpp.json"
    out.write_text(json.dumps(fixture, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
