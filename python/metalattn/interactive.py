"""`metalattn chat`: an interactive terminal chat through the model's own chat template.

Each turn renders the whole conversation with the template and streams the answer with
`Model.stream(reuse_prefix=True)`: the conversation so far is already in the KV cache, so only the new user
message (and the template's few tokens around it) is prefilled and the answer starts at once, however long the
history. Commands: /reset (forget the conversation), /system TEXT (set the system prompt; /system alone clears it),
/help, /exit. Ctrl-C stops the current answer (its text so far stays in the history), Ctrl-D exits.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, List, Optional

HELP = ("commands: /reset clears the conversation, /system TEXT sets the system prompt (/system alone removes it), "
        "/help, /exit; Ctrl-C stops an answer, Ctrl-D exits")


def run_chat(model, system: Optional[str] = None, max_tokens: Optional[int] = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, verbose: bool = False,
             read: Callable[[str], str] = input, out=None, err=None) -> int:
    """Runs the chat loop until end of input (Ctrl-D) or /exit; returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    if read is input and sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:  # pragma: no cover - platforms without readline
            pass
    history: List[dict] = []
    print(f"metalattn chat: {model.path.name} on {model.device} (context {model.n_ctx} tokens). {HELP}",
          file=err, flush=True)
    turn = 0
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            out.write("\n")
            out.flush()
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            print("(Ctrl-D or /exit quits)", file=err, flush=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/exit", "/quit", "/bye"):
                return 0
            if cmd == "/reset":
                history.clear()
                print("(conversation cleared)", file=err, flush=True)
            elif cmd == "/system":
                system = arg.strip() or None
                print(f"(system prompt {'set' if system else 'removed'})", file=err, flush=True)
            elif cmd in ("/help", "/?"):
                print(HELP, file=err, flush=True)
            else:
                print(f"unknown command {cmd}; {HELP}", file=err, flush=True)
            continue

        history.append({"role": "user", "content": line})
        head = [{"role": "system", "content": system}] if system else []
        try:
            ids = model.tokenize(model.apply_chat_template(head + history))
        except KeyboardInterrupt:  # before the answer began: forget the message
            history.pop()
            out.write("\n")
            print("[stopped]", file=err, flush=True)
            continue
        while len(ids) >= model.n_ctx - 1 and len(history) > 1:  # forget the oldest turns to make room
            del history[:2 if len(history) > 2 else 1]
            ids = model.tokenize(model.apply_chat_template(head + history))
            print("(the conversation filled the context: the oldest turn was dropped)", file=err, flush=True)
        if len(ids) >= model.n_ctx:
            history.pop()
            print(f"(this message alone fills the context of {model.n_ctx} tokens)", file=err, flush=True)
            continue
        room = model.n_ctx - len(ids)
        n = room if max_tokens is None else min(max_tokens, room)
        answer = []
        stopped = False
        t0 = time.perf_counter()
        t_first = None
        gen = model.stream(ids, max_tokens=n, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=None if seed is None else seed + turn, reuse_prefix=True)
        try:
            for chunk in gen:
                if t_first is None:
                    t_first = time.perf_counter() - t0
                answer.append(chunk.text)
                out.write(chunk.text)
                out.flush()
        except KeyboardInterrupt:
            stopped = True
        finally:
            gen.close()
        out.write("\n")
        out.flush()
        if stopped:
            print("[stopped]", file=err, flush=True)
        history.append({"role": "assistant", "content": "".join(answer)})
        turn += 1
        if verbose:
            s = model.last_stats
            ttft = f"{t_first * 1e3:.1f} ms" if t_first is not None else "-"
            print(f"[prompt {s.prompt_tokens} tokens ({s.cached_tokens} cached), first token {ttft}, "
                  f"{s.generated_tokens} tokens, {s.decode_tokens_per_second:.1f} tok/s, "
                  f"{'stopped' if stopped else s.finish_reason}]", file=err, flush=True)
