"""One Redis-protocol server per data directory: an exclusive ``flock`` on ``DIR/pdserve.lock``.

Two servers appending to one AOF corrupt it, so a second ``EmbeddedRedis`` on a directory in use
is refused. Life cycle:

1. ``DataDirLock(dir).acquire()`` takes the lock without waiting, or raises
   ``DataDirLockedError`` naming the directory and its holder (the pids recorded in the file).
2. The owner hands ``fd`` to the server it starts (``pass_fds``): the lock is then held while
   either runs, so a server that outlived its owner (a head killed with SIGKILL) still keeps a
   second one off the directory until it is stopped (``pdserve down``).
3. ``record(server_pid)`` writes the owner's and the server's pid into the file, for that error.
4. ``release()`` closes the owner's descriptor: the lock is free once its server has exited too.
   A lock whose holders all died is already free (the kernel drops it with its last descriptor):
   the stale file is simply taken over, and the server then loads the directory's AOF.

A bare ``fcntl.flock``, not ``filelock`` (which the other locks use): the descriptor itself is
handed to the server and the holders' pids are written into the locked file, neither of which
``filelock`` offers (it keeps its descriptor private and never lets a child inherit it).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from pdserve.cluster.pids import pid_alive
from pdserve.engine.errors import PdserveError

LOCK_NAME = "pdserve.lock"


class DataDirLockedError(PdserveError):
    """Another server (or its owner) holds the data directory's lock."""


class DataDirLock:
    """The exclusive lock of one data directory (see the module doc)."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.path = Path(data_dir) / LOCK_NAME
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> DataDirLock:
        """Take the lock now or raise ``DataDirLockedError``; a no-op while held."""
        if self.fd is not None:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirLockedError(
                f"the Redis data directory {self.path.parent} is in use: {self.holder()}; stop that "
                f"server first (`pdserve down` if a pdserve head started it) or use another redis.data_dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.record(None)
        return self

    def record(self, server_pid: int | None) -> None:
        """Write who holds the lock: this process and, once started, its server."""
        if self.fd is None:
            return
        text = json.dumps({"owner_pid": os.getpid(), "server_pid": server_pid})
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)

    def holder(self) -> str:
        """The holder as the file records it, in words (for the refusal)."""
        try:
            info = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            info = {}
        owner, server = info.get("owner_pid"), info.get("server_pid")
        if not isinstance(owner, int):
            return f"locked by a process that left no pid in {self.path}"
        words = f"locked by pid {owner}"
        if isinstance(server, int):
            words += f" (its server: pid {server})"
        if not pid_alive(owner):
            words += f"; pid {owner} no longer runs, its server still does"
        return words

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the server's inherited descriptor keeps the lock until it exits
            self.fd = None

