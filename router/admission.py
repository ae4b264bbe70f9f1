"""Admission control: a bound on requests in flight and on requests waiting for a slot.

A request takes a slot for its whole life (queued in the engine, prefilling, streaming).
When all slots are taken it waits in a FIFO queue; when that queue is full too, it is refused
at once with ``OverloadedError`` (gRPC RESOURCE_EXHAUSTED, HTTP 429 + Retry-After).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.engine.errors import OverloadedError


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_in_flight: int = 256
    max_queued: int = 256
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s}")


class Admission:
    """Used from one event loop only."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.rejected_total = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in line if needed; raise ``OverloadedError`` if the line is full."""
        if self._in_flight < self.config.max_in_flight and not self._waiters:
            self._in_flight += 1
            return
        if len(self._waiters) >= self.config.max_queued:
            self.rejected_total += 1
            raise OverloadedError(
                f"server is at capacity ({self._in_flight} requests in flight, {len(self._waiters)} queued); "
                f"retry after {self.config.retry_after_s:g} s",
                retry_after_s=self.config.retry_after_s,
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot over: _in_flight is already counted for us
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # got the slot just as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # release() may have popped it already
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._in_flight -= 1

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()
