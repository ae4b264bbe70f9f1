"""Process liveness and identity on this host (the head's state file, the per-host core table
and the clean-up of a dead head use it).

A pid alone does not name a process: pids are reused. ``start_ticks`` (the start time in clock
ticks since boot, from ``/proc/PID/stat``) together with the pid does, within one boot
(``boot_id``).
"""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True while a process with this id exists (also one of another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3, the state, first);
    None when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rindex(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when it does not run (a zombie
    counts as gone: it has exited, only its parent's wait is missing)."""
    fields = proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def same_process(pid: int, ticks: int | None) -> bool:
    """True while ``pid`` runs and is the process that started at ``ticks`` (not a reuse of its
    pid); with ``ticks`` None, only whether the pid runs."""
    if ticks is None:
        return pid_alive(pid)
    return start_ticks(pid) == ticks


def boot_id() -> str | None:
    """This boot's id (start ticks compare only within one boot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
