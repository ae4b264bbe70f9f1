"""Process bookkeeping from ``/proc`` for tests that start process trees (Ray heads, nodes).

A process is identified by (pid, start time) so that a recycled pid is never mistaken for a
survivor.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rindex(")") + 2:].split()


def _all() -> dict[int, list[str]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            out[int(entry)] = fields
    return out


def _alive(fields: list[str]) -> bool:
    return fields[0] not in ("Z", "X")  # a zombie has exited; only its parent's wait is missing


def descendants(root: int) -> set[Proc]:
    """``root`` and every live process below it."""
    procs = _all()
    children: dict[int, list[int]] = {}
    for pid, f in procs.items():
        children.setdefault(int(f[1]), []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in procs and _alive(procs[pid]):
            found.add((pid, int(procs[pid][19])))
        todo.extend(children.get(pid, []))
    return found


def in_session(sid: int) -> set[Proc]:
    """Every live process of session ``sid`` (a child started with ``start_new_session``)."""
    return {(pid, int(f[19])) for pid, f in _all().items() if int(f[3]) == sid and _alive(f)}


def survivors(procs: set[Proc]) -> set[Proc]:
    """Those of ``procs`` still running (same pid and start time)."""
    now = _all()
    return {(pid, start) for pid, start in procs
            if pid in now and int(now[pid][19]) == start and _alive(now[pid])}


def wait_gone(procs: set[Proc], timeout_s: float) -> set[Proc]:
    """Wait (bounded) until none of ``procs`` runs; returns the ones still running."""
    deadline = time.monotonic() + timeout_s
    while (left := survivors(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def describe(procs: set[Proc]) -> list[str]:
    out = []
    for pid, _ in sorted(procs):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        out.append(f"{pid}: {cmd[:120]}")
    return out
