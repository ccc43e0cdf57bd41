"""The command line, run as a user runs it (a subprocess)."""

import json
import subprocess
import sys

import pytest


def cli(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "metalattn", *map(str, args)], capture_output=True, text=True,
                       timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"metalattn {' '.join(map(str, args))} failed:\n{p.stdout}\n{p.stderr}")
    return p


def test_help_explains_commands():
    out = cli("--help").stdout
    for cmd in ("run", "bench", "info", "perplexity", "quantize"):
        assert cmd in out
    assert "--prompt-lengths" in cli("bench", "--help").stdout


def test_run_streams_text_and_reports_speed(synthetic_factory):
    path = synthetic_factory(quant="q4_0", seed=20)
    p = cli("run", "hello", "-m", path, "-d", "cpu", "-n", "8")
    assert p.stdout.startswith("hello")
    assert "tok/s decode" in p.stderr and "tok/s prefill" in p.stderr


def test_bench_json_reports_prefill_and_decode(synthetic_factory):
    path = synthetic_factory(quant="q4_0", seed=21)
    p = cli("bench", "-m", path, "-d", "cpu", "--prompt-lengths", "8,16", "--gen-length", "8", "--iterations", "2",
            "--json", "-q")
    r = json.loads(p.stdout)
    assert [x["n_prompt"] for x in r["prefill"]] == [8, 16]
    for x in r["prefill"]:
        s = x["tokens_per_second"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and s["runs"] == 2
    assert r["hardware"]  # the CPU's (or GPU's) name, so a result file says what it ran on
    d = r["decode"]
    assert d["n_gen"] == 8 and d["tokens_per_second"]["median"] > 0
    assert 0 < d["fraction_of_bandwidth_floor"]
    s = d["sampled_tokens_per_second"]
    assert 0 < s["min"] <= s["median"] <= s["max"] and s["runs"] == 2
    assert d["sampled_settings"] == {"temperature": 1.0, "top_k": 0, "top_p": 0.95}
    table = cli("bench", "-m", path, "-d", "cpu", "--prompt-lengths", "8", "--gen-length", "4", "--iterations", "1",
                "-q").stdout
    assert "pp8" in table and "tg4" in table and "tg4 sampled (T 1, top_p 0.95)" in table


def test_bench_decode_at_depth(synthetic_factory):
    path = synthetic_factory(quant="q4_0", seed=23)
    p = cli("bench", "-m", path, "-d", "cpu", "--prompt-lengths", "8", "--gen-length", "4", "--iterations", "2",
            "--depths", "40,8", "--json", "-q")
    r = json.loads(p.stdout)
    rows = r["decode_at_depth"]
    assert [x["depth"] for x in rows] == [8, 40] and all(x["n_gen"] == 4 for x in rows)
    for x in rows:
        s, us = x["tokens_per_second"], x["us_per_token"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and s["runs"] == 2
        # The same runs, per token: the fastest run is the shortest time (medians of two runs are means, which
        # do not invert exactly).
        assert us["min"] == pytest.approx(1e6 / s["max"]) and us["max"] == pytest.approx(1e6 / s["min"])
    assert rows[0]["time_ratio_to_shallowest"] == 1.0 and rows[1]["time_ratio_to_shallowest"] > 0
    table = cli("bench", "-m", path, "-d", "cpu", "--prompt-lengths", "8", "--gen-length", "4", "--iterations", "1",
                "--depths", "16", "-q").stdout
    assert "tg4 @ d16" in table and "decode at depth: d16" in table
    # A depth past the context the user set: a clear message, no traceback.
    p = cli("bench", "-m", path, "-d", "cpu", "--prompt-lengths", "8", "--gen-length", "4", "--iterations", "1",
            "--depths", "100", "-c", "64", "-q", check=False)
    assert p.returncode == 1 and "depth 100" in p.stderr and "Traceback" not in p.stderr
    p = cli("bench", "-m", path, "-d", "cpu", "--depths", "x", check=False)
    assert p.returncode != 0 and "--depths" in p.stderr and "Traceback" not in p.stderr


def test_info_and_quantize_and_perplexity(synthetic_factory, tmp_path):
    path = synthetic_factory(quant="q4_1", embd_quant="q8_0", seed=22)
    info = cli("info", "-m", path).stdout
    assert "n_layers" in info and "blk.0.attn_q.weight" in info and "Q4_1" in info
    out = tmp_path / "q40.gguf"
    cli("quantize", path, out, "--type", "q4_0", "-q")
    info2 = cli("info", "-m", out).stdout
    assert "Q4_0" in info2 and "Q4_1" not in info2
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    p = cli("perplexity", "-m", out, "-d", "cpu", "-f", text, "--ctx", "64", "-q")
    ppl = float(p.stdout.split()[1])
    assert ppl > 1.0


def test_errors_are_clear_not_crashes(tmp_path, synthetic_factory):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    p = cli("run", "hi", "-m", bad, "-d", "cpu", check=False)
    assert p.returncode == 1 and "error" in p.stderr and "Traceback" not in p.stderr
    p = cli("info", "-m", tmp_path / "missing.gguf", check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    path = synthetic_factory(quant="q4_0", seed=23)
    p = cli("run", "hello " * 40, "-m", path, "-d", "cpu", "-c", "8", check=False)
    assert p.returncode == 1 and "context" in p.stderr.lower()


def test_real_model_perplexity_is_low(real_model):
    """A wrong RoPE, norm or tokenizer shows up as perplexity in the hundreds; SmolLM2-135M on plain English
    prose lands in the low tens."""
    from pathlib import Path

    text = Path(__file__).parent.parent / "data" / "english_prose.txt"
    p = cli("perplexity", "-m", real_model, "-d", "cpu", "-f", text, "--ctx", "512", "-q")
    ppl = float(p.stdout.split()[1])
    assert 3.0 < ppl < 30.0, p.stdout
