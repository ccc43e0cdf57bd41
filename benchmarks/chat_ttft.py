"""Time to first token per turn of a chat, with prefix reuse and without.

    python benchmarks/chat_ttft.py [-m MODEL] [-d cpu] [--turns 10] [--max-tokens 48] [--json out.json]

One model answers every turn with Model.stream(reuse_prefix=True) (only the new turn's tokens are prefilled);
a second model on the same file answers the same prompts from an empty cache (the whole history prefilled each
turn). Greedy, so both give the same answers (checked). TTFT = time from the stream call to its first chunk
(tokenizing excluded: the prompt's ids are passed in).
"""

import argparse
import json
import sys
import time

import metalattn

QUESTIONS = [
    "What is the capital of France?",
    "Tell me one fact about its history.",
    "What river flows through it?",
    "Name a famous museum there.",
    "What is displayed in that museum?",
    "Who painted the Mona Lisa?",
    "When did he live?",
    "What else did he invent or design?",
    "Summarize our conversation in one sentence.",
    "Thank you! Any travel tip for Paris?",
    "And what should I eat there?",
    "Goodbye!",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-d", "--device", default="cpu")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--system-words", type=int, default=0,
                    help="start the chat with a system prompt of this many words of tests/data/english_prose.txt "
                         "(a long history from the first turn)")
    ap.add_argument("--json", default=None, help="write the per-turn figures here")
    args = ap.parse_args(argv)
    reuse = metalattn.load(args.model, device=args.device, n_threads=args.threads)
    fresh = metalattn.load(args.model, device=args.device, n_threads=args.threads)
    for m in (reuse, fresh):  # warm-up: first calls page the weights in
        m.generate("Hello", max_tokens=4)
    reuse.reset()
    msgs, rows = [], []
    if args.system_words:
        import pathlib

        prose = (pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "english_prose.txt").read_text()
        doc = " ".join(prose.split()[:args.system_words])
        msgs.append({"role": "system", "content": "Answer questions; here is a text to refer to.\n\n" + doc})
    print(f"{reuse.path.name} on {reuse.device}, {args.turns} turns, answers up to {args.max_tokens} tokens")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT reuse ms':>14} {'TTFT fresh ms':>14} {'same':>5}")
    for turn in range(args.turns):
        msgs.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        ids = reuse.tokenize(reuse.apply_chat_template(msgs))
        out = {}
        for name, m, kw in (("reuse", reuse, {"reuse_prefix": True}), ("fresh", fresh, {})):
            t0 = time.perf_counter()
            s = m.stream(ids, max_tokens=args.max_tokens, **kw)
            first = next(s)
            ttft = time.perf_counter() - t0
            text = first.text + "".join(c.text for c in s)
            out[name] = (ttft, text, m.last_stats.cached_tokens)
        same = out["reuse"][1] == out["fresh"][1]
        rows.append({"turn": turn + 1, "prompt_tokens": len(ids), "cached_tokens": out["reuse"][2],
                     "ttft_reuse_ms": out["reuse"][0] * 1e3, "ttft_fresh_ms": out["fresh"][0] * 1e3, "same": same})
        r = rows[-1]
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {r['ttft_reuse_ms']:>14.1f} "
              f"{r['ttft_fresh_ms']:>14.1f} {str(same):>5}", flush=True)
        msgs.append({"role": "assistant", "content": out["reuse"][1]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": reuse.path.name, "device": reuse.device, "threads": reuse.n_threads,
                       "max_tokens": args.max_tokens, "system_words": args.system_words, "turns": rows}, f, indent=1)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
