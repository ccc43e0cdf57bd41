"""A bounded load test of `metalattn serve`, on 127.0.0.1 only.

    python benchmarks/load_test.py [-m MODEL] [-d cpu] [--requests 200] [--clients 16] [--max-tokens 24]
                                   [--time-limit 900] [--json out.json]

Starts `metalattn serve` as a subprocess on a free 127.0.0.1 port, then `--clients` threads, each with its own
`openai` client, send `--requests` requests in all: a mix of chat and completion, streaming and not, greedy
(temperature 0) and sampled (temperature 0.8, a fixed seed per prompt), over 8 chat and 8 completion prompts. A request fails when it raises,
times out (120 s), returns an empty answer, or, for the same (prompt, kind, sampling) key, returns a different text
than the first answer for that key (greedy and seeded answers are deterministic, so any mixing up shows). The
server's RSS (/proc/PID/status VmRSS) is read before the load, after the warm-up quarter of the requests, at the
end, and after 2 s idle. Stops when the time limit is reached (unfinished requests count as failed).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai

PROMPTS = [  # chat requests: instructions, through the template
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three colours.",
    "What is 12 times 12?",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue? One sentence.",
    "Say hello in Spanish.",
    "What is a prime number?",
]
COMPLETION_PROMPTS = [  # completion requests: text to continue (an instruction model ends a bare question at once)
    "The capital of France is",
    "Once upon a time, there was a",
    "The three primary colours are",
    "To make a cup of tea, first",
    "The sea is",
    "In 1969, the first person to walk on the moon",
    "My favourite food is",
    "A prime number is",
]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-d", "--device", default="cpu")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole load (default 900)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    assert 0 < args.requests <= 5000 and 0 < args.clients <= 64

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "metalattn", "serve", "-d", args.device, "--port", str(port), "--log-level",
           "warning"] + (["-m", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                print(proc.stdout.read(), file=sys.stderr)
                return 2
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not come up in 120 s")
                time.sleep(0.2)
        model_id = health["model"]
        rss = {"start": rss_kib(proc.pid)}
        lock = threading.Lock()
        next_index = [0]
        done = [0]
        failures, first_answer, latencies, ttfts, tokens = [], {}, [], [], [0]
        t_start = time.monotonic()
        stop_at = t_start + args.time_limit
        warm = max(1, args.requests // 4)

        def one(c, i):
            kind = ("chat", "completion")[(i // len(PROMPTS)) % 2]
            p = (PROMPTS if kind == "chat" else COMPLETION_PROMPTS)[i % len(PROMPTS)]
            stream = (i // (2 * len(PROMPTS))) % 2 == 1
            sampled = (i // (4 * len(PROMPTS))) % 2 == 1
            kw = dict(model=model_id, max_tokens=args.max_tokens, temperature=0.8 if sampled else 0,
                      seed=1000 + i % len(PROMPTS) if sampled else None, stream=stream)
            t0 = time.monotonic()
            ttft = None
            if kind == "chat":
                r = c.chat.completions.create(messages=[{"role": "user", "content": p}], **kw)
                if stream:
                    parts = []
                    for ch in r:
                        if ch.choices and ch.choices[0].delta.content:
                            ttft = ttft or time.monotonic() - t0
                            parts.append(ch.choices[0].delta.content)
                    text, n = "".join(parts), None
                else:
                    text, n = r.choices[0].message.content, r.usage.completion_tokens
            else:
                r = c.completions.create(prompt=p, **kw)
                if stream:
                    parts = []
                    for ch in r:
                        if ch.choices and ch.choices[0].text:
                            ttft = ttft or time.monotonic() - t0
                            parts.append(ch.choices[0].text)
                    text, n = "".join(parts), None
                else:
                    text, n = r.choices[0].text, r.usage.completion_tokens
            return (p, kind, sampled), text, time.monotonic() - t0, ttft, n

        def client():
            c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            while True:
                with lock:
                    i = next_index[0]
                    if i >= args.requests or time.monotonic() > stop_at:
                        return
                    next_index[0] += 1
                try:
                    key, text, lat, ttft, n = one(c, i)
                    with lock:
                        if not text:
                            failures.append((i, "empty answer"))
                        elif first_answer.setdefault(key, text) != text:
                            failures.append((i, f"answer differs from the first one for {key}"))
                        latencies.append(lat)
                        if ttft is not None:
                            ttfts.append(ttft)
                        if n:
                            tokens[0] += n
                except Exception as e:  # counted, reported
                    with lock:
                        failures.append((i, repr(e)[:200]))
                with lock:
                    done[0] += 1
                    if done[0] == warm:
                        rss["after_warmup"] = rss_kib(proc.pid)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, stop_at - time.monotonic()) + 130)
        wall = time.monotonic() - t_start
        rss["end"] = rss_kib(proc.pid)
        time.sleep(2)
        rss["idle_2s"] = rss_kib(proc.pid)
        health = httpx.get(url + "/health", timeout=5).json()
        unfinished = args.requests - done[0]
        lat_sorted = sorted(latencies)

        def pct(xs, q):
            return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

        result = {
            "date": time.strftime("%Y-%m-%d"), "model": model_id, "device": health.get("device"),
            "requests": args.requests, "clients": args.clients, "max_tokens": args.max_tokens,
            "completed": done[0] - len(failures), "failed": len(failures) + unfinished, "wall_s": round(wall, 1),
            "requests_per_s": round(done[0] / wall, 2),
            "latency_s": {"median": round(statistics.median(latencies), 3) if latencies else None,
                          "p90": round(pct(lat_sorted, 0.9), 3), "max": round(max(latencies), 3) if latencies else None},
            "stream_ttft_s": {"median": round(statistics.median(ttfts), 3) if ttfts else None,
                              "p90": round(pct(sorted(ttfts), 0.9), 3) if ttfts else None},
            "non_stream_completion_tokens": tokens[0], "rss_kib": rss,
            "rss_growth_after_warmup_kib": rss["end"] - rss.get("after_warmup", rss["end"]),
            "server_health": health, "failures": failures[:20],
        }
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0 if result["failed"] == 0 else 1
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
