"""`metalattn bench`: prefill and decode speed measured separately, the way llama-bench counts them.

Prefill (ppN): time of one forward_prompt over N tokens from an empty cache -> N / seconds.
Decode (tgN): after a 32-token prompt, N greedy steps (forward_token_greedy: argmax on the device, 8 bytes back)
-> N / seconds, one engine call a token, as llama-bench counts. Decode run ahead (tgN ahead): the same N steps as
greedy generate() and stream() run them, 64 steps an engine call (forward_tokens_greedy: on CUDA the steps are
queued back to back and each token passes to the next step on the device). Decode at depth D (tgN @ dD, --depths):
the same N steps after a D-token prompt (untimed), so the attention reads D cached positions per step; the table
also gives each depth's time per token over the shallowest's.
Decode sampled (tgN sampled): the same N steps drawn at temperature 1 with top_p 0.95 (forward_token_sample: on
CUDA the draw runs on the device, 8 bytes back), one engine call a token, seeded uniforms.
Each figure is the median over --iterations runs after one warm-up run, with min and max.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from typing import Optional, Sequence

import numpy as np

DECODE_PROMPT = 32


def _random_tokens(n: int, vocab: int, seed: int) -> np.ndarray:
    # Ordinary vocabulary ids (skipping the first few hundred: specials and bytes) so the run looks like text.
    lo = min(300, vocab // 2)
    return np.random.default_rng(seed).integers(lo, vocab, size=n, dtype=np.int32)


def _summary(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every layer matrix and norm, lm_head, and one embedding row
    (the whole embedding only when it is also the tied lm_head, counted once)."""
    total = 0
    for name, t in model.gguf.tensors.items():
        if name == "output.weight" and model.gguf.tied_output:
            continue  # the same bytes as token_embd.weight
        if name == "token_embd.weight" and not model.gguf.tied_output:
            total += t.data.nbytes // max(t.rows, 1)
        else:
            total += t.data.nbytes
    return total


RUN_AHEAD = 64  # steps per forward_tokens_greedy call (the engine's most)
SAMPLED = {"temperature": 1.0, "top_k": 0, "top_p": 0.95}  # the sampled decode's settings


def _decode_rates(model, prompt: np.ndarray, gen_length: int, iterations: int, label: str, progress: bool,
                  ahead: bool = False, sampled: bool = False):
    """tok/s of gen_length greedy steps after `prompt`, and the prompt's own time (ms), one list entry per timed run
    (the first run warms up and is dropped). ahead: RUN_AHEAD steps an engine call instead of one. sampled: each step
    drawn with the SAMPLED settings instead."""
    rates, prompt_ms = [], []
    rng = np.random.default_rng(0)
    for it in range(iterations + 1):
        model.reset()
        t = time.perf_counter()
        token = model.forward_prompt(prompt)
        t1 = time.perf_counter()
        if sampled:
            for u in rng.random(gen_length):
                token = model.forward_token_sample(token, float(u), **SAMPLED)
        elif ahead:
            left = gen_length
            while left > 0:
                k = min(RUN_AHEAD, left)
                token = model.forward_tokens_greedy(token, k)[-1]
                left -= k
        else:
            for _ in range(gen_length):
                token = model.forward_token_greedy(token)
        t2 = time.perf_counter()
        if it > 0:
            rates.append(gen_length / (t2 - t1))
            prompt_ms.append((t1 - t) * 1e3)
        if progress:
            print(f"\r  {label}: run {it}/{iterations}", end="", file=sys.stderr, flush=True)
    return rates, prompt_ms


