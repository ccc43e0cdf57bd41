"""A bounded load test of `metalattn serve`, on 127.0.0.1 only.

    python benchmarks/load_test.py [-m MODEL] [-d cpu] [--parallel N] [--requests 200] [--clients 16]
                                   [--max-tokens 24] [--time-limit 900] [--json out.json]
    python benchmarks/load_test.py --throughput [--configs 1x1,8x8] [--rounds 5] [--max-tokens 128] [...]

Starts `metalattn serve` as a subprocess on a free 127.0.0.1 port, then `--clients` threads, each with its own
`openai` client, send `--requests` requests in all: a mix of chat and completion, streaming and not, greedy
(temperature 0) and sampled (temperature 0.8, a fixed seed per prompt), over 8 chat and 8 completion prompts. A request fails when it raises,
times out (120 s), returns an empty answer, or, for the same (prompt, kind, sampling) key, returns a different text
than the first answer for that key (greedy and seeded answers are deterministic, so any mixing up shows). The
server's RSS (/proc/PID/status VmRSS) is read before the load, after the warm-up quarter of the requests, at the
end, and after 2 s idle. Stops when the time limit is reached (unfinished requests count as failed).
`--parallel N` is passed to `metalattn serve` (KV-cache slots decoded together; its default otherwise).

--throughput: aggregate decode speed of concurrent streams. Each configuration PxS (a server started with
`--parallel P`, driven by S concurrent streaming clients, each a greedy completion of --max-tokens tokens from its
own prompt, all 128 tokens long on SmolLM2-135M) runs --rounds rounds, the configurations alternating (A B A B: the
machine is shared, and load drifts). A round's aggregate tok/s is all streams' completion tokens over the wall time
from the first request sent to the last stream ended (prefills included); a stream's tok/s is its tokens after the
first over the time from its first to its last chunk. Medians over the rounds are reported, with the load average,
and every stream's text is checked against the same prompt's text in the first configuration (greedy: a stream
decoded in a batch must equal the same request served alone).
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


THROUGHPUT_PROMPTS = [  # completions that run the full 128 tokens greedily on SmolLM2-135M-Instruct
    "Once upon a time, there was a",
    "The three primary colours are",
    "To make a cup of tea, first",
    "My favourite food is",
    "A prime number is",
    "The history of the Roman Empire",
    "Here is a recipe for bread:",
    "The best way to learn programming is",
    "Photosynthesis is the process",
    "The old lighthouse keeper",
    "In the year 2050, cities will",
]


def start_server(args, parallel=None):
    """`metalattn serve` on a free 127.0.0.1 port: (process, url, /health), or raises SystemExit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "metalattn", "serve", "-d", args.device, "--port", str(port), "--log-level",
           "warning"] + (["-m", args.model] if args.model else []) + (["-c", str(args.n_ctx)] if args.n_ctx else [])
    if parallel is not None:
        cmd += ["--parallel", str(parallel)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            print(proc.stdout.read(), file=sys.stderr)
            raise SystemExit(f"the server exited: {' '.join(cmd)}")
        try:
            return proc, url, httpx.get(url + "/health", timeout=2).json()
        except httpx.TransportError:
            if time.monotonic() > deadline:
                stop_server(proc)
                raise SystemExit("the server did not come up in 120 s")
            time.sleep(0.2)


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one_stream(url, model_id, prompt, max_tokens):
    """A greedy streamed completion: (text, completion tokens, t_sent, t_first_chunk, t_last_chunk)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    t0 = time.monotonic()
    first = last = None
    parts, n = [], 0
    for ch in c.completions.create(model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                   stream=True, stream_options={"include_usage": True}):
        now = time.monotonic()
        if ch.choices:
            first = first or now
            last = now
            parts.append(ch.choices[0].text)
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    return "".join(parts), n, t0, first, last


def direct_streams(model, prompts, max_tokens):
    """The same streams without HTTP: a BatchGenerator in this process (the server's ceiling)."""
    from metalattn.batch import BatchGenerator

    gen = BatchGenerator(model)
    seqs = [gen.submit(p, max_tokens=max_tokens) for p in prompts]
    t0 = time.monotonic()
    acc = {id(q): [[], 0, None, None] for q in seqs}  # texts, tokens, first, last
    while gen.busy:
        for seq, chunk in gen.step():
            if chunk is not None:
                a, now = acc[id(seq)], time.monotonic()
                a[0].append(chunk.text)
                a[1] += 1
                a[2] = a[2] or now
                a[3] = now
    return [("".join(a[0]), a[1], t0, a[2], a[3]) for a in (acc[id(q)] for q in seqs)]


def throughput(args) -> int:
    configs = []
    for item in args.configs.split(","):
        p, _, s = item.strip().partition("x")
        direct = s.endswith("d")
        configs.append((int(p), int(s.rstrip("d")), direct))
    assert configs and all(1 <= p <= 64 and 1 <= s <= 64 for p, s, _ in configs) and 1 <= args.rounds <= 50
    servers, direct_models = {}, {}
    try:
        for p in sorted({p for p, _, d in configs if not d}):
            servers[p] = start_server(args, p)
        for p in sorted({p for p, _, d in configs if d}):
            import metalattn

            direct_models[p] = metalattn.load(args.model, device=args.device, n_ctx=args.n_ctx, n_seq=p)
        runs = {c: [] for c in configs}
        t_load0 = os.getloadavg()[0]
        reference = {}  # prompt -> text in the first configuration
        failures = []
        round_agg = {}  # round -> config -> aggregate tok/s (for ratios within a round: the load drifts)
        for rnd in range(args.rounds + 1):  # round 0 warms every server up and is not counted
            for cfg in (configs if rnd % 2 else configs[::-1]) if rnd else configs:
                p, n_streams, direct = cfg
                prompts = [THROUGHPUT_PROMPTS[i % len(THROUGHPUT_PROMPTS)] for i in range(n_streams)]
                out = [None] * n_streams
                load = os.getloadavg()[0]
                t0 = time.monotonic()
                if direct:
                    out = direct_streams(direct_models[p], prompts, args.max_tokens)
                else:
                    proc, url, health = servers[p]

                    def run(i):
                        try:
                            out[i] = one_stream(url, health["model"], prompts[i], args.max_tokens)
                        except Exception as e:  # counted, reported
                            out[i] = e

                    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n_streams)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join(600)
                wall = time.monotonic() - t0
                ok = [o for o in out if isinstance(o, tuple)]
                for i, o in enumerate(out):
                    if not isinstance(o, tuple):
                        failures.append((cfg, rnd, prompts[i], repr(o)[:200]))
                    elif reference.setdefault(prompts[i], o[0]) != o[0]:
                        failures.append((cfg, rnd, prompts[i], "text differs from the first configuration's"))
                if rnd == 0:
                    continue
                round_agg.setdefault(rnd, {})[cfg] = sum(o[1] for o in ok) / wall
                tokens = sum(o[1] for o in ok)
                per_stream = [(o[1] - 1) / (o[4] - o[3]) for o in ok if o[1] > 1 and o[4] > o[3]]
                runs[cfg].append({"aggregate_tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                                  "per_stream_tok_s": statistics.median(per_stream) if per_stream else None,
                                  "ttft_s": statistics.median(o[3] - o[2] for o in ok) if ok else None,
                                  "load_1min": load})
                r = runs[cfg][-1]
                print(f"round {rnd} {'direct BatchGenerator n_seq' if direct else '--parallel'} {p} x {n_streams} "
                      f"streams: {r['aggregate_tok_s']:.1f} tok/s aggregate, "
                      f"{r['per_stream_tok_s'] or 0:.1f} per stream, {tokens} tokens in {wall:.2f} s, load {load:.2f}",
                      file=sys.stderr, flush=True)
        table = []
        base = None
        for cfg in configs:
            rs = runs[cfg]
            agg = statistics.median(r["aggregate_tok_s"] for r in rs)
            base = base or agg
            ratios = [ra[cfg] / ra[configs[0]] for ra in round_agg.values()]
            table.append({"parallel": cfg[0], "streams": cfg[1], "direct": cfg[2], "rounds": len(rs),
                          "ratio_to_first_in_round_median": round(statistics.median(ratios), 2),
                          "ratio_to_first_in_round_range": [round(min(ratios), 2), round(max(ratios), 2)],
                          "aggregate_tok_s_median": round(agg, 1),
                          "aggregate_tok_s_range": [round(min(r["aggregate_tok_s"] for r in rs), 1),
                                                    round(max(r["aggregate_tok_s"] for r in rs), 1)],
                          "per_stream_tok_s_median": round(statistics.median(r["per_stream_tok_s"] for r in rs), 1),
                          "ttft_s_median": round(statistics.median(r["ttft_s"] for r in rs), 3),
                          "speedup_vs_first": round(agg / base, 2),
                          "load_1min": [round(r["load_1min"], 2) for r in rs],
                          "aggregate_tok_s_by_round": [round(r["aggregate_tok_s"], 1) for r in rs],
                          "per_stream_tok_s_by_round": [round(r["per_stream_tok_s"] or 0, 1) for r in rs]})
        result = {"date": time.strftime("%Y-%m-%d"), "mode": "throughput", "max_tokens": args.max_tokens,
                  "device": servers[configs[0][0]][2].get("device"), "model": servers[configs[0][0]][2]["model"],
                  "configs": table, "failures": failures[:20], "failed": len(failures),
                  "load_1min_start_end": [round(x, 2) for x in (t_load0, os.getloadavg()[0])],
                  "server_health": {p: httpx.get(s[1] + "/health", timeout=5).json() for p, s in servers.items()}}
        print(json.dumps(result, indent=1))
        print("| config | streams | aggregate tok/s (median, range) | per-stream tok/s | TTFT s | "
              "x first config in the same round (median, range) |", file=sys.stderr)
        for t in table:
            name = f"BatchGenerator n_seq {t['parallel']} (no HTTP)" if t["direct"] else f"--parallel {t['parallel']}"
            print(f"| {name} | {t['streams']} | {t['aggregate_tok_s_median']} "
                  f"({t['aggregate_tok_s_range'][0]}-{t['aggregate_tok_s_range'][1]}) | {t['per_stream_tok_s_median']} "
                  f"| {t['ttft_s_median']} | {t['ratio_to_first_in_round_median']}x "
                  f"({t['ratio_to_first_in_round_range'][0]}-{t['ratio_to_first_in_round_range'][1]}) |",
                  file=sys.stderr)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0 if not failures else 1
    finally:
        for proc, _, _ in servers.values():
            stop_server(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-d", "--device", default="cpu")
    ap.add_argument("-c", "--n-ctx", type=int, default=None, help="the server's KV-cache length per slot")
    ap.add_argument("--parallel", type=int, default=None, help="metalattn serve --parallel (default: its own)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 24 (128 with --throughput)")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole load (default 900)")
    ap.add_argument("--throughput", action="store_true", help="aggregate decode tok/s of concurrent streams")
    ap.add_argument("--configs", default="1x1,8x8",
                    help="--throughput: PARALLELxSTREAMS configurations, alternated (default 1x1,8x8); a trailing d "
                         "(8x8d) runs that many streams on an in-process BatchGenerator, no HTTP")
    ap.add_argument("--rounds", type=int, default=5, help="--throughput: timed rounds per configuration")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = 128 if args.throughput else 24
    if args.throughput:
        return throughput(args)
    assert 0 < args.requests <= 5000 and 0 < args.clients <= 64

    proc, url, health = start_server(args, args.parallel)
    try:
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
            "parallel": health.get("parallel"),
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
        stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
