"""metalattn chat: driven through a pipe (answers, history, /system, /reset checked against Model.generate) and
through a pseudo-terminal (Ctrl-C stops an answer but not the program, Ctrl-D exits). Every wait is bounded."""

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

import metalattn
from metalattn import testing


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return str(testing.write_synthetic_gguf(tmp_path_factory.mktemp("chat") / "small.gguf", n_ctx=512))


def test_piped_chat_keeps_history_system_and_reset(small):
    lines = ["hello", "/system be brief", "what?", "/reset", "ok", "/nonsense"]
    p = subprocess.run([sys.executable, "-m", "metalattn", "chat", "-m", small, "-d", "cpu", "-n", "10", "-v"],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    answers = [a.rstrip("\n") for a in p.stdout.split(">>> ") if a.strip()]
    ref = metalattn.load(small, device="cpu")

    def gen(msgs):
        return ref.generate(ref.apply_chat_template(msgs), max_tokens=10)

    sysm = {"role": "system", "content": "be brief"}
    a1 = gen([{"role": "user", "content": "hello"}])
    a2 = gen([sysm, {"role": "user", "content": "hello"}, {"role": "assistant", "content": a1},
              {"role": "user", "content": "what?"}])
    a3 = gen([sysm, {"role": "user", "content": "ok"}])
    assert answers == [a1, a2, a3]
    assert "(system prompt set)" in p.stderr and "(conversation cleared)" in p.stderr
    assert "unknown command /nonsense" in p.stderr
    stats = re.findall(r"\[prompt (\d+) tokens \((\d+) cached\)", p.stderr)
    assert len(stats) == 3 and stats[0][1] == "0"


class Pty:
    """A child process on a pseudo-terminal: the terminal turns ^C into SIGINT and ^D into end of input."""

    def __init__(self, argv):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the program at once
            try:
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.buf = b""

    def read_until(self, pattern: bytes, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while pattern not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} within {timeout} s; got {self.buf[-400:]!r}")
            r, _, _ = select.select([self.fd], [], [], min(left, 0.2))
            if r:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                if not data:
                    raise AssertionError(f"the program ended before {pattern!r}; got {self.buf[-400:]!r}")
                self.buf += data
        i = self.buf.index(pattern) + len(pattern)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def read_some(self, n: int, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while len(self.buf) < n and time.monotonic() < deadline:
            r, _, _ = select.select([self.fd], [], [], 0.1)
            if r:
                self.buf += os.read(self.fd, 4096)
        assert len(self.buf) >= n, f"only {self.buf!r} within {timeout} s"
        out, self.buf = self.buf, b""
        return out

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def alive(self) -> bool:
        return os.waitpid(self.pid, os.WNOHANG) == (0, 0)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            try:  # drain the terminal so the child never blocks on a full buffer
                if select.select([self.fd], [], [], 0.05)[0]:
                    self.buf += os.read(self.fd, 4096)
            except OSError:
                pass
        self.kill()
        raise AssertionError(f"the chat did not exit within {timeout} s")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs a pseudo-terminal")
def test_terminal_ctrl_c_stops_the_answer_and_ctrl_d_exits(tmp_path):
    # ~4 ms/token here: an answer of up to 3,000 tokens runs ~12 s unless Ctrl-C stops it
    path = testing.write_synthetic_gguf(tmp_path / "slow.gguf", n_layers=8, d_model=512, d_ff=1024, n_heads=8,
                                        n_kv_heads=4, vocab_size=512, n_ctx=4096)
    t = Pty([sys.executable, "-m", "metalattn", "chat", "-m", str(path), "-d", "cpu", "-n", "3000", "-v"])
    try:
        t.read_until(b">>> ", 60)
        t.send(b"tell me a long story\r")
        t.read_until(b"story\r\n", 10)  # the terminal's echo of the line
        t.read_some(20, 10)  # the answer is streaming
        t0 = time.monotonic()
        t.send(b"\x03")
        t.read_until(b"[stopped]", 5)
        stats = t.read_until(b">>> ", 5)
        assert time.monotonic() - t0 < 3
        m = re.search(rb"\[prompt (\d+) tokens \((\d+) cached\), first token [\d.]+ ms, (\d+) tokens", stats)
        assert m and int(m.group(3)) < 1500, stats
        assert t.alive()
        # the next turn reuses the conversation in the KV cache
        t.send(b"go on\r")
        t.read_until(b"on\r\n", 10)
        t.read_some(20, 10)
        t.send(b"\x03")
        t.read_until(b"[stopped]", 5)
        stats = t.read_until(b">>> ", 5)
        m = re.search(rb"\[prompt (\d+) tokens \((\d+) cached\)", stats)
        assert m and int(m.group(2)) > 10, stats
        # Ctrl-C at the prompt does not quit either. (A SIGINT in the instant between readline printing the prompt
        # and its select() is only acted on at the next key: CPython's readline, not ours; a person never types
        # that fast, so wait a moment.)
        time.sleep(0.3)
        t.send(b"\x03")
        t.read_until(b"Ctrl-D", 5)
        t.send(b"/reset\r")
        t.read_until(b"(conversation cleared)", 5)
        t.read_until(b">>> ", 5)
        assert t.alive()
        t.send(b"\x04")
        assert t.wait(15) == 0
    finally:
        t.kill()
