"""The grammar compile process: proves, within a time budget, that a grammar compiles.

xgrammar's compile cannot be cancelled, so a thread cannot enforce a budget: a schema nested 900
deep ran for 35 s. Each engine's ``GrammarBook`` therefore first compiles a grammar here, in a
child process that is killed when the budget is up. Life of one compile:

1. The first compile starts the child (``python -m pdserve.engine.grammar_process``: exec'd, never
   forked from a process that holds torch's threads). It sets its niceness to ``COMPILE_NICENESS``,
   asks to be killed with the thread that started it, reads the model's vocabulary as xgrammar's
   serialized ``TokenizerInfo`` (one frame) and answers ``R`` (ready). Its start is not part of
   any request's budget.
2. ``compile`` sends the spec (one frame) and waits at most ``timeout_s`` for the verdict:
   ``O`` (it compiled) or ``E`` and the parser's message (a ``GrammarError``, the request's 400).
3. No verdict in time: the child is killed, and the request gets a ``GrammarError`` naming
   ``structured.compile_timeout_s``. A child that died mid-compile (a crash on hostile input)
   ends its request the same way. Either way a fresh child starts at once, so that its ~2 s of
   imports overlap the wait for the next compile instead of adding to it.
4. ``close`` (or the parent's end: EOF on the child's stdin, or the death signal) ends the child.

Frames are a 4-byte big-endian length and the bytes. The child's stdout is kept for frames only;
anything a library prints goes to its stderr, which is the parent's.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import time

from pdserve.engine.errors import GrammarError, InvalidRequestError
from pdserve.engine.grammar_spec import StructuredOutput, build_grammar

logger = logging.getLogger(__name__)

# The niceness of every compile (this child, and the book thread that compiles again in the
# engine's process). A worker's compiles share its pinned cores with its engine: at 10 and more
# they are starved while the engine steps (nice 19: ~1.5% of a busy core, so the child's imports
# alone took over 120 s beside a decoding stream); at 5 a compile gets about a quarter of a busy
# core, and the engine's steps slow by at most that for at most the budget.
COMPILE_NICENESS = 5
START_TIMEOUT_S = 120.0   # importing xgrammar (and torch) in the child: ~2 s on an idle core
_HEADER = struct.Struct(">I")


class GrammarProcess:
    """The parent's side: one child, started on first use and again after each kill. Not
    thread-safe: one thread (the ``GrammarBook``'s) calls it."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float) -> None:
        self._info = tokenizer_info_json.encode()
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._answered_ready = False
        self.started = 0     # children started (1 + the kills, unless one died alone)
        self.timeouts = 0    # compiles that ran out of budget

    def compile(self, kind: str, spec: str) -> None:
        """Return when ``spec`` compiled within the budget; raise ``GrammarError`` otherwise."""
        proc = self._ready()
        what = kind.replace("_", " ")
        _write_frame(proc.stdin.fileno(), json.dumps({"kind": kind, "spec": spec}).encode())
        reply = _read_frame(proc.stdout.fileno(), time.monotonic() + self.timeout_s)
        if reply is None:
            died = proc.poll()
            self._kill()
            self._spawn()
            if died is not None:
                raise GrammarError(f"the {what} could not be compiled: the compiler died on it (exit status {died})")
            self.timeouts += 1
            raise GrammarError(f"the {what} did not compile within {self.timeout_s:g} s "
                               f"(structured.compile_timeout_s); simplify it")
        if reply[:1] == b"E":
            raise GrammarError(reply[1:].decode(errors="replace"))
        if reply != b"O":
            self._kill()
            raise RuntimeError(f"the grammar compile process answered {reply[:16]!r}")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.stdin.close()   # the child's cue to exit
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    # ------------------------------------------------------------------ child
    def _ready(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._spawn()
        proc = self._proc
        if not self._answered_ready:
            if _read_frame(proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S) != b"R":
                self._kill()
                raise RuntimeError(f"the grammar compile process did not start within {START_TIMEOUT_S:g} s")
            self._answered_ready = True
            logger.info("grammar compile process %d ready", proc.pid)
        return proc

    def _spawn(self) -> None:
        """Start a child and hand it the vocabulary; ``_ready`` waits for its answer."""
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.grammar_process", str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._proc, self._answered_ready = proc, False
        self.started += 1
        _write_frame(proc.stdin.fileno(), self._info)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes | None:
    """``n`` bytes from ``fd``; None at EOF or when ``deadline`` (``time.monotonic()``) passes."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(fd: int, deadline: float | None) -> bytes | None:
    header = _read_exactly(fd, _HEADER.size, deadline)
    return None if header is None else _read_exactly(fd, _HEADER.unpack(header)[0], deadline)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when the thread that started it ends (prctl
    PR_SET_PDEATHSIG), and leave at once if the parent is already gone."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: EOF on stdin still ends the child
        pass
    if os.getppid() != parent_pid:
        sys.exit(0)


def main() -> None:
    """The child: verdicts for specs read from stdin until EOF."""
    _die_with_parent(int(sys.argv[1]))
    try:   # absolute, not an increment: the child already inherits the book thread's niceness
        os.setpriority(os.PRIO_PROCESS, 0, COMPILE_NICENESS)
    except OSError:
        pass
    frames = os.dup(1)
    os.dup2(2, 1)   # stray prints cannot corrupt a frame
    info_json = _read_frame(0, None)
    if info_json is None:
        return
    import xgrammar


    info = xgrammar.TokenizerInfo.deserialize_json(info_json.decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write_frame(frames, b"R")
    while (frame := _read_frame(0, None)) is not None:
        job = json.loads(frame)
        try:
            compiler.compile_grammar(build_grammar(StructuredOutput(job["kind"], job["spec"])))
            reply = b"O"
        except InvalidRequestError as exc:
            reply = b"E" + str(exc).encode()
        except Exception as exc:  # xgrammar's own errors: the spec's fault
            reply = b"E" + f"the {job['kind'].replace('_', ' ')} could not be compiled: {exc}".encode()
        _write_frame(frames, reply)


if __name__ == "__main__":
    main()
