"""The processes a head starts, found again after the head died, and ended.

A head killed with SIGKILL runs no clean-up: its Valkey server and some of Ray's processes
(agents) run on. This module lets ``pdserve down`` end them, ``pdserve status`` name them and
``pdserve up`` refuse to start beside them. Life cycle:

1. The head gets a random id in its environment (``HEAD_ID_ENV``; ``up`` sets it for the head
   it starts, a foreground head sets it for itself); every process the head starts (the embedded
   Valkey, Ray's GCS, raylet, agents and workers) inherits it. ``HeadIdentity.of_this_process()``
   is what the head records in ``state.json``: that id, its pid and start time, its session and
   this boot's id.
2. ``HeadIdentity.alive()``: the head runs while its pid runs with the recorded start time (a
   reused pid is not the head).
3. ``leftovers(identity)``: this user's live processes, the head aside, that carry the id in
   their environment or (the head led its own session, as ``up`` starts it) belong to that
   session and started after the head. Another user's process, or one that matches neither, is
   never listed. (A Ray worker may overwrite its environment with its process title; the
   session still finds it.)
4. ``stop_leftovers(identity)``: SIGTERM to each (Valkey writes its AOF, Ray's processes exit),
   a bounded wait, SIGKILL to what is left, a bounded wait until none runs, and again while new
   ones show up (a raylet starting a worker); returns those still running. Each signal goes
   through a pidfd opened after the start time was checked again, so it reaches only the
   process that was listed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.pids import boot_id, proc_stat, same_process, start_ticks

logger = logging.getLogger(__name__)

HEAD_ID_ENV = "PDSERVE_HEAD_ID"
TERM_WAIT_S = 10.0   # Valkey's AOF write and Ray's own shutdown fit in this
KILL_WAIT_S = 5.0


def new_head_id() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class HeadIdentity:
    """Who a head was: enough to tell it (and what it started) from whatever reuses its pid."""

    pid: int
    start_ticks: int | None = None
    head_id: str | None = None
    sid: int | None = None
    boot_id: str | None = None

    @classmethod
    def of_this_process(cls) -> HeadIdentity:
        pid = os.getpid()
        return cls(pid, start_ticks(pid), os.environ.get(HEAD_ID_ENV) or None, os.getsid(0), boot_id())

    @classmethod
    def from_state(cls, state: dict) -> HeadIdentity:
        """From ``state.json`` (one written before these fields existed gives the pid alone)."""
        def opt_int(key: str) -> int | None:
            value = state.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        return cls(int(state["pid"]), opt_int("pid_start_ticks"), state.get("head_id") or None,
                   opt_int("sid"), state.get("boot_id") or None)

    def as_state(self) -> dict:
        return {"pid": self.pid, "pid_start_ticks": self.start_ticks, "head_id": self.head_id,
                "sid": self.sid, "boot_id": self.boot_id}

    @property
    def leads_session(self) -> bool:
        """True for a head started by ``up`` (its own session); a foreground head shares the
        operator's session, which is never searched."""
        return self.sid is not None and self.sid == self.pid

    def same_boot(self) -> bool:
        return self.boot_id is None or boot_id() in (None, self.boot_id)

    def alive(self) -> bool:
        return self.same_boot() and same_process(self.pid, self.start_ticks)


@dataclass(frozen=True, slots=True)
class Proc:
    """One process, named by pid and start time."""

    pid: int
    start_ticks: int
    name: str

    def __str__(self) -> str:
        return f"{self.pid} ({self.name})"


def describe(procs: list[Proc]) -> str:
    return ", ".join(map(str, procs))


def leftovers(identity: HeadIdentity) -> list[Proc]:
    """This user's live processes that the head started (see the module doc, step 3)."""
    if not identity.same_boot():
        return []  # the machine restarted since: nothing of that head runs
    marker = f"\0{HEAD_ID_ENV}={identity.head_id}\0".encode() if identity.head_id else None
    uid, me = os.getuid(), os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (me, identity.pid):
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        fields = proc_stat(pid)
        if fields is None or fields[0] in ("Z", "X"):
            continue
        ticks, sid = int(fields[19]), int(fields[3])
        in_session = (identity.leads_session and sid == identity.sid and identity.start_ticks is not None
                      and ticks >= identity.start_ticks)
        if in_session or (marker is not None and marker in _environ(pid)):
            found.append(Proc(pid, ticks, _name(pid)))
    return sorted(found, key=lambda p: p.pid)


def stop_leftovers(identity: HeadIdentity, *, term_wait_s: float = TERM_WAIT_S,
                   kill_wait_s: float = KILL_WAIT_S, rounds: int = 3) -> tuple[list[Proc], list[Proc]]:
    """End what the head left (module doc, step 4): (those stopped, those still running)."""
    stopped: dict[int, Proc] = {}
    left: list[Proc] = []
    for _ in range(rounds):
        found = leftovers(identity)
        if not found:
            return list(stopped.values()), []
        logger.info("stopping %d process(es) of head %d: %s", len(found), identity.pid, describe(found))
        left = end(found, term_wait_s=term_wait_s, kill_wait_s=kill_wait_s)
        stopped.update((p.pid, p) for p in found if p not in left)
    left = leftovers(identity)
    return list(stopped.values()), left


def end(procs: list[Proc], *, term_wait_s: float = TERM_WAIT_S, kill_wait_s: float = KILL_WAIT_S) -> list[Proc]:
    """SIGTERM, wait, SIGKILL, wait; returns those still running."""
    running = [p for p in procs if _signal(p, signal.SIGTERM)]
    running = _wait_gone(running, term_wait_s)
    for p in running:
        logger.warning("process %s ignored SIGTERM for %.0f s: killing it", p, term_wait_s)
        _signal(p, signal.SIGKILL)
    return _wait_gone(running, kill_wait_s)


def _signal(proc: Proc, sig: int) -> bool:
    """Send ``sig`` to ``proc`` if it is still that process; False when it is gone."""
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            return False
        try:  # the descriptor pins this process: checked here, signalled below, the same one
            if start_ticks(proc.pid) != proc.start_ticks:
                return False
            signal.pidfd_send_signal(fd, sig)
            return True
        except ProcessLookupError:
            return False
        finally:
            os.close(fd)
    if start_ticks(proc.pid) != proc.start_ticks:
        return False
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(procs: list[Proc], timeout_s: float) -> list[Proc]:
    deadline = time.monotonic() + timeout_s
    while True:
        procs = [p for p in procs if start_ticks(p.pid) == p.start_ticks]
        if not procs or time.monotonic() >= deadline:
            return procs
        time.sleep(0.1)


def _environ(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return b"\0" + Path(f"/proc/{pid}/environ").read_bytes() + b"\0"
    return b""


def _name(pid: int) -> str:
    """A short, recognisable name: the last part of the command line's first three words
    (``valkey-server redis.conf``, ``python3 -u agent.py``), else the kernel's name for it."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        argv = []
    words = [os.path.basename(a.decode(errors="replace")) for a in argv[:3] if a]
    if words:
        return " ".join(words)[:100]
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return "?"
