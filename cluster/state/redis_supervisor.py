"""Keeps the head's embedded Redis running: a server that dies is started again.

Life cycle:

1. ``start()`` runs a daemon thread that checks the server process every ``check_interval_s``.
2. When the process has exited on its own (crash, OOM kill, ``kill -9``), the thread logs a
   warning with its exit code and starts it again on the same port, password and data
   directory; with ``appendonly`` on, the server reloads its AOF, so the KV ledger survives
   (up to the last second of writes: ``appendfsync everysec``).
3. A start that fails is retried with exponential backoff (capped at ``max_backoff_s``); each
   failure is logged. ``restarts`` counts the successful restarts.
4. ``stop()`` ends the thread; stopping the server itself stays with its owner.

While the server is down, clients see connection errors; ``RedisGuard`` turns those into fast
failures and a background probe, so nothing waits on the restart.
"""

from __future__ import annotations

import logging
import threading

from pdserve.cluster.state.redis_server import EmbeddedRedis, RedisServerError

logger = logging.getLogger(__name__)


class RedisSupervisor:
    """Restarts an ``EmbeddedRedis`` that died (see the module doc)."""

    def __init__(self, server: EmbeddedRedis, *, check_interval_s: float = 0.5,
                 max_backoff_s: float = 10.0) -> None:
        if not check_interval_s > 0:
            raise ValueError(f"check_interval_s must be > 0, got {check_interval_s}")
        if not max_backoff_s >= check_interval_s:
            raise ValueError(f"max_backoff_s must be >= check_interval_s, got {max_backoff_s}")
        self.server = server
        self.check_interval_s = check_interval_s
        self.max_backoff_s = max_backoff_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RedisSupervisor:
        if self._thread is not None:
            raise RuntimeError("supervisor already started")
        self._thread = threading.Thread(target=self._run, name="redis-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.check_interval_s):
            code = self.server.exit_code()
            if code is None:
                continue
            logger.warning("embedded Redis on port %d exited with code %s; restarting it "
                           "(data dir %s, aof=%s)", self.server.port, code, self.server.data_dir,
                           self.server.appendonly)
            self._restart()

    def _restart(self) -> None:
        backoff = self.check_interval_s
        while not self._stop.is_set():
            try:
                self.server.start_again()
            except (RedisServerError, OSError) as exc:
                logger.error("embedded Redis restart failed (retrying in %.1f s): %s", backoff, exc)
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            self.restarts += 1
            logger.warning("embedded Redis restarted on port %d in %.2f s (restart #%d)",
                           self.server.port, self.server.last_start_s or 0.0, self.restarts)
            return