def run_bench(model, prompt_lengths: Sequence[int] = (32, 128, 512), gen_length: int = 128, iterations: int = 5,
              progress: bool = True, depths: Sequence[int] = ()) -> dict:
    vocab = model.vocab_size
    result = {
        "model": model.path.name,
        "device": model.device,
        "n_ctx": model.n_ctx,
        "platform": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "iterations": iterations,
        "prefill": [],
        "decode": None,
    }
    from . import _core

    result["hardware"] = _hardware_name(model.device)
    if model.device == "cpu":
        result["cpu_isa"] = _core.cpu_isa()
        result["threads"] = getattr(model, "n_threads", None)
    for n in prompt_lengths:
        if n + 1 > model.n_ctx:
            raise ValueError(f"prompt length {n} does not fit the context of {model.n_ctx}")
        toks = _random_tokens(n, vocab, seed=n)
        times = []
        for it in range(iterations + 1):  # the first run warms up (caches, clocks, lazily built kernels)
            model.reset()
            t = time.perf_counter()
            model.forward_prompt(toks)
            dt = time.perf_counter() - t
            if it > 0:
                times.append(dt)
            if progress:
                print(f"\r  pp{n}: run {it}/{iterations}", end="", file=sys.stderr, flush=True)
        rates = [n / t for t in times]
        result["prefill"].append({"n_prompt": n, "tokens_per_second": _summary(rates),
                                  "ms": _summary([t * 1e3 for t in times])})
    if gen_length > 0:
        if DECODE_PROMPT + gen_length > model.n_ctx:
            raise ValueError(f"32 + {gen_length} tokens do not fit the context of {model.n_ctx}")
        prompt = _random_tokens(DECODE_PROMPT, vocab, seed=1)
        rates, ttft = _decode_rates(model, prompt, gen_length, iterations, f"tg{gen_length}", progress)
        per_token = weight_bytes_per_token(model)
        ahead, _ = _decode_rates(model, prompt, gen_length, iterations, f"tg{gen_length} ahead", progress, ahead=True)
        sampled, _ = _decode_rates(model, prompt, gen_length, iterations, f"tg{gen_length} sampled", progress,
                                   sampled=True)
        result["decode"] = {"n_prompt": DECODE_PROMPT, "n_gen": gen_length, "tokens_per_second": _summary(rates),
                            "run_ahead_tokens_per_second": _summary(ahead), "run_ahead_steps_per_call": RUN_AHEAD,
                            "sampled_tokens_per_second": _summary(sampled), "sampled_settings": dict(SAMPLED),
                            "time_to_first_token_ms": _summary(ttft), "weight_bytes_per_token": per_token}
        bw = _bandwidth(model)
        if bw:
            floor = bw / per_token
            result["decode"]["bandwidth_bytes_per_second"] = bw
            result["decode"]["bandwidth_floor_tokens_per_second"] = floor
            result["decode"]["fraction_of_bandwidth_floor"] = result["decode"]["tokens_per_second"]["median"] / floor
        if model._engine.kernels_per_token:
            result["decode"]["kernels_per_token"] = model._engine.kernels_per_token
    if depths:
        if gen_length <= 0:
            raise ValueError("--depths needs decode steps to time (--gen-length > 0)")
        result["decode_at_depth"] = []
        for depth in sorted(depths):
            if depth < 1 or depth + gen_length > model.n_ctx:
                raise ValueError(f"depth {depth} + {gen_length} decode tokens do not fit the context of "
                                 f"{model.n_ctx} (-c sets it)")
            rates, _ = _decode_rates(model, _random_tokens(depth, vocab, seed=depth), gen_length, iterations,
                                     f"tg{gen_length} @ d{depth}", progress)
            result["decode_at_depth"].append({"depth": depth, "n_gen": gen_length, "tokens_per_second": _summary(rates),
                                              "us_per_token": _summary([1e6 / r for r in rates])})
        base = result["decode_at_depth"][0]["us_per_token"]["median"]
        for d in result["decode_at_depth"]:
            d["time_ratio_to_shallowest"] = d["us_per_token"]["median"] / base
    if progress:
        print("\r" + " " * 40 + "\r", end="", file=sys.stderr, flush=True)
    result["memory"] = model.memory_info()
    return result


def _hardware_name(device: str) -> str:
    """The GPU's name on CUDA, the CPU's model name on the CPU (Linux /proc/cpuinfo, else what platform knows)."""
    from . import _core

    if device == "cuda":
        return _core.cuda_device_name()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _bandwidth(model) -> Optional[float]:
    from . import _core

    if model.device == "cuda":
        return float(_core.cuda_copy_bandwidth())
    if model.device == "cpu":
        return float(_core.cpu_read_bandwidth(model.n_threads or 0))
    return None


def format_table(r: dict) -> str:
    rows = [("test", "tok/s (median)", "min", "max", "ms (median)")]
    for p in r["prefill"]:
        s = p["tokens_per_second"]
        rows.append((f"pp{p['n_prompt']}", f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}",
                     f"{p['ms']['median']:.3f}"))
    d = r.get("decode")
    if d:
        s = d["tokens_per_second"]
        rows.append((f"tg{d['n_gen']} (after pp{d['n_prompt']})", f"{s['median']:.1f}", f"{s['min']:.1f}",
                     f"{s['max']:.1f}", f"{1e3 / s['median']:.3f}"))
        s = d.get("run_ahead_tokens_per_second")
        if s:
            rows.append((f"tg{d['n_gen']} ahead ({d['run_ahead_steps_per_call']} a call)", f"{s['median']:.1f}",
                         f"{s['min']:.1f}", f"{s['max']:.1f}", f"{1e3 / s['median']:.3f}"))
        s = d.get("sampled_tokens_per_second")
        if s:
            c = d["sampled_settings"]
            rows.append((f"tg{d['n_gen']} sampled (T {c['temperature']:g}, top_p {c['top_p']:g})", f"{s['median']:.1f}",
                         f"{s['min']:.1f}", f"{s['max']:.1f}", f"{1e3 / s['median']:.3f}"))
    for x in r.get("decode_at_depth") or []:
        s = x["tokens_per_second"]
        rows.append((f"tg{x['n_gen']} @ d{x['depth']}", f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}",
                     f"{1e3 / s['median']:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(rows[0], widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in rows[1:]]
    detail = ", ".join(x for x in (r.get("cpu_isa"), r.get("hardware")) if x)
    head = f"{r['model']} on {r['device']}" + (f" ({detail})" if detail else "")
    lines = [head, line, sep, *body]
    if d:
        lines.append(f"time to first token (pp{d['n_prompt']}): {d['time_to_first_token_ms']['median']:.3f} ms")
        if "fraction_of_bandwidth_floor" in d:
            lines.append(f"decode reaches {100 * d['fraction_of_bandwidth_floor']:.1f}% of the bandwidth floor "
                         f"({d['weight_bytes_per_token'] / 1e6:.1f} MB/token at "
                         f"{d['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s -> "
                         f"{d['bandwidth_floor_tokens_per_second']:.0f} tok/s)")
        if "kernels_per_token" in d:
            lines.append(f"kernels per token: {d['kernels_per_token']}")
    depths = r.get("decode_at_depth") or []
    if depths:
        lines.append("decode at depth: " + ", ".join(
            f"d{x['depth']} {x['us_per_token']['median']:.1f} us/token ({x['time_ratio_to_shallowest']:.2f}x)"
            for x in depths))
    return "\n".join(lines)


def to_json(r: dict) -> str:
    return json.dumps(r, indent=2)
