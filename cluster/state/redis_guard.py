"""A circuit breaker and a private thread pool for the head's Redis calls.

Every Redis call the head makes while serving (ledger steps, lease renewals, the reaper, the
request log, the status publisher) goes through ``RedisGuard.call``:

1. The call runs on the guard's own bounded ``ThreadPoolExecutor`` (``max_workers`` threads,
   at most ``max_pending`` calls queued), never on asyncio's default executor, which
   tokenization uses: a slow Redis cannot starve the request path.
2. While the breaker is closed (Redis up), the call runs; a connection error or timeout opens
   the breaker: one warning is logged for the outage, the call fails with
   ``RedisUnavailableError`` and a daemon thread starts probing Redis (``PING`` every
   ``probe_interval_s``).
3. While the breaker is open, every call fails at once with ``RedisUnavailableError`` (no
   socket, no timeout) and is counted in ``dropped[kind]``.
4. When a probe succeeds, the breaker closes, the recovery is logged (outage length, calls
   dropped) and ``outages`` (the count of outages seen) tells callers that a resync is due.

Callers decide what a dropped call means: the ledger writer keeps its steps for replay, the
request log and the status publisher skip one record.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.engine.errors import PdserveError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Errors that mean "Redis is unreachable", as opposed to a refused command.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisUnavailableError(PdserveError):
    """Redis is down (or the guard's queue is full): the call was not made."""

    grpc_status = "UNAVAILABLE"
    http_status = 503


@dataclass(frozen=True, slots=True)
class RedisGuardStats:
    """What the guard saw, for ``pdserve status`` and metrics."""

    up: bool
    outages: int
    down_for_s: float
    dropped: dict[str, int]


class RedisGuard:
    """Runs Redis calls on a private pool and fails fast while Redis is down (module doc)."""

    def __init__(self, client: redis.Redis, *, max_workers: int = 4, max_pending: int = 256,
                 probe_interval_s: float = 0.5,
                 on_drop: Callable[[str], None] | None = None,
                 on_state: Callable[[bool], None] | None = None) -> None:
        if max_workers < 1 or max_pending < max_workers:
            raise ValueError(f"need max_workers >= 1 and max_pending >= max_workers, "
                             f"got {max_workers}, {max_pending}")
        if not probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be > 0, got {probe_interval_s}")
        self.client = client
        self.max_pending = max_pending
        self.probe_interval_s = probe_interval_s
        self._on_drop = on_drop
        self._on_state = on_state
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="pdserve-redis")
        self._lock = threading.Lock()
        self._pending = 0
        self._down_since: float | None = None
        self._dropped: Counter[str] = Counter()
        self._dropped_this_outage = 0
        self._closed = threading.Event()
        self.outages = 0
        self._notify_state(True)   # a guard starts up: the gauge says so from the start, not first at a recovery

    # ------------------------------------------------------------------ state
    @property
    def up(self) -> bool:
        return self._down_since is None

    def stats(self) -> RedisGuardStats:
        with self._lock:
            down = 0.0 if self._down_since is None else time.monotonic() - self._down_since
            return RedisGuardStats(self._down_since is None, self.outages, down, dict(self._dropped))

    # ------------------------------------------------------------------ calls
    async def call(self, kind: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the guard's pool; ``RedisUnavailableError`` when down."""
        if not self.up:
            self._drop(kind)
            raise RedisUnavailableError(f"Redis is down; {kind} not written")
        with self._lock:
            if self._pending >= self.max_pending:
                full = True
            else:
                full = False
                self._pending += 1
        if full:
            self._drop(kind)
            raise RedisUnavailableError(f"{self.max_pending} Redis calls already queued; {kind} not written")
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        except UNREACHABLE as exc:
            self.trip(exc)
            self._drop(kind)
            raise RedisUnavailableError(f"Redis unreachable; {kind} not written: {exc}") from exc
        finally:
            with self._lock:
                self._pending -= 1

    def trip(self, exc: BaseException) -> None:
        """Open the breaker (once per outage) and start probing in the background."""
        with self._lock:
            if self._down_since is not None or self._closed.is_set():
                return
            self._down_since = time.monotonic()
            self._dropped_this_outage = 0
            self.outages += 1
        logger.warning("Redis unreachable (%s): ledger, request log and status writes are "
                       "degraded until it answers again; probing every %.1f s",
                       exc, self.probe_interval_s)
        self._notify_state(False)
        threading.Thread(target=self._probe, name="redis-probe", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- internal
    def _drop(self, kind: str) -> None:
        with self._lock:
            self._dropped[kind] += 1
            self._dropped_this_outage += 1
        if self._on_drop is not None:
            try:
                self._on_drop(kind)
            except Exception:  # a metrics failure must not turn into a request failure
                logger.exception("redis drop metric failed")

    def _probe(self) -> None:
        while not self._closed.wait(self.probe_interval_s):
            try:
                self.client.ping()
            except UNREACHABLE:
                continue
            except redis.RedisError as exc:  # e.g. LOADING: up, not ready yet
                logger.debug("Redis probe: %s", exc)
                continue
            with self._lock:
                down_for = time.monotonic() - (self._down_since or time.monotonic())
                dropped = self._dropped_this_outage
                self._down_since = None
            logger.warning("Redis is back after %.1f s; %d writes were dropped meanwhile "
                           "(ledger steps are replayed)", down_for, dropped)
            self._notify_state(True)
            return

    def _notify_state(self, up: bool) -> None:
        if self._on_state is not None:
            try:
                self._on_state(up)
            except Exception:
                logger.exception("redis state metric failed")
